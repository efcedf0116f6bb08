"""``produce servers`` and ``produce run``'s pre-flight with real workers (issue 29, "Expected and missing").

Real parts: ``rq worker -w worker.Worker`` processes (one pointed at a port nothing listens on, one at the simulator),
``produce`` as a user runs it. The per-server view is read from what those workers record (budget/serverinfo.py); produce asks no SGLang server for it.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import redis
from rq import Queue

from budget import keys, serverinfo
from sglang_sim.launch import free_port
from tests.demo_data import GLAIVE
from tests.procs import produce, wait_for

pytestmark = pytest.mark.e2e

HOST = socket.gethostname()


def _rows(redis_url: str) -> dict[str, dict[str, Any]]:
    done = produce(["servers", "--json"], redis_url, timeout=60)
    assert done.returncode == 0, done.stderr
    return {row["server"]: row for row in json.loads(done.stdout)["servers"]}


def test_the_view_names_the_dead_server_its_host_and_the_live_one_with_its_load(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "50", "--seed", "29", "--max-running", "32")
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    workers(dead_url, BUDGETQ_CONCURRENCY="8").start("dead0")
    workers(sim.url).start("good0")  # the automatic window: it reads the server's max_running_requests
    dead_name, sim_name = f"{HOST} {dead_url}", f"{HOST} {sim.url}"  # loopback URLs: named with their host

    def recorded() -> bool:
        rows = _rows(redis_url)
        return rows.get(dead_name, {}).get("state") == "down" and \
            rows.get(sim_name, {}).get("max_running_requests") is not None

    wait_for(recorded, 60, "both workers to record their servers")
    table = produce(["servers"], redis_url, timeout=60)
    assert table.returncode == 0, table.stderr
    print(table.stdout)
    first, *lines = table.stdout.splitlines()
    assert first == f"2 rq workers listen on queue {keys.QUEUE_NAME}, on 1 host ({HOST})"
    dead_line = next(x for x in lines if x.startswith(dead_name))
    assert "dead0" in dead_line and "down since " in dead_line and "connection refused" in dead_line
    sim_line = next(x for x in lines if x.startswith(sim_name))
    assert "good0" in sim_line and " ok " in sim_line
    rows = _rows(redis_url)
    assert rows[sim_name]["max_running_requests"] == 32 and rows[sim_name]["window"] is not None
    assert (rows[dead_name]["hosts"], rows[dead_name]["down_workers"]) == ([HOST], ["dead0"])

    # A run through the live worker: its tokens show in what it records.
    run = produce([str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "128", "--max-samples", "16",
                   "--chunk-size", "8", "--out", str(tmp_path / "out")], redis_url)
    assert run.returncode == 0, run.stderr
    assert "2 rq workers listen on queue budgetq" in run.stderr
    wait_for(lambda: any(e["worker"] == "good0" and e["servers"][sim.url]["tokens"] > 0
                         for e in serverinfo.read_load(r)), 30, "good0 to record the tokens it got")


def test_produce_run_with_no_worker_warns_and_the_work_waits_queued(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path) -> None:
    run = produce([str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "128", "--max-samples", "16",
                   "--chunk-size", "8", "--detach", "--out", str(tmp_path / "out")], redis_url)
    assert run.returncode == 0, run.stderr
    warnings = [x for x in run.stderr.splitlines() if "no rq worker listens" in x]
    assert warnings == [f"warning: no rq worker listens on queue {keys.QUEUE_NAME}: start one with `rq worker -w "
                        "worker.Worker -c worker.settings` (REDIS_URL and SGLANG_URL set); the work waits queued"]
    assert Queue(keys.QUEUE_NAME, connection=r).count == 2, "a warning, not a refusal: the chunks are queued"
