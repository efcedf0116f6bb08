"""The cost in view (docs/mix.md): each dataset's share of the server's busy time, end to end with a real worker
and the simulator, checked against the busy time the server itself measured."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from tests.demo_data import CODE, GLAIVE
from tests.procs import produce, sim_stats


@pytest.mark.e2e
def test_the_datasets_server_time_is_the_servers_busy_time_shared_out(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    # 8 run at once, and the automatic window keeps more than that in flight: request time is several times server time.
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "100", "--seed", "11", "--max-running", "8")
    pool = workers(sim.url)  # one worker, no BUDGETQ_CONCURRENCY: its window reads the server's load
    pool.start("w1")
    before = sim_stats(sim.url)["busy_integral"]  # the simulator's own warm-up request
    out = tmp_path / "out"
    t0 = time.monotonic()
    done = produce([str(CODE), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300", "--turns",
                    "last", "--chunk-size", "8", "--out", str(out)], redis_url)
    wall = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    busy = sim_stats(sim.url)["busy_integral"] - before
    names = ("code_instruct", "glaive_fc")
    stats = {n: r.hgetall(keys.DatasetKeys(n).stats) for n in names}
    server = {n: int(stats[n].get(b"server_ms", 0)) / 1000 for n in names}
    request = {n: int(stats[n].get(b"request_ms", 0)) / 1000 for n in names}
    chunks = sum(r.hlen(keys.DatasetKeys(n).done) for n in names) // 8 + len(names)
    # The worker counts a request from before it is sent until its answer is read, the server from when it gets it
    # until it answers: the worker's busy time holds the server's. Each chunk's sum is rounded to the millisecond.
    assert busy - 0.001 * chunks <= sum(server.values()) <= wall, (busy, server, wall)
    assert all(server[n] > 0 for n in names), server
    assert sum(server.values()) < sum(request.values()) / 2, (server, request)  # 8 at once: not request time
    manifest = json.loads((out / "glaive_fc" / "manifest.json").read_text())
    assert manifest["extra"]["server_seconds"] == server["glaive_fc"]
    status = produce(["status", "--json"], redis_url)
    assert status.returncode == 0, status.stderr
    rows = {row["name"]: row for row in json.loads(status.stdout)}
    assert rows["code_instruct"]["server_s"] == server["code_instruct"]
    assert "server time" in done.stdout + done.stderr  # the run's summary shows it
