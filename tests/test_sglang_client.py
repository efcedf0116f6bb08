"""The worker's per-server circuit breaker: open after three failures, one probe at a time, back on success."""
from __future__ import annotations

import asyncio
import time

from worker.config import WorkerConfig
from worker.sglang import SGLangClient


def client(*servers: str) -> SGLangClient:
    return SGLangClient(session=None, config=WorkerConfig(servers=servers))  # type: ignore[arg-type]


def test_a_dead_server_is_avoided_then_probed_again_while_others_are_healthy() -> None:
    async def run() -> None:
        c = client("http://a", "http://b")
        for _ in range(3):
            c._mark("http://a", False)
        assert c.down_until["http://a"] > 0
        assert await c._gate() == ("http://b", False)  # the healthy one takes the load
        c.down_until["http://a"] = time.monotonic() - 0.01  # cooldown over
        assert await c._gate() == ("http://a", True)  # one probe goes to the dead one, even with b healthy
        assert await c._gate() == ("http://b", False)  # only one probe at a time
        c.probing["http://a"] = False
        c._mark("http://a", True, probe=True)
        assert c.down_until["http://a"] == 0.0 and c.pick_server() in ("http://a", "http://b")

    asyncio.run(run())


def test_a_burst_of_failures_opens_the_circuit_once_and_failed_probes_double_the_cooldown() -> None:
    c = client("http://a")
    for _ in range(50):  # many requests in flight die together: not 50 escalations
        c._mark("http://a", False)
    assert c.cooldown["http://a"] == 1.0
    c._mark("http://a", False, probe=True)
    c._mark("http://a", False, probe=True)
    assert c.cooldown["http://a"] == 4.0
    for _ in range(10):
        c._mark("http://a", False, probe=True)
    assert c.cooldown["http://a"] == c.MAX_COOLDOWN_S
