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


def test_a_conversation_stays_on_its_server_while_that_one_is_healthy_and_not_much_busier() -> None:
    a, b = "http://a:1", "http://b:1"
    c = client(a, b)
    c.in_flight.update({a: 10, b: 6})
    assert c.pick_server() == b  # least busy
    assert c.pick_server(prefer=a) == a  # 10 <= 1.25 x 6 + 4
    c.in_flight[a] = 12
    assert c.pick_server(prefer=a) == b  # 12 > 11.5: too much busier
    c.in_flight[a] = 0
    c.down_until[a] = 1.0
    assert c.pick_server(prefer=a) == b  # a down server is never preferred
    assert c.pick_server(prefer="http://gone:1") == b  # a server not configured here: least busy


def test_it_counts_each_servers_tokens_and_keeps_its_last_error_for_the_load_report() -> None:
    """What worker/loadreport.py reads (``produce servers``' tok/s, slow and last error), from real answers of the
    simulator in-process: a 200 adds its completion tokens to its server, a 503 is its last error and "unavailable"."""
    import aiohttp

    from sglang_sim import SimConfig, serve
    from tests.sim_inprocess import FAST, gen_body
    from worker.sglang import GenerateError

    async def run() -> None:
        failing = SimConfig(time_scale=1000.0, error_rates=((503, 1.0),))
        async with serve(FAST, port=0) as good, serve(failing, port=0) as bad, aiohttp.ClientSession() as session:
            for sim in (good, bad):
                c = SGLangClient(session, WorkerConfig(servers=(sim.url,)))
                try:
                    gen = await c.generate(gen_body(max_new_tokens=32), 32)
                except GenerateError:
                    assert c.tokens[sim.url] == 0 and c.last_error[sim.url][0].startswith("HTTP 503")
                    assert sim.url in c.unavailable_at and sim is bad
                else:
                    assert c.tokens[sim.url] == gen.completion_tokens > 0 and sim is good
                    assert sim.url not in c.last_error and sim.url not in c.unavailable_at

    asyncio.run(run())
