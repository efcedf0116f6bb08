"""The event loop's ledger calls: sent in one Redis round trip per batch, off the loop, and waited through an outage.

Why: the worker's event loop is its request thread, and the ledger's redis-py client is synchronous. Called
one at a time, admit + commit cost ~400 µs of blocked loop per sample, most of it waiting for replies, and
that was 60-70% of the loop's time against a fast server (docs/performance.md, figure 3).

How: ``call`` queues the ledger call and returns a future. The first call of a batch schedules ``_flush`` with
``call_soon``, so it runs after every callback that was already ready when the batch began (every response
that arrived in the same epoll wake-up). The batch goes to Redis as one pipeline from a helper thread: the
loop goes on with HTTP while Redis runs the scripts (redis-py releases the GIL while it waits on the socket).
One batch is in flight at a time; calls made meanwhile form the next one, sent as soon as the reply is back,
so batches grow with the load by themselves. Commits of one dataset in a batch merge into one script run, and
a chunk's free slots are admitted by one (budget/ledger.py ``run_many``, ``Call.merge``). Each script decides
each sample as if alone and stays idempotent, so batching changes no budget decision, and a resend after a lost
connection is harmless (budget/ledger.py).

Measured against a zero-latency server (python -m bench.overhead, quiet machine, 64 in flight): one call at a
time 1,297 samples/s; batched on the loop with the synchronous client 1,905; batched from this thread
2,000-2,174. An asyncio Redis client was tried too: it costs about twice the CPU per call (66-74 against
34-35 µs a sample, client side, with hiredis). Beyond speed, the thread keeps a slow Redis (an fsync, a long
discard script) from stalling the loop: responses are still read while ledger calls wait.

Waiting through an outage: a call that finds Redis down (``REDIS_DOWN``) is sent again with a backoff until Redis
answers (``Batcher.call_until_answered``, ``in_thread_until_answered``), so a Redis restart delays the worker's
commits and admissions instead of failing them. Safe because every budget script is idempotent (a resent commit
hits the done guard).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, Awaitable, Callable

import redis

from budget.ledger import REDIS_DOWN, Call, T, run_many

log = logging.getLogger("budgetq.worker")

class BatcherClosed(RuntimeError):
    """A ledger call made after the worker's shutdown closed the batcher."""


Pending = list[tuple[Call[Any], "asyncio.Future[Any]"]]

#: While Redis is down, a waiting call says so in the log once every this many seconds of waiting.
OUTAGE_LOG_EVERY_S = 30
#: The first resend waits this long; each next one twice as long, up to OUTAGE_BACKOFF_CAP_S.
OUTAGE_BACKOFF_S = 0.2
OUTAGE_BACKOFF_CAP_S = 5.0


async def until_answered(what: str, attempt: Callable[[], Awaitable[T]], failed: BaseException | None = None) -> T:
    """``attempt()``'s result, trying again with a backoff for as long as Redis is down (``failed``: the first
    attempt already failed so). ``what`` names the call in the log."""
    delay, waited = OUTAGE_BACKOFF_S, 0.0
    while True:
        if failed is not None:
            if waited == 0.0 or int(waited) // OUTAGE_LOG_EVERY_S != int(waited + delay) // OUTAGE_LOG_EVERY_S:
                log.warning("%s: Redis unavailable (%s); retrying until it is back", what, failed)
            await asyncio.sleep(delay)
            waited += delay
            delay = min(OUTAGE_BACKOFF_CAP_S, delay * 2)
        try:
            return await attempt()
        except REDIS_DOWN as exc:
            failed = exc


async def in_thread_until_answered(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call the ledger in a thread, waiting out a Redis outage: for the rare calls that take a while (a discard
    marks thousands of jobs canceled over several round trips), so responses are still read meanwhile."""
    async def once() -> T:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return await until_answered(what, once)


class Batcher:
    """Lives on one event loop; ``call`` and ``aclose`` must be called from that loop.

    ``aclose`` sends what is queued, waits for the reply, then stops the thread; a call made after it fails
    with ``BatcherClosed`` instead of reaching a thread that is gone (a fire-and-forget call, such as a job's
    progress meta, can still be queued when the worker shuts down).

    ``client`` is the Redis client the calls' scripts are registered on (the ledger's)."""

    def __init__(self, client: "redis.Redis", max_batch: int = 256) -> None:
        self.client = client
        self.max_batch = max_batch
        self._calls: Pending = []
        self._scheduled = False
        self._busy = False  # a batch is on its way to Redis
        self._sent: asyncio.Future[list[Any]] | None = None  # that batch
        self._closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="budgetq-ledger")
        self.batches = 0  # batches sent so far, and calls they carried: for tests and benchmarks
        self.calls = 0

    def call(self, call: Call[T]) -> "asyncio.Future[T]":
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        if self._closed:
            fut.set_exception(BatcherClosed("the worker is shutting down: its ledger thread has stopped"))
            return fut
        self._calls.append((call, fut))
        if not self._scheduled and not self._busy:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    async def call_until_answered(self, what: str, call: Call[T]) -> T:
        """``call``, waiting out a Redis outage: for the calls the loop makes all the time (admit, commit, fail,
        start, finish). The first attempt is awaited directly: this runs twice per sample, and the retry machinery
        is only for outages."""
        try:
            return await self.call(call)
        except REDIS_DOWN as exc:
            return await until_answered(what, lambda: self.call(call), failed=exc)

    async def aclose(self) -> None:
        """Send every queued call and wait for the replies, then stop the thread."""
        while self._calls or self._busy:
            if self._sent is not None:
                await asyncio.wait([self._sent])
            await asyncio.sleep(0)  # the settle callback runs, or the scheduled flush sends what is left
        self._closed = True
        self._pool.shutdown(wait=True)  # idle by now: returns at once

    def _flush(self) -> None:
        self._scheduled = False
        if self._busy:
            return
        live = [(c, f) for c, f in self._calls if not f.cancelled()]
        batch, self._calls = live[:self.max_batch], live[self.max_batch:]
        if not batch:
            return
        self._busy = True
        self.batches += 1
        self.calls += len(batch)
        sent = asyncio.get_running_loop().run_in_executor(self._pool, run_many, self.client, [c for c, _ in batch])
        self._sent = sent
        sent.add_done_callback(lambda done: self._settle(batch, done))

    def _settle(self, batch: Pending, done: "asyncio.Future[list[Any]]") -> None:
        self._busy, self._sent = False, None
        if self._calls:
            self._flush()  # what queued up meanwhile goes out before the callers wake
        exc = done.exception()
        if exc is not None:  # the connection failed: every call of the batch gets the error, to retry
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, fut), reply in zip(batch, done.result(), strict=True):
            if fut.done():
                continue
            if isinstance(reply, Exception):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)
