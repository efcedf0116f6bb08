"""Fault injection, short forms: tests/chaos/scenarios.py's scenarios at the "ci" scale (400 prompts, 2 workers x 16).

Each runs on its own redis-server, sglang-sim and real ``rq worker`` processes and checks the promise (nothing
lost, nothing twice, counter == Σ completion_tokens on disk, no unexpected traceback, failures only where
expected) plus the scenario's own bounds. tests/e2e/test_reliability.py holds the short forms of the others (one
Redis kill, Redis restarted empty, the SGLang outage, malformed bodies); docs/reliability.md has the figures.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.run import SCALES
from tests.chaos.scenarios import make_ctx, run_scenario

pytestmark = pytest.mark.e2e


def run_ci(name: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    res = run_scenario(name, make_ctx(SCALES["ci"], tmp_path, tokenizer_dir))
    assert res.ok, f"{name}: " + "; ".join(res.failures()) + f"\nfigures: {res.figures}\n{res.note}"


@pytest.mark.parametrize("name", [
    "worker-kill",  # kill -9 a worker every 3 s with a replacement: all done <= 120 s after, waste <= the windows
    "worker-restart",  # same-name restart refused by rq; a chunk run twice; finished chunks requeued
    "sigterm",  # every worker SIGTERMed mid-run: prompt exits, nothing aborted, nothing redone
    "produce-races",  # two produce at once; produce --detach killed -9 while enqueueing, again and again
    "sglang-faults",  # 503, 429 + Retry-After, 500, resets, hangs, 400s: Retry-After kept, 400s not retried
])
def test_chaos_ci(name: str, tmp_path: Path, tokenizer_dir: Path) -> None:
    run_ci(name, tmp_path, tokenizer_dir)


def test_chaos_redis_connections_black_holed(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Every open connection to Redis goes silent at once (no reset), workers' and produce's: nothing hangs,
    nothing is generated twice (tests/chaos/outage.py; the long forms of the Redis outages are there too)."""
    run_ci("redis-blackhole", tmp_path, tokenizer_dir)


def test_chaos_redis_host_crash_loses_its_last_second(tmp_path: Path, tokenizer_dir: Path) -> None:
    """appendfsync everysec on a host crash: the last second of commits is lost; those samples are generated
    again, nothing is counted twice, every sample ends on disk once (tests/chaos/redis_faults.py redis_host_crash)."""
    run_ci("redis-host-crash", tmp_path, tokenizer_dir)


def test_chaos_redis_restored_from_a_stale_copy(tmp_path: Path, tokenizer_dir: Path) -> None:
    run_ci("redis-stale", tmp_path, tokenizer_dir)
