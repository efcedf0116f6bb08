"""Each worker tells Redis which SGLang version and model its servers run, for the datasets' manifests.

Best effort and out of the way: a daemon thread of its own (not the request loop, not RQ's main thread) asks
each configured server's ``/get_server_info`` once at start and again every REFRESH_S, with the worker's
``SGLANG_API_KEY`` as a bearer token, and stores only budget.serverinfo.SERVER_INFO_KEYS in ``bq:server_info``.
A server that does not answer yet (a model still loading) is asked again with backoff (5 s doubling to 5 min).
A configured URL that is SGLang's router is not recorded as a server: the servers it lists are (budget.serverinfo
`discover`), and the request client is told, so that it can warn about the router's request timeout.
Nothing here can block, slow or fail the worker: every error is logged and retried later, and the thread
dies with the process.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

import redis

from budget import serverinfo
from worker.config import WorkerConfig

log = logging.getLogger("budgetq.worker.serverinfo")

FIRST_RETRY_S = 5.0
MAX_RETRY_S = 300.0


class ServerInfoReporter:
    def __init__(self, connection: "redis.Redis", config: WorkerConfig, *, host: str | None = None,
                 refresh_s: float = serverinfo.REFRESH_S, first_retry_s: float = FIRST_RETRY_S,
                 on_router: Callable[[str], None] | None = None) -> None:
        # The worker's short-timeout pool (budget/runtime.py), never RQ's: a silent connection costs this
        # thread seconds, not RQ's 415 s. A pool hands each thread its own connection.
        self.r = redis.Redis(connection_pool=connection.connection_pool)
        self.servers = config.servers
        self.api_key = config.api_key
        self.timeout = max(config.connect_timeout, serverinfo.FETCH_TIMEOUT_S)
        self.host = host or socket.gethostname()
        self.refresh_s = refresh_s
        self.first_retry_s = first_retry_s
        self.reported = 0  # successful stores, for tests and logs
        self._last: dict[str, dict[str, object]] = {}
        self.routers: set[str] = set()  # configured URLs that turned out to be SGLang's router
        self.on_router = on_router  # told once per such URL (from this thread)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="budgetq-server-info", daemon=True)

    def start(self) -> "ServerInfoReporter":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        due = {url: 0.0 for url in self.servers}
        retry = {url: self.first_retry_s for url in self.servers}
        warned: set[str] = set()
        while not self._stop.is_set():
            for url in self.servers:
                if self._stop.is_set() or due[url] > time.monotonic():
                    continue
                try:
                    self._report(url)
                except Exception as exc:  # noqa: BLE001 - never let this thread take anything down
                    level = logging.DEBUG if url in warned else logging.WARNING
                    warned.add(url)
                    log.log(level, "could not record /get_server_info of %s (retrying in %.0f s): %s",
                            serverinfo.public_url(url), retry[url], exc,
                            extra={"server": serverinfo.public_url(url)})
                    due[url] = time.monotonic() + retry[url]
                    retry[url] = min(MAX_RETRY_S, retry[url] * 2)
                else:
                    warned.discard(url)
                    due[url] = time.monotonic() + self.refresh_s
                    retry[url] = self.first_retry_s
            self._stop.wait(max(0.0, min(due.values()) - time.monotonic()))

    def _report(self, url: str) -> None:
        found = serverinfo.discover(url, api_key=self.api_key, timeout=self.timeout)
        for server in found:
            entry = serverinfo.store(self.r, server.url, self.host, server.info, via=server.via, router=server.router)
            self.reported += 1
            changed = self._last.get(server.url) != entry | {"fetched": None}
            self._last[server.url] = entry | {"fetched": None}
            if server.router:
                log.log(logging.WARNING if changed else logging.DEBUG,
                        "SGLANG_URL %s is SGLang's router and lists no server that answers /get_server_info: the "
                        "manifests will say the SGLang version and model are unknown", entry["url"],
                        extra={"server": entry["url"]})
                continue
            log.log(logging.INFO if changed else logging.DEBUG,
                    "SGLang server %s%s: version %s, model %s", entry["url"],
                    f" (behind the router {server.via})" if server.via else "", entry.get("version", "?"),
                    entry.get("model_path", "?"),
                    extra={"server": entry["url"], "version": entry.get("version"),
                           "model_path": entry.get("model_path"), "via": server.via})
        if (found[0].via or found[0].router) and url not in self.routers:
            self.routers.add(url)
            if self.on_router is not None:
                self.on_router(url)
