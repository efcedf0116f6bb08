"""rq-dashboard shows budgetq's jobs as an operator needs them: per dataset, queued, and discarded with a reason,
and every page (the Workers page too) works while workers run chunks.

The dashboard runs as a real process with the compose file's ``dashboard`` command (``produce dashboard``:
rq-dashboard 0.9.0's app with RQ's JSON serializer everywhere, deletes disabled) and basic auth from the
``RQ_DASHBOARD_*`` variables, as the container runs it; only the bind address and port are this test's. The
Redis holds real chunk jobs (producer.session.loop.enqueue_chunks) of two datasets, one closed and discarded by the
ledger's scripts, and the assertions read the JSON endpoints the dashboard's pages poll. With real ``rq worker``
processes busy on chunks (the simulator answering slowly), headless Chromium (Debian's ``chromium``) loads the
Queues, Jobs and Workers pages, through basic auth, and each must show its content.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import redis

from budget.ledger import Ledger
from demo.stack import RedisServer, free_port
from producer.session.attach import JobSettings
from producer.session.loop import Item, enqueue_chunks, make_queue
from tests.dashboard_proc import AUTH, BAD, GOOD, Dashboard
from tests.procs import wait_for
from worker.sglang import CLOSE_REASON

pytest.importorskip("rq_dashboard")

OPEN, CLOSED = "glaive_fc", "code_instruct"


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


def test_the_jobs_tab_opens_on_budgetqs_queue(dashboard: Dashboard, two_datasets: dict[str, list[str]]) -> None:
    """The navbar's Jobs link names no queue: it opens on budgetq's, not on RQ's "default" with "No jobs"."""
    status, body = dashboard.request("GET", "/0/view/jobs", GOOD)
    assert status == 200, body[:300]
    page = body.decode()
    assert 'id="select-queue" title="Queue name" value="budgetq"' in page
    assert "all the queued jobs on queue <strong>budgetq</strong>" in page and 'value="default"' not in page



def test_the_budget_page_shows_produce_status_screen(dashboard: Dashboard, two_datasets: dict[str, list[str]],
                                                      r: "redis.Redis") -> None:
    """PREFIX/budget is the tokens view rq-dashboard lacks: produce status's screen (budget, used, reserved, tok/s,
    eta, servers down), behind the same basic auth."""
    from budget.runstate import RunState
    from producer.ops.status import all_status, status_text
    for name in (OPEN, CLOSED):
        RunState(r).register(name, "{}", time.time())
    Ledger(r).set_budget(OPEN, 12_000)
    assert dashboard.request("GET", "/budget")[0] == 401
    status, body = dashboard.request("GET", "/budget", GOOD)
    assert status == 200, body[:300]
    shown = html.unescape(re.search(r"<pre>(.*)</pre>", body.decode(), re.S).group(1))  # type: ignore[union-attr]
    assert shown == status_text(r, all_status(r))
    assert re.search(rf"^{OPEN} +\w+ +open +0 +12,000 ", shown, re.M), shown
    assert re.search(rf"^{CLOSED} .* closed +0 +0 ", shown, re.M), shown


# ------------------------------------------------------------------ a real browser while workers are busy

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
#: Set to a directory to keep the browser's screenshots of the three pages (docs/img/ holds such ones).
SCREENSHOTS_ENV = "BUDGETQ_DASHBOARD_SCREENSHOTS"
BUSY = OPEN


def chromium() -> str:
    """Debian's chromium (scripts/bootstrap.sh installs it for the tests): required in CI, else skipped."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed: BUDGETQ_TEST_DEPS=1 scripts/bootstrap.sh installs it")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def browse(dash: Dashboard, path: str, *, screenshot: Path | None = None) -> str:
    """The page's DOM after its scripts ran (rq-dashboard fills its tables from JSON by XHR), as Chromium in a
    fresh profile renders it, logged in through the URL's basic auth credentials. The virtual time budget lets
    the page's first poll finish; the caller retries until the content it awaits is there."""
    user, password = AUTH["RQ_DASHBOARD_USERNAME"], AUTH["RQ_DASHBOARD_PASSWORD"]
    url = f"http://{user}:{password}@127.0.0.1:{dash.port}{path}"
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        argv = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=4000"]
        if screenshot is not None:
            subprocess.run([*argv, f"--screenshot={screenshot}", "--window-size=1280,520", url],
                           capture_output=True, timeout=120, check=True)
        done = subprocess.run([*argv, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def page_text(dom: str) -> str:
    body = dom[dom.find("<body"):]
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", body, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body)))


def await_page(dash: Dashboard, path: str, wanted: list[str], timeout: float = 90.0,
               screenshot: Path | None = None) -> str:
    """Load `path` in the browser until its text holds every string of `wanted` (bounded by `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        text = page_text(browse(dash, path))
        missing = [w for w in wanted if w not in text]
        if not missing:
            if screenshot is not None:
                browse(dash, path, screenshot=screenshot)
            return text
        assert "Internal Server Error" not in text, text[:2000]
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: {missing} not shown after {timeout}s; the page says: {text[:2000]}")


def busy_workers(r: "redis.Redis", names: list[str]) -> dict[str, str]:
    """{worker name: the chunk job it is running} for the workers of `names` that run one now."""
    from rq import Worker
    from rq.serializers import JSONSerializer
    out = {}
    for w in Worker.all(connection=r, serializer=JSONSerializer):
        job_id = w.get_current_job_id()
        if w.name in names and job_id:
            out[w.name] = job_id
    return out


@pytest.mark.e2e
def test_every_page_works_in_a_browser_while_workers_are_busy(
        dashboard: Dashboard, r: "redis.Redis", sim_factory: Callable[..., Any],
        workers: Callable[..., Any]) -> None:
    chromium()  # skipped (or failed, in CI) before anything starts
    # Two requests at a time per worker, six samples a chunk, 2 tokens/s: each worker stays on its chunk (a
    # started job, its current job) for minutes, far longer than the test.
    sim = sim_factory("--tokens-per-second-per-request", "2", "--mean-tokens", "1000", "--length-dist", "fixed")
    Ledger(r).set_budget(BUSY, None)
    chunks = [[Item(f"{BUSY}-{c}-{i}", [1, 2, 3, 4], False) for i in range(6)] for c in range(4)]
    ids = enqueue_chunks(r, make_queue(r), BUSY, chunks, sampling_params={"max_new_tokens": 400}, think=None,
                         settings=JobSettings())
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="2")
    names = ["gpu0-1", "gpu0-2"]
    procs = [pool.start(n) for n in names]
    try:
        wait_for(lambda: len(busy_workers(r, names)) == 2, 60, "both workers running a chunk")
        current = busy_workers(r, names)
        assert set(current.values()) == set(ids[:2])

        # The JSON the pages poll: all 200, the Workers list with each worker's current chunk.
        listed = {w["name"]: w for w in data(dashboard, "/0/data/workers.json")["workers"]}
        assert set(listed) == set(names)
        for name, job_id in current.items():
            assert listed[name]["state"] == "busy" and listed[name]["current_job"]["job_id"] == job_id
        queues = {q["name"]: q for q in data(dashboard, "/0/data/queues.json")["queues"]}
        assert queues["budgetq"]["started_job_registry_count"] == 2 and queues["budgetq"]["count"] == 2
        started = data(dashboard, "/0/data/jobs/budgetq/started/8/asc/1.json")["jobs"]
        assert sorted(j["id"] for j in started) == sorted(current.values())

        shots = Path(os.environ[SCREENSHOTS_ENV]) if os.environ.get(SCREENSHOTS_ENV) else None
        if shots is not None:
            shots.mkdir(parents=True, exist_ok=True)
        described = [f"{BUSY}: 6 samples ({BUSY}-{c}-0 .. {BUSY}-{c}-5)" for c in range(4)]
        queues_page = await_page(dashboard, "/", ["budgetq", "Started"],
                                 screenshot=shots / "dashboard-busy-queues.png" if shots else None)
        assert re.search(r"budgetq 2 0 0 2 0 0 0\b", queues_page), queues_page  # queued .. canceled
        await_page(dashboard, "/0/view/jobs/budgetq/started/8/asc/1",
                   [dict(zip(ids, described, strict=True))[job_id] for job_id in current.values()],
                   screenshot=shots / "dashboard-busy-jobs.png" if shots else None)
        await_page(dashboard, "/0/view/jobs/budgetq/queued/8/asc/1", described[2:])
        running = sorted(current.values())[0]  # the job page of a chunk being dispatched
        await_page(dashboard, f"/0/view/job/{running}", [running, dict(zip(ids, described, strict=True))[running], "started"])
        workers_page = await_page(dashboard, "/0/view/workers", [*names, *current.values()],
                                  screenshot=shots / "dashboard-busy-workers.png" if shots else None)
        assert "Loading" not in workers_page
        for name, job_id in current.items():  # each worker's row names its own chunk
            assert re.search(rf"{name} worker\.rqworker\.run_chunk\(.*?'chunk': '{job_id}'", workers_page), workers_page
    finally:
        for proc in procs:  # their requests would take minutes to finish: a warm stop would wait for them
            proc.kill()
            proc.wait(10)


def test_dashboard_command_refuses_half_auth_and_an_unreachable_redis(redis_url: str) -> None:
    from click.testing import CliRunner

    from producer.cli import main
    half = CliRunner().invoke(main, ["dashboard", "--redis-url", redis_url], env={
        "RQ_DASHBOARD_USERNAME": "ops", "RQ_DASHBOARD_PASSWORD": ""})
    assert half.exit_code == 2 and "give both --username and --password" in half.output
    exposed = CliRunner().invoke(main, ["dashboard", "--host", "10.0.0.5", "--redis-url", redis_url],
                                 env={"RQ_DASHBOARD_USERNAME": "", "RQ_DASHBOARD_PASSWORD": ""})
    assert exposed.exit_code == 2 and "exposes the dashboard beyond this machine" in exposed.output
    down = CliRunner().invoke(main, ["dashboard", "--redis-url", f"redis://127.0.0.1:{free_port()}/0"],
                              env={"RQ_DASHBOARD_USERNAME": "", "RQ_DASHBOARD_PASSWORD": ""})
    assert down.exit_code == 1 and "cannot reach Redis" in down.output

