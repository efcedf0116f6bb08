"""The automatic window: how many requests a worker keeps in flight when BUDGETQ_CONCURRENCY is unset.

Too few in flight leaves SGLang's batch part empty (throughput grows with the batch up to what the server runs at
once); too many only queue inside SGLang, where each waits for a slot and widens the budget's in-flight tail. The
right number is the server's, not the user's: SGLang says how many requests it runs at once
(``max_running_requests``) and how many run and wait now (``/v1/loads``, ``/get_load`` before it). Every worker
sharing a server (several per host, several hosts behind one URL or the router) aims, together with the others, at
the server's capacity plus a small queue (HEADROOM: 2 + 1/16 of it), so that a finished request's slot is refilled
at once:

1. **Its share.** ``(capacity + headroom) / peers`` once the server first answers, ``peers`` being the live
   workers with an automatic window on that server (budget/window.py, ``bq:window``; renewed every POLL_S,
   lapsed after 10 s). When peers join or leave, the window is scaled by old/new peers at once.
2. **Following the load.** Every POLL_S the server's gap, ``target - (running + waiting)``, is closed by GAIN of
   this worker's share of it: target = capacity + headroom while nothing waits; running + headroom while requests
   wait with slots free (the KV cache, not the slot count, is what binds then). So a growing queue shrinks every
   window, and a server running below its capacity with nothing queued grows the windows of the workers that
   fill theirs (a worker without work to fill its window does not grow it: its peers take up the slack). Each
   window stays within [1, capacity + 2 x headroom].
3. **Following changes.** A server that comes back with another capacity (restarted with other limits) starts
   over at step 1.

Until a server first answers, the window is START (the old fixed default). A server that stops answering keeps its
last window (worker/health.py holds the worker while every server is down). An explicit BUDGETQ_CONCURRENCY wins
and none of this runs. Servers are named by their public URL, and a loopback URL by the worker's host and the URL
(``http://127.0.0.1:30000`` on two hosts is two servers).

A thread of its own with blocking HTTP, like worker/serverinfo.py and worker/health.py; only the resulting window
goes to the request loop (``on_window``, which the dispatcher hands to ``Slots.resize``).
"""
from __future__ import annotations

import base64
import http.client
import json
import logging
import math
import os
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Final, Mapping
from urllib.parse import unquote, urlsplit

import redis

from budget import serverinfo
from budget import window as window_record
from budget.serverinfo import is_router, public_url
from worker.config import WorkerConfig

log = logging.getLogger("budgetq.worker.window")

#: The window before any server has said what it runs (the fixed default before windows were automatic).
START: Final = 64
#: Seconds between two looks at the servers' load (and renewals of this worker's registration).
POLL_S: Final = 1.0
#: How often the capacity is asked again where the load endpoint does not carry it (/get_load, a router's list).
INFO_REFRESH_S: Final = 10.0
#: The share of a server's gap each look closes: under 1, so that peers acting on the same reading do not overshoot.
GAIN: Final = 0.5
_MAX_BODY: Final = 4 << 20


def headroom(capacity: int) -> int:
    """The queue aimed at beyond what the server runs: enough that a freed slot is refilled at once, small beside
    the batch (2 + 1/16: 6 at 64, 18 at 256, 66 at 1,024)."""
    return 2 + capacity // 16


# -- what a server says ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    """A server's capacity (requests it runs at once, all data-parallel ranks) and, when it says, how many run and
    wait now."""

    capacity: int
    running: int | None = None
    waiting: int | None = None
    servers: int = 1  # SGLang servers behind the URL: more than one behind a router


def capacity_of(info: Mapping[str, Any]) -> int | None:
    """Requests the server runs at once, from /server_info: the schedulers' own limits (0.5.23:
    ``internal_states[i].effective_max_running_requests_per_dp``, one entry per DP rank), else the
    ``max_running_requests`` argument (null unless set). None when it says neither."""
    states = info.get("internal_states")
    if isinstance(states, list):
        per_dp = [_count(s.get("effective_max_running_requests_per_dp")) for s in states if isinstance(s, dict)]
        if per_dp and all(per_dp):
            return sum(n or 0 for n in per_dp)
    return _count(info.get("max_running_requests"))


def _count(value: Any) -> int | None:
    """``value`` when it is a positive int, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def counts_of(body: Any) -> tuple[int, int, int | None] | None:
    """(running, waiting, capacity or None) from a /v1/loads answer (``loads``: per rank ``num_running_reqs``,
    ``num_waiting_reqs``, ``max_running_requests``) or a /get_load one (a list: per rank ``num_reqs`` = running +
    waiting, ``num_waiting_reqs``); None when it is neither."""
    ranks = body.get("loads") if isinstance(body, dict) else body
    if not isinstance(ranks, list) or not ranks or not all(isinstance(x, dict) for x in ranks):
        return None
    running = waiting = 0
    for rank in ranks:
        w = rank.get("num_waiting_reqs")
        if "num_running_reqs" in rank:
            r = rank.get("num_running_reqs")
        else:
            total = rank.get("num_reqs")
            r = total - w if isinstance(total, int) and isinstance(w, int) else None
        if not isinstance(r, int) or not isinstance(w, int):
            return None
        running, waiting = running + max(0, r), waiting + max(0, w)
    limits = [_count(rank.get("max_running_requests")) for rank in ranks]
    return running, waiting, sum(m or 0 for m in limits) if all(limits) else None


class Prober:
    """Asks one configured URL what it runs: a server, or SGLang's router (then each server it lists, summed)."""

    def __init__(self, url: str, *, api_key: str | None, timeout: float) -> None:
        self.url = url
        self.api_key = api_key
        self.timeout = timeout
        self._load_path: str | None = "/v1/loads"  # None: the server serves neither load endpoint
        self._info_path = "/server_info"
        self._capacity: int | None = None
        self._info_at = -math.inf
        self._members: list["Prober"] | None = None  # set when url is a router

    def probe(self) -> Load | None:
        """The server's Load; None when its capacity is unknown. Raises OSError-like errors when it does not
        answer (the caller keeps the last window)."""
        now = time.monotonic()
        if now - self._info_at >= INFO_REFRESH_S:
            self._refresh_info(now)
        if self._members is not None:
            parts = [p.probe() for p in self._members]
            known = [p for p in parts if p is not None]
            if not known:
                return None
            counted = all(p.running is not None for p in known)
            return Load(sum(p.capacity for p in known),
                        sum(p.running or 0 for p in known) if counted else None,
                        sum(p.waiting or 0 for p in known) if counted else None, len(known))
        counts = self._counts()
        if counts is None:
            return Load(self._capacity) if self._capacity else None
        running, waiting, capacity = counts
        if capacity is not None and capacity != self._capacity:
            self._capacity = capacity  # /v1/loads carries it: a restart with other limits shows at once
        return Load(self._capacity, running, waiting) if self._capacity else None

    def _refresh_info(self, now: float) -> None:
        status, body = self._get(self._info_path)
        if status == 404 and self._info_path == "/server_info":
            self._info_path = "/get_server_info"  # before 0.5: only the old name
            status, body = self._get(self._info_path)
        if status != 200 or not isinstance(body, dict):
            raise ConnectionError(f"{public_url(self.url)}{self._info_path}: HTTP {status}")
        self._info_at = now
        if is_router(body):
            self._members = self._router_members(self._members or [])
            return
        self._members = None
        self._capacity = capacity_of(body) or self._capacity

    def _router_members(self, old: list["Prober"]) -> list["Prober"]:
        status, listed = self._get("/workers")
        workers = listed.get("workers") if isinstance(listed, dict) and status == 200 else None
        urls = [w["url"] for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)] \
            if isinstance(workers, list) else []
        kept = {p.url: p for p in old}
        return [kept.get(u) or Prober(u, api_key=self.api_key, timeout=self.timeout) for u in urls]

    def _counts(self) -> tuple[int, int, int | None] | None:
        while self._load_path is not None:
            status, body = self._get(self._load_path)
            if status == 200:
                return counts_of(body)
            if status not in (404, 405):
                raise ConnectionError(f"{public_url(self.url)}{self._load_path}: HTTP {status}")
            self._load_path = "/get_load" if self._load_path == "/v1/loads" else None
        return None

    def _get(self, path: str) -> tuple[int, Any]:
        parts = urlsplit(self.url.strip())
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        elif parts.username or parts.password:
            pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(urllib.request.Request(public_url(self.url) + path, headers=headers),
                             timeout=self.timeout) as resp:
                raw = resp.read(_MAX_BODY)
                status = resp.status
        except urllib.error.HTTPError as exc:
            return exc.code, None
        except (OSError, ValueError, http.client.HTTPException) as exc:
            raise ConnectionError(f"{public_url(self.url)}{path}: {type(exc).__name__}: {exc}") from None
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, None


# -- the policy ------------------------------------------------------------------------------------------------
@dataclass
class ServerWindow:
    """This worker's window on one server, as the policy (module docstring) moves it."""

    capacity: int = 0
    peers: int = 1
    window: float = float(START)

    def follow(self, load: Load, peers: int, busy: bool) -> None:
        """One look: ``load`` what the server says now, ``peers`` the live workers sharing it (this one included),
        ``busy`` whether this worker fills its window (only then may it grow)."""
        peers = max(1, peers)
        h = headroom(load.capacity)
        if load.capacity != self.capacity:  # first answer, or a server back with other limits
            self.capacity, self.peers, self.window = load.capacity, peers, (load.capacity + h) / peers
            return
        if peers != self.peers:
            self.window *= self.peers / peers
            self.peers = peers
        if load.running is not None and load.waiting is not None:
            target = self.capacity if load.waiting == 0 else min(self.capacity, load.running)
            gap = target + h - (load.running + load.waiting)
            if gap < 0 or busy:
                self.window += GAIN * gap / peers
        self.window = min(max(self.window, 1.0), float(self.capacity + 2 * h))


server_name = serverinfo.server_name  # one naming for bq:window and bq:server_load


# -- the thread ------------------------------------------------------------------------------------------------
class WindowKeeper:
    """One per worker without BUDGETQ_CONCURRENCY: registers it on its servers, looks at them every POLL_S and
    hands the sum of its per-server windows to ``on_window`` (from this thread) whenever it changes."""

    def __init__(self, connection: "redis.Redis", config: WorkerConfig, *, on_window: Callable[[int], object],
                 usage: Callable[[], tuple[int, int]], host: str | None = None, poll_s: float = POLL_S,
                 on_load: Callable[[str, Load, int], object] | None = None) -> None:
        self.r = redis.Redis(connection_pool=connection.connection_pool)  # the worker's short-timeout pool
        self.on_window = on_window
        #: Told each server's Load and how many workers share it after every look (from this thread): the
        #: client's share of the servers' busy time follows it (worker/sglang.py ``note_load``).
        self.on_load = on_load
        self.usage = usage
        self.host = host or socket.gethostname()
        self.id = f"{self.host}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.poll_s = poll_s
        timeout = max(config.connect_timeout, 5.0)
        self.probers = {url: Prober(url, api_key=config.api_key, timeout=timeout) for url in config.servers}
        self.names = {url: server_name(url, self.host) for url in config.servers}
        self.windows: dict[str, ServerWindow] = {}
        self.peers: dict[str, int] = {}
        self.window = START
        self.looks = 0  # completed looks, for tests and logs
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="budgetq-window", daemon=True)

    def start(self) -> "WindowKeeper":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def close(self, timeout: float = 2.0) -> None:
        """Stop and wait for the thread, which drops this worker's registrations as it ends."""
        self.stop()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.look()
                self._stop.wait(self.poll_s)
        finally:
            try:
                window_record.leave(self.r, self.id, list(self.names.values()))
            except redis.RedisError as exc:  # it lapses by itself within TTL_MS
                log.debug("could not drop this worker's window registration: %s", exc)

    def look(self) -> None:
        """Ask each server, renew the registration, move the windows, tell the loop when the total changes."""
        loads: dict[str, Load] = {}
        for url, prober in self.probers.items():
            try:
                load = prober.probe()
            except Exception as exc:  # noqa: BLE001 - a server that does not answer keeps its window
                log.debug("window: %s did not answer: %s", public_url(url), exc)
                continue
            if load is not None:
                loads[url] = load
        try:
            self.peers = window_record.beat(self.r, self.id, list(self.names.values()))
        except redis.RedisError as exc:
            log.debug("window: registration not renewed (%s); counting the peers seen last", exc)
        used, size = self.usage()
        busy = used >= size - max(1, size // 16)
        for url, load in loads.items():
            w = self.windows.setdefault(url, ServerWindow())
            before = (w.capacity, w.peers)
            w.follow(load, self.peers.get(self.names[url], w.peers), busy)
            if self.on_load is not None:
                self.on_load(url, load, w.peers)
            if (w.capacity, w.peers) != before:
                log.info("SGLang server %s runs %d requests at once, %d worker(s) share it: this worker keeps "
                         "%d in flight there", public_url(url), w.capacity, w.peers, round(w.window),
                         extra={"server": public_url(url), "max_running_requests": w.capacity, "peers": w.peers,
                                "window": round(w.window)})
        if self.windows:
            total = sum(max(1, round(w.window)) for w in self.windows.values())
            if total != self.window:
                log.debug("window: %d -> %d", self.window, total)
                self.window = total
                self.on_window(total)
        self.looks += 1
