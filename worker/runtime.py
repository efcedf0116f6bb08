"""What a worker process keeps between jobs: one event loop, one HTTP session, one Redis ledger.

RQ calls a job function per chunk. Opening an aiohttp session (and an event loop) per job halves a fast
server's request rate, so ``worker.Worker`` creates one Runtime when it starts and every job reuses it.
A job run by any other RQ worker gets a Runtime built on first use, so ``rq worker -S json`` still works.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import aiohttp
import redis

from budget.ledger import Ledger
from budget.payload import ChunkPayload
from worker.chunk import Budgeting, ChunkReport, process_chunk
from worker.config import WorkerConfig
from worker.sglang import SGLangClient

log = logging.getLogger("budgetq.worker")

_current: "Runtime | None" = None


class Runtime:
    def __init__(self, connection: "redis.Redis", config: WorkerConfig,
                 heartbeat: Callable[[], None] | None = None) -> None:
        self.connection = connection
        self.config = config
        self.ledger = Ledger(connection)
        self.budgeting = Budgeting(self.ledger)
        self.heartbeat = heartbeat
        self.loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        self._client: SGLangClient | None = None

    def _ensure_client(self) -> SGLangClient:
        if self._client is None:
            async def make() -> aiohttp.ClientSession:
                # limit=0: aiohttp's default cap of 100 connections would silently cap our concurrency.
                connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
                return aiohttp.ClientSession(connector=connector, raise_for_status=False)
            self._session = self.loop.run_until_complete(make())
            self._client = SGLangClient(self._session, self.config)
        return self._client

    def run_chunk(self, chunk: ChunkPayload) -> ChunkReport:
        client = self._ensure_client()
        task = self.loop.create_task(process_chunk(chunk, ledger=self.ledger, client=client,
                                                   config=self.config, heartbeat=self.heartbeat,
                                                   budgeting=self.budgeting))
        try:
            return self.loop.run_until_complete(task)
        except BaseException:
            # A job timeout or a shutdown signal interrupted the loop: cancel the chunk's requests so the
            # loop is clean for the next job. Its lease lapses and the producer re-enqueues what is left.
            task.cancel()
            try:
                self.loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            except BaseException:  # pragma: no cover - a second interruption while unwinding
                pass
            raise

    def close(self) -> None:
        if self._session is not None:
            self.loop.run_until_complete(self._session.close())
            self._session = None
        self.loop.close()


def install(runtime: Runtime) -> None:
    global _current
    _current = runtime


def current() -> Runtime:
    """The process's Runtime; built from the environment when no worker.Worker installed one."""
    global _current
    if _current is None:
        from rq import get_current_job
        job = get_current_job()
        if job is None:
            raise RuntimeError("worker.jobs functions run inside an RQ job")
        _current = Runtime(job.connection, WorkerConfig.from_env())
    return _current
