"""Each worker tells Redis what it does with each of its SGLang servers (``bq:server_load``, budget/serverinfo.py):
its requests in flight there, its window, the server's max_running_requests as the automatic window read it, the
tokens it answered and its last error. ``produce servers`` and ``produce metrics`` read it, so that the per-server
view needs no request to SGLang from the producer's machine.

Best effort and out of the way, like worker/serverinfo.py: a daemon thread of its own that only reads counters the
request loop keeps (plain ints and tuples; a read one update late is one refresh off) and writes every LOAD_REFRESH_S.
A Redis error is logged at debug and the next round writes again. It deletes the entry as it stops.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import redis

from budget import serverinfo
from worker.config import WorkerConfig
from worker.dispatch import Dispatcher

log = logging.getLogger("budgetq.worker")


class LoadReporter:
    def __init__(self, connection: "redis.Redis", config: WorkerConfig, dispatcher: Dispatcher, *, worker: str,
                 host: str | None = None, refresh_s: float = serverinfo.LOAD_REFRESH_S) -> None:
        self.r = redis.Redis(connection_pool=connection.connection_pool)  # the worker's short-timeout pool
        self.config = config
        self.dispatcher = dispatcher
        self.worker = worker
        self.host = host or socket.gethostname()
        self.refresh_s = refresh_s
        self.reported = 0  # successful writes, for tests
        self._tokens: dict[str, int] = {}
        self._at = time.monotonic()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="budgetq-load", daemon=True)

    def start(self) -> "LoadReporter":
        self.thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop and wait for the thread, which deletes this worker's entry as it ends."""
        self._stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.report()
                except redis.RedisError as exc:
                    log.debug("could not record the servers' load in Redis: %s", exc)
                except Exception:  # noqa: BLE001 - never let this thread take anything down
                    log.exception("recording the servers' load")
                self._stop.wait(self.refresh_s)
        finally:
            try:
                serverinfo.clear_load(self.r, self.worker)
            except redis.RedisError:
                pass  # it goes stale and is pruned

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """This worker's SERVER_FIELDS per configured URL, now."""
        client, keeper = self.dispatcher.client, self.dispatcher.window
        now = time.monotonic()
        elapsed = max(1e-3, now - self._at)
        servers = self.config.servers
        out: dict[str, dict[str, Any]] = {}
        for url in servers:
            tokens = client.tokens.get(url, 0)
            error = client.last_error.get(url)
            unavailable = client.unavailable_at.get(url)
            w = keeper.windows.get(url) if keeper is not None else None
            if w is not None and w.capacity:
                window: int | None = max(1, round(w.window))
            elif self.config.concurrency is not None and len(servers) == 1:
                window = self.config.concurrency
            else:
                window = None
            out[url] = {
                "in_flight": client.in_flight.get(url, 0), "window": window,
                "capacity": w.capacity if w is not None and w.capacity else None,
                "peers": w.peers if w is not None and w.capacity else None,
                "tokens": tokens, "tok_s": round(max(0, tokens - self._tokens.get(url, tokens)) / elapsed, 1),
                "last_error": error[0] if error else None,
                "error_age_s": round(now - error[1], 1) if error else None,
                "unavailable_age_s": round(now - unavailable, 1) if unavailable is not None else None}
            self._tokens[url] = tokens
        self._at = now
        return out

    def report(self) -> None:
        servers = self.snapshot()
        serverinfo.store_load(self.r, self.worker, self.host, os.getpid(), servers,
                         concurrency=self.config.concurrency, window=self.dispatcher.slots.size,
                         prune=self.reported % serverinfo.PRUNE_EVERY == 0)
        self.reported += 1
