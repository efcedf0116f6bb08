"""Ledger calls made by many coroutines, sent in one Redis round trip per event-loop iteration.

Why: the worker's event loop is its request thread, and the ledger's redis-py client is synchronous. Called
one at a time, admit + commit cost ~400 µs of blocked loop per sample, most of it waiting for replies, and
that was 60-70% of the loop's time against a fast server (docs/performance.md, figure 3). Requests that end
in the same loop iteration, and the free slots a chunk fills at once, now share one pipeline: the round trip
is paid once per batch instead of once per call.

How: ``call`` queues the ledger call and returns a future; the first call of a batch schedules ``flush`` with
``call_soon``, so it runs after every callback that was already ready when the batch began (every response
that arrived in the same epoll wake-up). Each script stays atomic on its own and idempotent, so batching
changes no budget decision and a resend after a lost connection is harmless (budget/ledger.py).

Why on the loop and synchronous: two ways to also take the wait for Redis off the loop were measured and lost
(bench/overhead.py and a micro benchmark of 64 admits + 64 commits; docs/performance.md figure 3): an
asyncio Redis client costs ~2x the CPU per call of redis-py's synchronous client with hiredis (66-74 against
34-35 µs a sample), and a helper thread hands the GIL back and forth with the loop. Batched, the blocked time
is ~30 µs a sample.
"""
from __future__ import annotations

import asyncio
from typing import Any

from budget.ledger import Call, Ledger, T


class Batcher:
    """Lives on one event loop; ``call`` must be called from that loop."""

    def __init__(self, ledger: Ledger, max_batch: int = 256) -> None:
        self.ledger = ledger
        self.max_batch = max_batch
        self._calls: list[tuple[Call[Any], asyncio.Future[Any]]] = []
        self._scheduled = False
        self.batches = 0  # flushes so far, and calls they carried: for tests and benchmarks
        self.calls = 0

    def call(self, call: Call[T]) -> "asyncio.Future[T]":
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._calls.append((call, fut))
        if len(self._calls) >= self.max_batch:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self.flush)
        return fut

    def flush(self) -> None:
        self._scheduled = False
        batch, self._calls = [(c, f) for c, f in self._calls if not f.cancelled()], []
        if not batch:
            return
        self.batches += 1
        self.calls += len(batch)
        try:
            replies = self.ledger.run_many([c for c, _ in batch])
        except Exception as exc:  # the connection failed: every call of the batch gets the error to retry
            for _, fut in batch:
                fut.set_exception(exc)
            return
        for (_, fut), reply in zip(batch, replies):
            if isinstance(reply, Exception):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)
