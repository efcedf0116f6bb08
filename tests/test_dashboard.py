"""rq-dashboard shows budgetq's jobs as an operator needs them: per dataset, queued, and discarded with a reason.

rq-dashboard runs as a real process (``python -m rq_dashboard``, its console entry point ``rq_dashboard.cli:main``)
with the compose file's ``dashboard`` command (JSON serializer, deletes disabled) and basic auth from the
``RQ_DASHBOARD_*`` variables, as the container runs it; only the bind address and port are this test's. (In one
process rq-dashboard's CLI can build its app only once: its blueprint is module state, which is why
tests/test_compose.py stubs ``Flask.run`` in-process while this module starts a server of its own.) The Redis
holds real chunk jobs (producer.enqueue.enqueue_chunks) of two datasets, one closed and discarded by the
ledger's scripts, and the assertions read the JSON endpoints the dashboard's pages poll.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis

from budget.ledger import Ledger
from producer.enqueue import Item, JobSettings, enqueue_chunks, make_queue
from tests.redis_server import RedisServer, free_port
from worker.chunk import CLOSE_REASON

pytest.importorskip("rq_dashboard")

ROOT = Path(__file__).resolve().parents[1]
AUTH = {"RQ_DASHBOARD_USERNAME": "dash-test-user", "RQ_DASHBOARD_PASSWORD": "dash-test-password"}
GOOD = {"Authorization": "Basic " + base64.b64encode(
    f"{AUTH['RQ_DASHBOARD_USERNAME']}:{AUTH['RQ_DASHBOARD_PASSWORD']}".encode()).decode()}
BAD = {"Authorization": "Basic " + base64.b64encode(f"{AUTH['RQ_DASHBOARD_USERNAME']}:wrong".encode()).decode()}
OPEN, CLOSED = "glaive_fc", "code_instruct"


def compose_dashboard_argv(redis_url: str, port: int) -> list[str]:
    """The compose service's command, pointed at this session's Redis and bound on loopback."""
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    args = [str(a) for a in compose["services"]["dashboard"]["command"]]
    assert args[0] == "rq-dashboard"
    for flag, value in (("--redis-url", redis_url), ("--bind", "127.0.0.1"), ("--port", str(port))):
        args[args.index(flag) + 1] = value
    assert not any("$" in a for a in args), args
    return args


class Dashboard:
    """An rq-dashboard process on a free loopback port; `request` talks to it over HTTP."""

    def __init__(self, redis_url: str, logdir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "rq_dashboard", *compose_dashboard_argv(redis_url, self.port)[1:]]
        with open(logdir / "rq-dashboard.log", "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **AUTH})
        deadline = time.monotonic() + 20
        while self.request("GET", "/")[0] != 401:  # up, and refusing the unauthenticated
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rq-dashboard did not start: {(logdir / 'rq-dashboard.log').read_text()}")
            time.sleep(0.05)  # polling a port that is coming up: there is no event to await

    def request(self, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base + path, method=method, headers=headers or {},
                                     data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
        except OSError:
            return 0, b""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def dashboard(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dashboard]:
    """One dashboard for the module; each test's data comes from the `r` fixture, which flushes Redis first."""
    dash = Dashboard(redis_server.url, tmp_path_factory.mktemp("dashboard"))
    yield dash
    dash.stop()


@pytest.fixture
def two_datasets(r: "redis.Redis") -> dict[str, list[str]]:
    """3 queued chunks of OPEN; 2 chunks of CLOSED, closed by a budget of 0 and discarded like a worker does."""
    def enqueue(name: str, n_chunks: int) -> list[str]:
        chunks = [[Item(f"{name}-{c}-{i}", [1, 2, 3], False) for i in range(2)] for c in range(n_chunks)]
        return enqueue_chunks(r, make_queue(r), name, chunks, sampling_params={"max_new_tokens": 64},
                              think=None, settings=JobSettings())

    ledger = Ledger(r)
    ids = {}
    for name, n in ((OPEN, 3), (CLOSED, 2)):
        ledger.set_budget(name, None)
        ids[name] = enqueue(name, n)
    assert ledger.set_budget(CLOSED, 0) == "closed"
    assert ledger.discard(CLOSED, CLOSE_REASON) == 2
    return ids


def data(dash: Dashboard, path: str) -> Any:
    status, body = dash.request("GET", path, GOOD)
    assert status == 200, (path, status, body[:300])
    return json.loads(body)


def test_basic_auth_guards_pages_and_data(dashboard: Dashboard, two_datasets: dict[str, list[str]]) -> None:
    for path in ("/", "/0/data/queues.json", "/0/data/jobs/budgetq/queued/8/asc/1.json",
                 f"/0/data/job/{two_datasets[OPEN][0]}.json", "/0/view/jobs/budgetq/canceled/8/asc/1"):
        assert dashboard.request("GET", path)[0] == 401, path
        assert dashboard.request("GET", path, BAD)[0] == 401, path
        assert dashboard.request("GET", path, GOOD)[0] == 200, path


def test_queue_counts(dashboard: Dashboard, two_datasets: dict[str, list[str]]) -> None:
    queues = {q["name"]: q for q in data(dashboard, "/0/data/queues.json")["queues"]}
    assert set(queues) == {"budgetq"}
    q = queues["budgetq"]
    assert q["count"] == 3, "only the open dataset's chunks are queued"
    assert q["canceled_job_registry_count"] == 2
    assert q["failed_job_registry_count"] == 0 and q["started_job_registry_count"] == 0


def test_queued_jobs_name_their_dataset_and_samples(dashboard: Dashboard,
                                                    two_datasets: dict[str, list[str]]) -> None:
    page = data(dashboard, "/0/data/jobs/budgetq/queued/8/asc/1.json")
    assert [j["id"] for j in page["jobs"]] == two_datasets[OPEN]
    descriptions = [j["description"] for j in page["jobs"]]
    assert descriptions == [f"{OPEN}: 2 samples ({OPEN}-{c}-0 .. {OPEN}-{c}-1)" for c in range(3)]
    assert page["pagination"]["num_pages"] == 1


def test_discarded_chunks_are_in_the_canceled_registry_with_the_reason(
        dashboard: Dashboard, two_datasets: dict[str, list[str]]) -> None:
    page = data(dashboard, "/0/data/jobs/budgetq/canceled/8/asc/1.json")
    assert sorted(j["id"] for j in page["jobs"]) == two_datasets[CLOSED]
    for job in page["jobs"]:
        assert job["description"].startswith(f"{CLOSED}: 2 samples ({CLOSED}-")
        assert job["description"].endswith(f" [discarded: {CLOSE_REASON}]")
        assert job["exc_info"] is None
    assert OPEN not in json.dumps(page)


def test_job_details(dashboard: Dashboard, two_datasets: dict[str, list[str]]) -> None:
    queued = data(dashboard, f"/0/data/job/{two_datasets[OPEN][1]}.json")
    assert queued["status"] == "queued" and queued["origin"] == "budgetq"
    assert queued["description"] == f"{OPEN}: 2 samples ({OPEN}-1-0 .. {OPEN}-1-1)"
    assert json.loads(queued["metadata"]) == {"dataset": OPEN, "samples": 2, "first": f"{OPEN}-1-0",
                                              "last": f"{OPEN}-1-1"}
    canceled = data(dashboard, f"/0/data/job/{two_datasets[CLOSED][0]}.json")
    assert canceled["status"] == "canceled"
    assert canceled["description"].endswith(f"[discarded: {CLOSE_REASON}]")
    assert json.loads(canceled["metadata"])["dataset"] == CLOSED


def test_pages_render_and_deletes_stay_disabled(dashboard: Dashboard, two_datasets: dict[str, list[str]],
                                                r: "redis.Redis") -> None:
    job = two_datasets[OPEN][0]
    for path in ("/", "/0/view/jobs/budgetq/queued/8/asc/1", "/0/view/jobs/budgetq/canceled/8/asc/1",
                 f"/0/view/job/{job}", "/0/view/workers"):
        assert dashboard.request("GET", path, GOOD)[0] == 200, path
    assert data(dashboard, "/0/data/workers.json") == {"workers": []}
    for path in (f"/job/{job}/delete", "/queue/budgetq/canceled/empty", "/queue/budgetq/queued/empty"):
        status, body = dashboard.request("POST", path, GOOD)
        assert (status, json.loads(body)) == (200, {"status": "DISABLED"}), path
    assert r.exists(f"rq:job:{job}") and r.llen("rq:queue:budgetq") == 3
