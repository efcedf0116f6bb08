"""``Dispatcher`` (worker/dispatch.py) in-process: the paths end-to-end runs reach only by chance, each on purpose.

Real parts all the same: the simulator over HTTP (a subprocess, tests/conftest.py ``sim_factory``), a real Ledger
on a real redis-server (the session's; a dedicated one where Redis is stopped), an aiohttp session on a real
event loop. Request lengths are exact (``ignore_eos``: every answer is ``max_new_tokens`` long), so a "slow"
chunk's requests outlast whatever the test does meanwhile and a "fast" one's end at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from budget import keys
from budget.ledger import Ledger
from budget.record import VERSION, ChunkPayload
from demo.stack import RedisServer
from producer.session.attach import JobSettings
from producer.session.loop import Item, enqueue_chunks, make_queue
from tests.dispatcher import dispatcher, until
from tests.procs import sim_stats
from worker.config import WorkerConfig
from worker.dispatch import Dispatcher
from worker.sglang import ChunkReport, SGLangClient

DS = "ds"
#: 100 tokens/s per request: a SLOW request (400 tokens) takes ~4 s, a FAST one (2 tokens) ~20 ms.
SIM_ARGS = ("--tokens-per-second-per-request", "100", "--saturation-batch", "64", "--prefix-cache-pages", "0",
            "--prefill-tokens-per-second", "0")
SLOW, FAST = 400, 2


def sampling(max_new: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}


def enqueue(r: "redis.Redis", ids: list[str], max_new: int) -> ChunkPayload:
    """One chunk of ``ids`` as the producer enqueues it (live, queued, each sample held by it); its payload."""
    items = [Item(sid, [11, 12, 13, 14], False) for sid in ids]
    (cid,) = enqueue_chunks(r, make_queue(r), DS, [items], sampling_params=sampling(max_new), think=None,
                            settings=JobSettings())
    return {"v": VERSION, "dataset": DS, "chunk": cid, "sampling_params": sampling(max_new), "think": None,
            "reasoning_parser": "none",
            "samples": [{"id": sid, "input_ids": [11, 12, 13, 14], "opens_think": False} for sid in ids]}


def in_flight(d: Dispatcher) -> int:
    """Requests ``d`` has started and not yet seen end, over all its running chunks."""
    return sum(len(rc.flights) for rc in d.running.values())


# -- FULL admission ----------------------------------------------------------------------------------------
def test_full_while_own_requests_run_waits_for_them_and_never_overspends(r: "redis.Redis", redis_url: str,
                                                                        sim_factory: Any) -> None:
    """strict: each request reserves max_new_tokens. Room for 3 of 10: 3 start, the rest are FULL while ours run;
    each end frees room for one more, until what is left cannot fit and the dataset closes."""
    sim = sim_factory(*SIM_ARGS, "--time-scale", "10")
    ledger = Ledger(r)
    max_new = 50
    ledger.set_mode(DS, "strict", max_new)
    ledger.set_budget(DS, 3 * max_new)
    chunk = enqueue(r, [f"s{i}" for i in range(10)], max_new)

    async def go() -> ChunkReport:
        async with dispatcher(redis_url, sim.url, concurrency=8) as d:
            report = await d.dispatch(chunk)
        return report

    report = asyncio.run(go())
    state = ledger.state(DS)
    # ignore_eos: every answer is max_new long, so exactly 3 fit; strict never starts one that might not fit
    assert report.committed == 3 and state.used == 3 * max_new and state.status == "closed"
    assert report.status == "closed" and report.not_started == 7 and report.failed == 0
    assert sim_stats(sim.url)["submitted"] == 3
    assert r.hlen(keys.DatasetKeys(DS).done) == 3 and r.xlen(keys.DatasetKeys(DS).results) == 3


def test_full_with_nothing_of_ours_in_flight_gives_the_chunk_back(r: "redis.Redis", redis_url: str,
                                                                  sim_factory: Any) -> None:
    """The budget's room is reserved by another worker's request: FULL, and this chunk has nothing running
    that could free it, so it gives its samples back at once ("full") instead of holding them."""
    sim = sim_factory(*SIM_ARGS)
    ledger = Ledger(r)
    max_new = 50
    ledger.set_mode(DS, "strict", max_new)
    ledger.set_budget(DS, max_new + 10)
    other = enqueue(r, ["o0"], max_new)["chunk"]  # another worker's chunk, one request in flight
    assert ledger.start_chunk(DS, other) == "ok"
    assert ledger.admit(DS, "o0", other).reserved == max_new
    chunk = enqueue(r, ["s0", "s1", "s2"], max_new)

    async def go() -> ChunkReport:
        async with dispatcher(redis_url, sim.url, concurrency=4) as d:
            report = await d.dispatch(chunk)
            assert in_flight(d) == 0
        return report

    report = asyncio.run(go())
    assert report.status == "full" and report.not_started == 3 and report.committed == 0
    assert sim_stats(sim.url)["submitted"] == 0
    assert ledger.state(DS).status == "open"  # FULL is not closed: the other request may leave room
    assert chunk["chunk"] not in ledger.live_chunks(DS)  # given back: the producer re-enqueues its samples


# -- warm stop ---------------------------------------------------------------------------------------------
def test_stop_while_dispatching_gives_the_rest_back_and_commits_what_runs(r: "redis.Redis", redis_url: str,
                                                                          sim_factory: Any) -> None:
    sim = sim_factory(*SIM_ARGS)
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    ids = [f"s{i}" for i in range(6)]
    chunk = enqueue(r, ids, SLOW)

    async def go() -> ChunkReport:
        async with dispatcher(redis_url, sim.url, concurrency=2) as d:
            task = asyncio.create_task(d.dispatch(chunk))
            await until(lambda: in_flight(d) == 2, "two requests running")
            assert not task.done()  # waiting for a slot: 4 samples not started
            d.stop()
            report = await task
            assert report.status == "stopped" and report.not_started == 4
            assert chunk["chunk"] in ledger.live_chunks(DS)  # live until its running requests are committed
        return report

    report = asyncio.run(go())
    assert report.committed == 2 and report.failed == 0
    assert sorted(ledger.done_ids(DS)) == ids[:2]
    assert chunk["chunk"] not in ledger.live_chunks(DS)
    assert sim_stats(sim.url)["submitted"] == 2
    assert ledger.state(DS).used == 2 * SLOW


# -- a lost lease ------------------------------------------------------------------------------------------
def test_a_wait_for_a_slot_ends_on_a_stop_or_a_cancel_and_keeps_no_slot(redis_url: str) -> None:
    """The window is full and a dispatch waits for a slot (``Dispatcher._take_slots``): a stop wakes it with no slot
    taken, and a cancelled wait (the job interrupted) leaves every slot to the window, even a slot granted to it in
    the same loop iteration as its cancel. No request is sent: the server URL is never called."""
    async def go() -> None:
        async with dispatcher(redis_url, "http://127.0.0.1:1", concurrency=1) as d:
            stop = asyncio.ensure_future(d.stop_requested.wait())
            for grant in (False, True):
                await d.slots.acquire()  # the window is full
                waiter = asyncio.create_task(d._take_slots(3, stop))
                await asyncio.sleep(0.05)
                assert not waiter.done()
                if grant:
                    d.slots.release()  # the slot goes to the waiter ...
                waiter.cancel()  # ... which is cancelled before it runs again
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
                if not grant:
                    d.slots.release()
                assert not d.slots.locked()
                await d.slots.acquire()  # exactly one slot: the window has its size back
                assert d.slots.locked()
                d.slots.release()
            await d.slots.acquire()
            waiter = asyncio.create_task(d._take_slots(3, stop))
            await asyncio.sleep(0.05)
            d.stop()
            assert await asyncio.wait_for(waiter, 5) == 0
            d.slots.release()
            assert not d.slots.locked()
            stop.cancel()

    asyncio.run(go())


def test_lost_lease_stops_admitting_and_late_commits_hit_the_done_guard(r: "redis.Redis", redis_url: str,
                                                                        sim_factory: Any) -> None:
    """Chunk A runs two slow requests when it is reclaimed (as after a missed lease) and its samples are
    enqueued again as chunk B, which another worker runs at once. A starts nothing more; its two requests end
    after B committed the same samples: A's commits are duplicates, nothing is counted twice."""
    sim = sim_factory(*SIM_ARGS)
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    ids = [f"s{i}" for i in range(6)]
    a = enqueue(r, ids, SLOW)

    async def go() -> tuple[ChunkReport, ChunkReport]:
        async with dispatcher(redis_url, sim.url, concurrency=2) as da, \
                dispatcher(redis_url, sim.url, concurrency=8) as db:
            task = asyncio.create_task(da.dispatch(a))
            await until(lambda: in_flight(da) == 2, "A's two requests running")
            # The lease lapses (set to end in the past; A refreshes it only every 5 s) and the producer reclaims
            # A, then enqueues its unfinished samples again as B.
            assert ledger.start_chunk(DS, a["chunk"], lease_ms=-60_000) == "ok"
            assert ledger.reclaim(DS) == [a["chunk"]]
            b = enqueue(r, ids, FAST)
            rb = await db.dispatch(b)
            await asyncio.wait_for(db.drain(), 60)
            assert sorted(ledger.done_ids(DS)) == ids  # B did every sample while A's two still run
            assert in_flight(da) == 2
            ra = await task  # A's next admission, once a slot frees, is refused: revoked
            await asyncio.wait_for(da.drain(), 60)
        return ra, rb

    ra, rb = asyncio.run(go())
    assert rb.committed == 6 and rb.duplicates == 0
    assert ra.status == "revoked" and ra.not_started == 4
    assert ra.committed == 0 and ra.duplicates == 2  # late commits hit the done guard
    assert ledger.state(DS).used == 6 * FAST  # B's tokens only
    assert r.xlen(keys.DatasetKeys(DS).results) == 6
    assert sim_stats(sim.url)["submitted"] == 2 + 6  # A started nothing after it lost its chunk


def test_a_bug_in_the_lease_refresh_fails_loudly_and_is_not_retried_as_a_redis_hiccup(
        r: "redis.Redis", redis_url: str, sim_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Only a Redis error is a hiccup the lease refresh tries again (the lease has slack for it). Any other error is
    a bug of this code: it ends the lease task with that error, logged once as an error naming the chunk, and the
    chunk starts nothing more and is left to its lease (interrupted, not finished: the producer reclaims it), where
    it used to be a warning every interval while the lease lapsed unseen. The bug here: a flight whose ``future``
    is not a number, which only the predict-mode refresh reads. The requests already running commit, once."""
    sim = sim_factory(*SIM_ARGS)
    ledger = Ledger(r)
    ledger.set_mode(DS, "predict", SLOW)
    ledger.set_budget(DS, None)
    ids = [f"s{i}" for i in range(4)]
    chunk = enqueue(r, ids, SLOW)
    caplog.set_level(logging.WARNING, logger="budgetq.worker")

    async def go() -> tuple[ChunkReport, BaseException | None]:
        async with dispatcher(redis_url, sim.url, concurrency=2, reserve_interval=0.05) as d:
            task = asyncio.create_task(d.dispatch(chunk))
            await until(lambda: in_flight(d) == 2, "two requests running")
            rc = d.running[chunk["chunk"]]
            next(iter(rc.flights.values())).future = None  # type: ignore[assignment]
            await until(rc.lost.is_set, "the end of the lease task", timeout=10)
            assert rc.lease is not None and rc.lease.done()
            report = await task  # its next admission, once a slot frees, is refused: it starts nothing more
            await asyncio.wait_for(d.drain(), 60)
        return report, rc.lease.exception()

    report, error = asyncio.run(go())
    assert isinstance(error, TypeError)
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and chunk["chunk"] in errors[0].getMessage()
    assert errors[0].exc_info is not None and errors[0].exc_info[1] is error  # with its traceback
    assert not [m for m in caplog.messages if m.startswith("lease refresh for")]  # never taken for a Redis error
    assert report.status == "revoked" and report.not_started == 2
    assert report.committed == 2 and report.duplicates == 0
    assert sorted(ledger.done_ids(DS)) == ids[:2] and ledger.state(DS).used == 2 * SLOW
    assert chunk["chunk"] in ledger.live_chunks(DS)  # not finished: left to its lease and the producer's reclaim


# -- Redis down mid-chunk ----------------------------------------------------------------------------------
def test_redis_down_mid_chunk_commits_land_after_it_returns_exactly_once(tmp_path: Path, sim_factory: Any,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path / "redis")  # our own: this test stops it
    server.start()
    try:
        _redis_down_mid_chunk(server, sim_factory, caplog)
    finally:
        server.stop()


def _redis_down_mid_chunk(server: RedisServer, sim_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    sim = sim_factory(*SIM_ARGS)
    r = redis.Redis.from_url(server.url)
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    ids = [f"s{i}" for i in range(4)]
    chunk = enqueue(r, ids, SLOW)
    caplog.set_level(logging.WARNING, logger="budgetq.worker")

    async def go() -> ChunkReport:
        async with dispatcher(server.url, sim.url, concurrency=4) as d:
            report = await d.dispatch(chunk)  # returns once all 4 have started
            assert report.committed == 0 and in_flight(d) == 4
            await asyncio.to_thread(server.stop)  # a clean shutdown: the AOF holds everything so far
            # The requests end while Redis is down: their commits wait for it.
            await until(lambda: any("commit: Redis unavailable" in m for m in caplog.messages), "a commit retry")
            await until(lambda: asyncio.to_thread(lambda: bool(sim_stats(sim.url)["completed"] == 4)),
                        "the requests ended")
            assert in_flight(d) == 4  # nothing committed: still held, still in flight in our books
            await asyncio.to_thread(server.start)  # same port, same AOF
            await asyncio.wait_for(d.drain(), 90)
        return report

    report = asyncio.run(go())
    assert report.committed == 4 and report.duplicates == 0 and report.failed == 0
    k = keys.DatasetKeys(DS)
    assert sorted(ledger.done_ids(DS)) == ids
    assert ledger.state(DS).used == 4 * SLOW
    assert r.xlen(k.results) == 4  # one result each: a resent commit changed nothing
    assert chunk["chunk"] not in ledger.live_chunks(DS)
    assert sim_stats(sim.url)["submitted"] == 4  # no request was sent again
    r.close()


# -- a refused API key -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sim_args, key, status", [
    (("--api-key", "sk-right"), "sk-wrong", 401),  # SGLang's own answer to a wrong key
    (("--api-key", "sk-right"), None, 401),  # no key at all
    (("--error-rate", "403=1"), None, 403),  # what a proxy in front of SGLang may answer instead
], ids=["wrong-key", "no-key", "403"])
def test_refused_key_stops_the_dispatcher_and_gives_every_sample_back(
        r: "redis.Redis", redis_url: str, sim_factory: Any, caplog: pytest.LogCaptureFixture,
        sim_args: tuple[str, ...], key: str | None, status: int) -> None:
    sim = sim_factory(*SIM_ARGS, "--time-scale", "10", *sim_args)
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    ids = [f"s{i}" for i in range(12)]
    first, second = enqueue(r, ids[:8], FAST), enqueue(r, ids[8:], FAST)
    faults: list[str] = []
    caplog.set_level(logging.INFO, logger="budgetq.worker")

    async def go() -> tuple[ChunkReport, ChunkReport]:
        async with dispatcher(redis_url, sim.url, concurrency=4, api_key=key) as d:
            d.on_fault = faults.append
            a = await d.dispatch(first)
            await until(lambda: d.fault is not None, "the configuration fault")
            b = await d.dispatch(second)  # a chunk taken after the fault starts nothing
        return a, b

    a, b = asyncio.run(go())
    assert len(faults) == 1 and str(status) in faults[0] and sim.url in faults[0]
    assert "SGLANG_API_KEY" in faults[0] and ("not set" if key is None else "wrong") in faults[0]
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert [rec.getMessage() for rec in errors] == faults  # one error line, the fault itself
    assert "sk-" not in caplog.text  # never the key
    assert a.status == b.status == "unauthorized" and a.failed == b.failed == 0
    assert a.not_started == 8 and b.not_started == 4 and a.committed == b.committed == 0
    assert ledger.failed(DS) == {} and ledger.state(DS).used == 0 and ledger.done_ids(DS) == {}
    assert ledger.live_chunks(DS) == set()  # both given back: the producer enqueues their samples again
    assert sim_stats(sim.url)["submitted"] == 0 and a.attempts == 4  # one refused request per slot, no retry


def test_other_4xx_are_not_a_key_fault(r: "redis.Redis", redis_url: str, sim_factory: Any) -> None:
    """Only 401 and 403 mean "this worker's key": a 404 or 400 is about the request and fails the sample."""
    sim = sim_factory(*SIM_ARGS, "--error-rate", "404=1")
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    chunk = enqueue(r, ["s0"], FAST)

    async def go() -> tuple[Dispatcher, ChunkReport]:
        async with dispatcher(redis_url, sim.url, concurrency=1, max_attempts=2, backoff_cap=0.01) as d:
            report = await d.dispatch(chunk)
        return d, report

    d, report = asyncio.run(go())
    assert d.fault is None and not d.stopping
    assert report.failed == 1 and ledger.failed(DS)["s0"]["status"] == 404


def test_refused_key_lets_requests_already_running_finish_and_commit(r: "redis.Redis", redis_url: str,
                                                                     sim_factory: Any) -> None:
    """One server accepts the worker (a slow request runs there), the other refuses it: the running request is
    GPU work already paid for, so it finishes and is committed; everything else is given back."""
    good = sim_factory(*SIM_ARGS)
    bad = sim_factory(*SIM_ARGS, "--api-key", "sk-other")
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    ids = [f"s{i}" for i in range(4)]
    chunk = enqueue(r, ids, SLOW)

    async def go() -> tuple[Dispatcher, ChunkReport]:
        session = aiohttp.ClientSession()
        cfg = WorkerConfig(servers=(good.url, bad.url), concurrency=2)
        d = Dispatcher(Ledger(redis.Redis.from_url(redis_url)), SGLangClient(session, cfg), cfg)
        try:
            report = await d.dispatch(chunk)  # two start: one on each server (least in flight)
            assert d.fault is not None and bad.url in d.fault
            await asyncio.wait_for(d.drain(), 60)
        finally:
            await session.close()
            await d.batcher.aclose()  # the job-meta writes, sent without being awaited, go out first
        return d, report

    d, report = asyncio.run(go())
    assert report.status == "unauthorized" and report.committed == 1 and report.failed == 0
    assert report.not_started == 3  # the refused one and the two never started
    assert len(ledger.done_ids(DS)) == 1 and ledger.state(DS).used == SLOW
    assert ledger.failed(DS) == {} and ledger.live_chunks(DS) == set()
    assert sim_stats(good.url)["completed"] == 1 and sim_stats(bad.url)["unauthorized"] == 1
