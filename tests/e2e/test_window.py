"""The automatic window end to end (worker/window.py): real ``rq worker`` processes without BUDGETQ_CONCURRENCY
against sglang-sim, whose /server_info and /v1/loads say what SGLang's do. Seen from the server's side: what runs
and waits there is what the workers' windows sum to."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from demo.stack import free_port
from demo.synthetic import write_prompts
from sglang_sim.launch import SimProcess
from tests.procs import produce, sim_stats, wait_for
from worker.window import headroom

pytestmark = pytest.mark.e2e

#: Requests of ~8 s (800 tokens at 100 tok/s): a window, once full, stays full for the whole test.
SLOW = ("--mean-tokens", "800", "--sigma", "0.2", "--tokens-per-second-per-request", "100")


def sim_args(max_running: int) -> tuple[str, ...]:
    return (*SLOW, "--max-running", str(max_running), "--saturation-batch", str(max_running))


def enqueue(tmp_path: Path, tokenizer_dir: Path, redis_url: str, n: int) -> None:
    """n prompts, every chunk enqueued at once (--detach), so the workers never run out of work."""
    data = write_prompts(tmp_path / "prompts.jsonl", n)
    res = produce([f"prompts={data}", "--tokenizer", str(tokenizer_dir), "--max-tokens", "2048", "--chunk-size", "64",
                   "--out", str(tmp_path / "out"), "--turns", "last", "--detach"], redis_url)
    assert res.returncode == 0, res.stderr


def in_flight(url: str) -> tuple[int, int]:
    s = sim_stats(url)
    return s["running"], s["queued"]


def settled(url: str, capacity: int) -> bool:
    """The server runs all it can, with a small queue: the workers' windows sum to about capacity + headroom."""
    running, queued = in_flight(url)
    return running == capacity and queued <= 2 * headroom(capacity)


def kill(procs: list["subprocess.Popen[bytes]"]) -> None:
    """The test is about windows, not the run's end: kill -9 spares waiting out 8 s requests at teardown."""
    for p in procs:
        p.kill()
        p.wait(10)


@pytest.mark.parametrize("capacity", [24, 200])
def test_two_workers_without_concurrency_fill_the_server_with_a_small_queue(
        capacity: int, redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    # The old fixed 64 each fails both: 128 in flight queue 104 on 24 slots, and leave 72 of 200 empty.
    sim = sim_factory(*sim_args(capacity))
    enqueue(tmp_path, tokenizer_dir, redis_url, 3 * capacity + 200)
    pool = workers(sim.url)
    pool.start("w0")
    pool.start("w1")
    try:
        wait_for(lambda: r.zcard(keys.WINDOW) == 2, 60, "both workers registered on the server")
        wait_for(lambda: settled(sim.url, capacity), 90,
                 f"{capacity} running and at most {2 * headroom(capacity)} queued")
        for name in ("w0", "w1"):
            def shares(n: str = name) -> bool:
                return "2 worker(s) share it" in pool.log(n)
            wait_for(shares, 30, f"{name} says it shares the server")
    finally:
        kill(pool.procs)


def test_an_explicit_concurrency_wins(redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path,
                                      sim_factory: Any, workers: Any) -> None:
    # Short requests (~0.5 s): many windows' worth complete while it is watched; an automatic window would have
    # taken 64 + 6 of the 64 slots after its first look (1 s).
    sim = sim_factory("--mean-tokens", "50", "--sigma", "0.2", "--tokens-per-second-per-request", "100",
                      "--max-running", "64", "--saturation-batch", "64")
    enqueue(tmp_path, tokenizer_dir, redis_url, 400)
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="5")
    pool.start("w0")
    seen: list[int] = []

    def watched() -> bool:
        s = sim_stats(sim.url)
        seen.append(s["running"] + s["queued"])
        return bool(s["completed"] >= 60)

    try:
        wait_for(watched, 90, "60 requests completed")
        assert max(seen) <= 5, seen
        assert not r.exists(keys.WINDOW), "a worker with BUDGETQ_CONCURRENCY registers no automatic window"
        assert "5 requests in flight per worker" in pool.log("w0")
    finally:
        kill(pool.procs)


def test_a_server_restarted_with_another_limit_is_followed(redis_url: str, tokenizer_dir: Path, tmp_path: Path,
                                                           workers: Any) -> None:
    port = free_port()
    enqueue(tmp_path, tokenizer_dir, redis_url, 600)
    first = SimProcess(sim_args(16), port=port)
    first.start()
    pool = workers(first.url)
    pool.start("w0")
    second: SimProcess | None = None
    try:
        wait_for(lambda: settled(first.url, 16), 60, "16 running")
        first.stop()
        second = SimProcess(sim_args(64), port=port)  # same URL, four times the slots
        second.start()
        wait_for(lambda: settled(second.url, 64), 90, "64 running after the restart")
        wait_for(lambda: "runs 64 requests at once" in pool.log("w0"), 30, "the worker says so")
    finally:
        kill(pool.procs)
        first.stop()
        if second is not None:
            second.stop()


def test_behind_the_router_the_capacity_is_the_sum_of_its_servers(tmp_path: Path, sim_factory: Any) -> None:
    from demo.smg import Router
    from worker.window import Prober
    sims = [sim_factory("--max-running", str(n)) for n in (12, 20)]
    with Router([s.url for s in sims], tmp_path / "smg", policy="round_robin") as router:
        load = Prober(router.url, api_key=None, timeout=5).probe()  # the router's own /server_info has no limit
        assert load is not None and (load.capacity, load.running, load.waiting) == (32, 0, 0)
