"""The servers' busy time, shared out among the requests that kept them busy: what a dataset's GPU time is.

A request's latency is not what it cost: a server running N requests at once spends a second of its GPUs on N
requests. So while N requests run at a server, each is charged dt / N. Every server has a clock that advances by
dt / N (the virtual time of fair queueing); a request's charge is the clock at its end minus the clock at its
start, and the charges of every request a server ran sum to exactly the time it was busy (N > 0). A server's
busy time times its GPUs (its tensor-parallel size) is GPU time; docs/mix.md "Cost in view" says how to price it.

N is this worker's own requests at the server, counted here, plus the other workers' ones: none while the
window's registration says this worker is the server's only one (exact), else the server's last load
(worker/window.py reads ``/v1/loads`` every POLL_S and calls ``note_load``) minus this worker's own at that
moment (as exact as that load, a second old at most). A
worker with a fixed BUDGETQ_CONCURRENCY runs no window and reads no load: it charges as if it ran alone, which
overstates each worker's charge by the number of workers sharing its server. Behind a router (several servers
behind one URL) a second of the URL is a second of each of them, so the clock advances by dt x servers / N.
"""
from __future__ import annotations

import time
from typing import Callable


class ServerTime:
    """One per SGLangClient, on its loop: ``start`` before a request is sent, ``end`` with what ``start`` gave
    when it is over (answered or not), which returns the seconds of the server's busy time it took."""

    def __init__(self, servers: list[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self._at = {url: now for url in servers}  # when each server's clock was last advanced
        self._time = {url: 0.0 for url in servers}  # its sum of dt x servers / N
        self._own = {url: 0 for url in servers}  # this worker's requests there now
        self._others = {url: 0 for url in servers}  # the other workers' ones, as its last load said
        self._servers = {url: 1 for url in servers}  # SGLang servers behind the URL

    def _advance(self, url: str) -> float:
        now = self._clock()
        n = self._own[url] + self._others[url]
        if n > 0:
            self._time[url] += (now - self._at[url]) * self._servers[url] / n
        self._at[url] = now
        return self._time[url]

    def start(self, url: str) -> float:
        began = self._advance(url)
        self._own[url] += 1
        return began

    def end(self, url: str, began: float) -> float:
        taken = self._advance(url) - began
        self._own[url] -= 1
        return taken

    def note_load(self, url: str, total: int | None, *, peers: int = 1, servers: int = 1) -> None:
        """The server's own count of what it runs and queues (``total``: every worker's requests), or None when it
        gives none (each of the ``peers`` workers sharing the server is then taken to run as many as this one);
        ``servers``: the SGLang servers behind the URL. A worker alone at its server (``peers`` 1) counts its own
        requests only: a load read a moment ago would count requests that have ended since."""
        if url not in self._time:
            return
        self._advance(url)
        own = self._own[url]
        if peers <= 1:
            self._others[url] = 0
        else:
            self._others[url] = max(0, total - own) if total is not None else own * (peers - 1)
        self._servers[url] = max(1, servers)
