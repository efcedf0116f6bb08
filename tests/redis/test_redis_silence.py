"""A Redis that stops answering must not stop a worker (issue 12, sections 1 and 2).

In process: the worker's real Runtime (event loop, aiohttp session, dispatcher, its own Redis pool) against a
redis-server of this test's own, frozen with SIGSTOP mid-chunk. The loop must go on reading responses while
Redis is frozen (every Redis call of the loop is made off the loop, and the RQ heartbeat on a thread of its
own), and once Redis is back every sample is committed exactly once.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import redis

from budget import keys, runtime
from budget.ledger import Ledger
from budget.record import VERSION, ChunkPayload
from demo.stack import RedisServer
from producer.session.attach import JobSettings
from producer.session.loop import Item, enqueue_chunks, make_queue
from tests.procs import wait_for
from worker import dispatch
from worker.config import WorkerConfig
from worker.rqworker import Runtime

N = 48
#: How long Redis stays frozen at least: past the ledger's socket timeout, so that a Redis call made on the
#: loop would show as a stall of that length.
FROZEN_S = runtime.SOCKET_TIMEOUT_S + 2


def _chunk(r: "redis.Redis", dataset: str, n: int) -> ChunkPayload:
    items = [Item(f"s{i}", [1, 2, 3, i], False) for i in range(n)]
    params = {"max_new_tokens": 64}
    (cid,) = enqueue_chunks(r, make_queue(r), dataset, [items], sampling_params=params, think=None,
                            settings=JobSettings())
    return {"v": VERSION, "dataset": dataset, "chunk": cid, "sampling_params": params, "think": None,
            "reasoning_parser": "none",
            "samples": [{"id": it.id, "input_ids": list(it.input_ids), "opens_think": False} for it in items]}


def test_the_loop_reads_responses_while_redis_is_frozen(tmp_path: Path, sim_factory: Callable[..., Any],
                                                         monkeypatch: Any) -> None:
    server = RedisServer(tmp_path / "redis")  # our own: this test freezes it
    server.start()
    assert server.proc is not None
    rt: Runtime | None = None
    try:
        r = redis.Redis.from_url(server.url, socket_timeout=30)
        Ledger(r).set_budget("ds", None)
        chunk = _chunk(r, "ds", N)
        # ~1.5 s a request: several rounds of 16 slots, so responses are due throughout the freeze.
        sim = sim_factory("--mean-tokens", "30", "--tokens-per-second-per-request", "20", "--sigma", "0.3")
        monkeypatch.setattr(dispatch, "HEARTBEAT_S", 0.5)
        beats: list[float] = []
        # The RQ heartbeat as rq sends it, on a connection with no timeout at all: frozen, it waits for SIGCONT.
        rq_like = redis.Redis.from_url(server.url)

        def heartbeat() -> None:
            rq_like.hset("test:worker", "last_heartbeat", str(time.time()))
            beats.append(time.monotonic())

        config = WorkerConfig(servers=(sim.url,), concurrency=16, reserve_interval=0.2)
        rt = Runtime(r, config, heartbeat=heartbeat)
        read: list[float] = []  # when the loop read each response
        generate = rt.dispatcher.client.generate

        async def counted(*args: Any, **kwargs: Any) -> Any:
            out = await generate(*args, **kwargs)
            read.append(time.monotonic())
            return out

        rt.dispatcher.client.generate = counted  # type: ignore[method-assign]
        senders: set[str] = set()  # the threads that sent Redis commands
        send = redis.connection.AbstractConnection.send_packed_command

        def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
            senders.add(threading.current_thread().name)
            return send(self, *args, **kwargs)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", recorded)
        runner = threading.Thread(target=rt.run_chunk, args=(chunk,), daemon=True)
        runner.start()
        wait_for(lambda: len(read) >= 4, 60, "the first responses")

        server.proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        try:
            while time.monotonic() - frozen_at < FROZEN_S or not any(t > frozen_at + 1 for t in read):
                asyncio.run_coroutine_threadsafe(asyncio.sleep(0), rt.loop).result(timeout=60)  # the loop runs
                assert time.monotonic() - frozen_at < 90, "no response read while Redis was frozen"
                time.sleep(0.05)
            during = [t for t in read if t > frozen_at]
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert len(during) >= 4, f"only {len(during)} responses read while Redis was frozen"
        # The cause, not its symptom (a stall, which only a timing could show): no Redis command is ever sent from
        # the loop's thread. One there would hold the loop for the ledger's socket timeout (5 s), the heartbeat on
        # its timeout-less connection for the whole freeze.
        assert rt.thread.name not in senders and len(senders) > 1, senders

        runner.join(120)
        assert not runner.is_alive()
        rt.close()
        rt = None
        k = keys.DatasetKeys("ds")
        assert r.hlen(k.done) == N and r.xlen(k.results) == N  # every sample committed, each once
        assert len(read) == N  # and generated once: nothing redone
        used = int(r.get(k.used) or 0)
        assert used == sum(int(v) for v in r.hvals(k.done))
        assert beats, "the RQ heartbeat never ran"
    finally:
        if rt is not None:
            rt.close()
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)
        server.kill()


def test_a_silent_connection_is_dropped_and_the_call_resent(redis_server: RedisServer) -> None:
    """budget/runtime.py's settings against a black hole (tests/chaos/blackhole.py): the call on the silenced
    connection times out, is resent on a new one and succeeds, and the log says what happened."""
    from tests.chaos.blackhole import BlackHole
    with BlackHole(redis_server.port) as hole:
        url = f"redis://127.0.0.1:{hole.port}/0"
        client = runtime.connect(url)
        assert client.ping()
        plain = redis.Redis.from_url(url, socket_timeout=1)
        assert plain.ping()
        assert hole.silence() == 2
        with pytest.raises(redis.TimeoutError):  # no retry policy: the silence reaches the caller
            plain.ping()
        warned: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
        logger = logging.getLogger("budgetq.redis")  # directly: a CLI test may have stopped "budgetq" propagating
        logger.addHandler(handler)
        t0 = time.monotonic()
        try:
            assert client.set("silence-test", "1")
        finally:
            logger.removeHandler(handler)
        took = time.monotonic() - t0
        # A timed promise no event can stand for (docs/decisions.md, "The ledger has its own Redis pool"): a silent
        # connection costs one socket timeout, not less (the timeout is ours) and not much more (the call is resent
        # long before a 20 s lease lapses). The upper bound leaves 5 s to a resend that takes milliseconds.
        assert runtime.SOCKET_TIMEOUT_S - 0.5 <= took < runtime.SOCKET_TIMEOUT_S + 5
        assert any("did not answer within" in m for m in warned), warned
        assert redis.Redis.from_url(redis_server.url).get("silence-test") == b"1"


def test_the_worker_pool_copies_the_server_not_the_timeouts(redis_server: RedisServer) -> None:
    rq_like = redis.Redis.from_url(redis_server.url.replace("/0", "/3"), socket_timeout=415)
    own = runtime.like(rq_like)
    kw = own.connection_pool.connection_kwargs
    assert (kw["port"], kw["db"], kw["socket_timeout"]) == (redis_server.port, 3, runtime.SOCKET_TIMEOUT_S)
    assert kw["socket_keepalive"] and kw["health_check_interval"] == runtime.HEALTH_CHECK_INTERVAL_S
    assert own.connection_pool is not rq_like.connection_pool and own.ping()
