"""A deadline end to end (docs/mix.md): real rq workers and the simulator; the run ends near its deadline with what
ran finished and counted once, says so, and leaves the rest of the budget unspent."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from tests.demo_data import CODE
from tests.exactly_once import check_exact
from tests.procs import produce, sim_stats


@pytest.mark.e2e
def test_a_run_ends_at_its_deadline_with_what_ran_finished(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                          tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    # ~2 s a request (100 tokens at 50 tok/s), 4 in flight: far fewer than 150 prompts fit in 12 s.
    sim = sim_factory("--tokens-per-second-per-request", "50", "--mean-tokens", "100", "--seed", "5")
    workers(sim.url, BUDGETQ_CONCURRENCY="4").start("w0")
    out = tmp_path / "out"
    t0 = time.time()
    res = produce([str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300", "--turns", "last",
                   "--budget", "1M", "--chunk-size", "4", "--for", "12s", "--out", str(out)], redis_url)
    ended = time.time()
    assert res.returncode == 0, res.stderr
    meta = r.hgetall(keys.DatasetKeys("code_instruct").meta)
    deadline = int(meta[b"deadline"]) / 1000
    assert t0 + 12 <= deadline + 1 and deadline < t0 + 40  # 12 s from when produce read its options
    assert meta[b"status"] == b"closed" and meta[b"closed_by"] == b"deadline"
    assert "deadline reached" in res.stdout, res.stdout
    recs = check_exact(r, out, "code_instruct")
    assert 0 < len(recs) < 150 and sim_stats(sim.url)["completed"] == len(recs)  # every request that ran is kept
    # The last admissions were of requests expected to end by the deadline; the longest may run 6 s (300 tokens).
    assert ended < deadline + 6 + 10, ended - deadline
