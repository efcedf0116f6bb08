"""A ``Dispatcher`` (worker/dispatch.py) built in-process on the test's event loop, as worker/rqworker.py builds one
in a worker, and a poll for a state of that loop's objects."""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import redis

from budget.ledger import Ledger
from worker.config import WorkerConfig
from worker.dispatch import Dispatcher
from worker.sglang import SGLangClient


@contextlib.asynccontextmanager
async def dispatcher(redis_url: str, sim_url: str, concurrency: int, **config: Any) -> AsyncIterator[Dispatcher]:
    """A Dispatcher as worker/rqworker.py builds one, on this event loop; drained and closed on exit."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    cfg = WorkerConfig(servers=(sim_url,), concurrency=concurrency, retry_for=120.0, **config)
    d = Dispatcher(Ledger(redis.Redis.from_url(redis_url)), SGLangClient(session, cfg), cfg)
    try:
        yield d
    finally:
        await asyncio.wait_for(d.drain(), 120)
        await session.close()
        await d.batcher.aclose()  # the job-meta writes, sent without being awaited, go out first


async def until(pred: Callable[[], bool | Awaitable[bool]], what: str, timeout: float = 60.0) -> None:
    """Await a state of this loop's own objects (or of another process when ``pred`` is a coroutine function)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        got = pred()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        assert asyncio.get_running_loop().time() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.01)
