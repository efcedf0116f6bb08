"""The RQ job function (``run_chunk``; ``worker.Worker`` runs only the names in ALLOWED), and the Runtime it hands
chunks to: what a worker process keeps between jobs, one event loop thread, one HTTP session, one dispatcher.

RQ calls a job function per chunk on the worker's main thread. The requests themselves run on an event loop
in a background thread that lives as long as the worker, so they keep going while the main thread returns
to RQ and dequeues the next chunk (see worker/dispatch.py for why that matters), and one aiohttp session
serves every job (a session per job halves a fast server's request rate). A job run by any other RQ worker
gets a Runtime built on first use, so ``rq worker -S json`` still works.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from typing import Any, Callable

import aiohttp
import redis

from budget import connection as budget_connection
from budget.ledger import Ledger
from budget.payload import JOB_FUNCTION, OTHER_VERSION, REASONING_PARSERS, VERSION, ChunkPayload
from worker.config import WorkerConfig
from worker.dispatch import Dispatcher
from worker.health import HealthMonitor
from worker.loadreport import LoadReporter
from worker.running import ChunkReport
from worker.serverinfo import ServerInfoReporter
from worker.sglang import SGLangClient

log = logging.getLogger("budgetq.worker")

_current: "Runtime | None" = None


class Runtime:
    def __init__(self, connection: "redis.Redis", config: WorkerConfig,
                 heartbeat: Callable[[], None] | None = None,
                 on_fault: Callable[[str], None] | None = None, name: str | None = None) -> None:
        self.config = config
        # A pool of its own, with short timeouts (budget/connection.py), not RQ's: RQ sets 415 s on its pool for
        # its blocking dequeue, and a ledger call stuck that long on a silent connection outlives every lease.
        # The loop's ledger calls, the RQ heartbeat and the server-info thread use it; RQ's main thread does not.
        self.redis = budget_connection.like(connection)
        self.ledger = Ledger(self.redis)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="budgetq-requests", daemon=True)
        self.thread.start()
        self.dispatcher: Dispatcher = self._call(self._make(heartbeat, on_fault))
        self._closed = False
        # Best effort, on a thread of its own: the servers' version and model for the manifests (bq:server_info).
        client = self.dispatcher.client

        def on_router(url: str) -> None:  # from the reporter's thread to the request loop
            self.loop.call_soon_threadsafe(client.note_router, url)

        self.server_info = ServerInfoReporter(self.redis, config, on_router=on_router).start()
        dispatcher = self.dispatcher

        def on_health(down: bool) -> None:  # from the health thread to the request loop
            self.loop.call_soon_threadsafe(dispatcher.set_servers_down, down)

        worker = name or f"{socket.gethostname()}.{os.getpid()}"
        self.health = HealthMonitor(self.redis, config, worker=worker, on_change=on_health)
        client.on_unreachable = self.health.suspect
        self.health.start()
        # What it does with each server, for `produce servers` (bq:server_load), on a thread of its own too.
        self.load = LoadReporter(self.redis, config, self.dispatcher, worker=worker).start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _make(self, heartbeat: Callable[[], None] | None,
                    on_fault: Callable[[str], None] | None) -> Dispatcher:
        # limit=0: aiohttp's default cap of 100 connections would silently cap our concurrency.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, raise_for_status=False)
        return Dispatcher(self.ledger, SGLangClient(self.session, self.config), self.config, heartbeat, on_fault)

    def run_chunk(self, chunk: ChunkPayload) -> ChunkReport:
        """Dispatch a chunk: returns when every sample has started (or was given back)."""
        future = asyncio.run_coroutine_threadsafe(self.dispatcher.dispatch(chunk), self.loop)
        try:
            return future.result()
        except BaseException:
            # A job timeout or a shutdown signal interrupted the wait: stop starting samples of this chunk.
            # Its started requests run on; its lease lapses and the producer re-enqueues what is left.
            future.cancel()
            raise

    def close(self) -> None:
        """Finish every request already started (warm shutdown keeps GPU work), then stop the loop."""
        if self._closed:
            return
        self._closed = True
        self.server_info.stop()
        self.health.stop()
        try:
            self.health.thread.join(2)  # it deletes this worker's entry in bq:server_health as it ends
            self._call(self.dispatcher.drain())
            self.load.stop()  # after the drain: the view shows the requests a stopping worker finishes
            self._call(self.session.close())
            self._call(self.dispatcher.batcher.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


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


def run_chunk(chunk: ChunkPayload) -> dict[str, Any]:
    """Generate and commit one chunk of samples. Returns a small report (RQ keeps it as the job result).

    Refused before anything is generated: a payload of another run format (budget/payload.py VERSION), a
    reasoning parser this worker does not know, a multi-turn sample without the chunk's conversation block."""
    if not isinstance(chunk, dict) or chunk.get("v") != VERSION:
        version = chunk.get("v") if isinstance(chunk, dict) else None
        raise ValueError(f"unsupported chunk payload: version {version!r}, this worker runs {VERSION}: {OTHER_VERSION}")
    parser = chunk.get("reasoning_parser")
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unsupported chunk payload: reasoning_parser {parser!r} is not one this worker knows "
                         f"({', '.join(REASONING_PARSERS)}); upgrade the worker")
    if "conversation" not in chunk and any(s.get("turns", 1) > 1 for s in chunk.get("samples", [])):
        raise ValueError("unsupported chunk payload: multi-turn samples without a conversation block")
    return current().run_chunk(chunk).as_dict()


ALLOWED = frozenset({JOB_FUNCTION})
