"""Whether this worker's SGLang servers are up, from SGLang's own contract, and what the worker does when none is.

"Down" (reference/sglang-generate.md): no TCP connection (refused, or none within BUDGETQ_CONNECT_TIMEOUT), the
connection closed before any answer, or ``GET /health`` answering 503 (SGLang says so while it starts or shuts
down, and when its 1-token health generation takes over 20 s). Anything else is up: a slow answer (a read timeout
is a busy server, not a dead one), a 5xx or 429 on one ``/generate`` (the request's retries handle it), a 401 or
404 on ``/health`` (something answers). Only /health decides: a request that could not connect only makes this
thread ask /health at once (``suspect``).

While *every* server is down the worker holds (``on_change(True)``): worker/dispatch.py gives its chunks back
(unstarted samples and those between retries, uncounted, unfailed: no attempt is charged against them; the
producer re-enqueues them when the chunk ends, as after a warm stop, not a reclaim), and worker/rqworker.py takes
no chunk from RQ, so the healthy workers take them. This thread asks each down server's /health again with a
backoff (PROBE_FIRST_S doubling up to PROBE_MAX_S); the first one that answers releases the hold. Meanwhile the
worker's entry in ``bq:server_health`` (budget/serverinfo.py) names the host and the servers, for ``produce``,
``produce status`` and ``produce metrics``.

A thread of its own with blocking http.client, like worker/serverinfo.py: a probe that waits BUDGETQ_CONNECT_TIMEOUT
delays neither the request loop nor RQ's main thread.
"""
from __future__ import annotations

import http.client
import logging
import os
import socket
import threading
import time
import urllib.parse
from typing import Callable

import redis

from budget import serverinfo
from budget.serverinfo import public_url
from worker.config import WorkerConfig

log = logging.getLogger("budgetq.worker")

#: The first re-probe of a down server, doubling after each failed one up to PROBE_MAX_S.
PROBE_FIRST_S = 0.5
PROBE_MAX_S = 5.0
#: A read of /health longer than this is a slow server, not a dead one: SGLang answers 503 itself after 20 s.
READ_TIMEOUT_S = 25.0
#: A healthy server is asked again after a failed connection at most this often.
SUSPECT_MIN_S = 1.0


def probe(url: str, *, api_key: str | None, connect_timeout: float, read_timeout: float = READ_TIMEOUT_S) -> str | None:
    """Why server ``url`` is down, or None when it is up (see the module docstring)."""
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "localhost", parts.port, timeout=connect_timeout)
    try:
        try:
            conn.connect()
        except (socket.timeout, TimeoutError):
            return f"no connection within {connect_timeout:g} s"
        except ConnectionRefusedError:
            return "connection refused"
        except OSError as exc:
            return f"cannot connect: {exc}"
        assert conn.sock is not None
        conn.sock.settimeout(read_timeout)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            conn.request("GET", parts.path.rstrip("/") + "/health", headers=headers)
            resp = conn.getresponse()
            resp.read()
        except (socket.timeout, TimeoutError):
            return None  # connected, slow to answer: busy, not down
        except (http.client.RemoteDisconnected, ConnectionResetError) as exc:
            return f"connection closed before an answer ({type(exc).__name__})"
        except (OSError, http.client.HTTPException):
            return None  # it answered something: not the contract's "down"
        return "/health answered 503" if resp.status == 503 else None
    finally:
        conn.close()


class HealthMonitor:
    """One per worker process: probes /health, holds the worker while every server is down, tells Redis."""

    def __init__(self, connection: "redis.Redis", config: WorkerConfig, *, worker: str,
                 on_change: Callable[[bool], None], host: str | None = None) -> None:
        self.r = redis.Redis(connection_pool=connection.connection_pool)  # the worker's short-timeout pool
        self.config = config
        self.worker = worker
        self.host = host or socket.gethostname()
        self.on_change = on_change  # called from this thread: True when every server is down, False when one is up
        self.down: dict[str, str] = {}  # url -> why, for the servers found down
        #: Set while every server is down: RQ's main thread waits on ``up`` instead of dequeueing.
        self.all_down = threading.Event()
        self.up = threading.Event()
        self.up.set()
        #: Set once every server has been asked at start: RQ's main thread takes no chunk before, so a worker
        #: started while its servers are down takes none at all.
        self.checked = threading.Event()
        self.probes = 0  # /health requests sent, for tests and logs
        self._suspects: set[str] = set(config.servers)  # probed at start: a worker started dead takes nothing
        self._asked: dict[str, float] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._wake.set()
        self._stop = threading.Event()
        self._since = 0.0
        self._written = 0.0
        self._last: dict[str, str] = {}  # what Redis' entry last said
        self.thread = threading.Thread(target=self._run, name="budgetq-health", daemon=True)

    def start(self) -> "HealthMonitor":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.checked.set()
        self._wake.set()

    def suspect(self, url: str) -> None:
        """A request could not connect to ``url``: ask its /health soon (any thread)."""
        with self._lock:
            if url in self.down or time.monotonic() - self._asked.get(url, -1e9) < SUSPECT_MIN_S:
                return
            self._suspects.add(url)
        self._wake.set()

    def _run(self) -> None:
        due: dict[str, float] = {}  # down server -> when to ask again
        backoff: dict[str, float] = {}
        while not self._stop.is_set():
            with self._lock:
                suspects, self._suspects = self._suspects, set()
            now = time.monotonic()
            for url in sorted(suspects | {u for u, t in due.items() if t <= now}):
                if self._stop.is_set():
                    break
                self._check(url, due, backoff)
            self._publish()
            self.checked.set()
            waits = [t - time.monotonic() for t in due.values()]
            if self.down:
                waits.append(serverinfo.DOWN_REFRESH_S)
            self._wake.wait(max(0.05, min(waits)) if waits else None)
            self._wake.clear()
        self._clear_record()

    def _check(self, url: str, due: dict[str, float], backoff: dict[str, float]) -> None:
        self._asked[url] = time.monotonic()
        self.probes += 1
        why = probe(url, api_key=self.config.api_key, connect_timeout=self.config.connect_timeout)
        with self._lock:
            if why is None:
                if self.down.pop(url, None) is not None:
                    log.warning("SGLang server %s answers /health again", public_url(url),
                                extra={"server": public_url(url)})
                due.pop(url, None)
                backoff.pop(url, None)
                return
            if url not in self.down:
                log.warning("SGLang server %s is down: %s", public_url(url), why,
                            extra={"server": public_url(url), "reason": why})
            self.down[url] = why
            backoff[url] = min(PROBE_MAX_S, backoff.get(url, PROBE_FIRST_S / 2) * 2)
            due[url] = time.monotonic() + backoff[url]

    def _publish(self) -> None:
        """Hold or release the worker when every server's state changed; keep Redis' entry current."""
        every = all(url in self.down for url in self.config.servers)
        if every and not self.all_down.is_set():
            self.all_down.set()
            self.up.clear()
            log.warning("every SGLang server of this worker is down (%s): giving its chunks back, taking no new ones "
                        "until one answers /health", "; ".join(f"{public_url(u)}: {w}" for u, w in self.down.items()),
                        extra={"down": {public_url(u): w for u, w in self.down.items()}})
            self.on_change(True)
        elif not every and self.all_down.is_set():
            self.all_down.clear()
            self.up.set()
            log.warning("an SGLang server answers again: taking chunks again")
            self.on_change(False)
        self._write_record()

    def _write_record(self) -> None:
        """Best effort: a Redis error is logged and the next round writes again."""
        with self._lock:
            down = dict(self.down)
        if down == self._last and (not down or time.monotonic() - self._written < serverinfo.DOWN_REFRESH_S):
            return
        try:
            self._since = serverinfo.store_down(self.r, self.worker, self.host, os.getpid(), down,
                                                   self._since or None)
            self._written = time.monotonic()
            self._last = down
        except redis.RedisError as exc:
            log.warning("could not record the down servers in Redis: %s", exc)

    def _clear_record(self) -> None:
        try:
            serverinfo.clear_down(self.r, self.worker)
        except redis.RedisError:
            pass  # it expires by itself
