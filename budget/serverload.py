"""What each worker does with each of its SGLang servers, for ``produce servers`` and ``produce metrics``.

``bq:server_health`` (budget/health.py) says only which servers are down, and ``bq:server_info``
(budget/serverinfo.py) what each said of itself an hour ago; neither says which workers use a server that is up, how
much of its window is in flight there, or how fast it answers. So every worker rewrites one entry of
``bq:server_load`` (budget/keys.py) every REFRESH_S: field = the RQ worker's name, value = JSON
``{"worker", "host", "pid", "at", "concurrency", "window", "servers": {url: {...}}}`` (``at``: Redis time of the
write; ``concurrency``: BUDGETQ_CONCURRENCY, null for the automatic window; ``window``: the requests it keeps in
flight in all). Each server's object holds SERVER_FIELDS. Ages are the worker's own (monotonic) seconds as of ``at``,
so the hosts' clocks never matter. A worker deletes its entry when it stops; one killed meanwhile writes no more:
its entry is stale after TTL_S, readers leave it out and writers prune it, and the hash expires TTL_S after the last
write.
"""
from __future__ import annotations

from typing import Any, Final, Mapping
from urllib.parse import urlsplit

import redis

from budget import keys, workerentries
from budget.serverinfo import public_url

#: Seconds between a worker's rewrites of its entry.
REFRESH_S: Final = 5.0
#: An entry older than this is its worker's last word before it died: not shown, pruned.
TTL_S: Final = 30.0
#: A worker prunes dead workers' entries once in this many writes (once a minute): readers skip them meanwhile.
PRUNE_EVERY: Final = 12
#: A server that timed out, or answered 5xx or 429, within this long is "slow" (unless down).
SLOW_S: Final = 60.0
#: Each server's fields in an entry. ``window``, ``capacity`` (the server's max_running_requests, all DP ranks) and
#: ``peers`` (live workers sharing it) are the automatic window's (worker/window.py), null with a fixed
#: BUDGETQ_CONCURRENCY (then ``window`` is that number when the worker has one server); ``tokens`` counts the
#: completion tokens it answered this worker since the worker started, ``tok_s`` over the last REFRESH_S;
#: ``error_age_s`` / ``unavailable_age_s``: seconds since its last failed request / its last timeout, 5xx, 429 or
#: lost connection (null: none yet).
SERVER_FIELDS: Final = ("in_flight", "window", "capacity", "peers", "tokens", "tok_s", "last_error", "error_age_s",
                        "unavailable_age_s")
_LOOPBACK: Final = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


def server_name(url: str, host: str) -> str:
    """What names a server among workers: its public URL, prefixed with the worker's host when it is a loopback one
    (``http://127.0.0.1:30000`` on two GPU hosts is two servers)."""
    public = public_url(url)
    return f"{host} {public}" if (urlsplit(public).hostname or "") in _LOOPBACK else public


def store(r: "redis.Redis", worker: str, host: str, pid: int, servers: Mapping[str, Mapping[str, Any]], *,
          concurrency: int | None, window: int, prune: bool = True) -> None:
    """Record what ``worker`` (on ``host``) does with each of ``servers`` (url -> SERVER_FIELDS); with ``prune``,
    delete dead workers' entries (it reads the whole hash: a worker prunes once in PRUNE_EVERY writes)."""
    now = workerentries.redis_now(r)
    kept: dict[str, dict[str, Any]] = {}
    for url, fields in sorted(servers.items()):
        kept[public_url(url)] = {k: fields.get(k) for k in SERVER_FIELDS}
        if isinstance(fields.get("last_error"), str):
            kept[public_url(url)]["last_error"] = str(fields["last_error"])[:300]
    entry = {"worker": worker, "host": host, "pid": pid, "at": now, "concurrency": concurrency, "window": window,
             "servers": kept}
    workerentries.write(r, keys.SERVER_LOAD, worker, entry, TTL_S)
    if prune:
        workerentries.prune(r, keys.SERVER_LOAD, "servers", TTL_S, now)


def clear(r: "redis.Redis", worker: str) -> None:
    workerentries.clear(r, keys.SERVER_LOAD, worker)


def load(r: "redis.Redis") -> list[dict[str, Any]]:
    """The fresh entries, by worker name; each gains ``age_s``, seconds since it was written (Redis' clock)."""
    now = workerentries.redis_now(r)
    out = [{**e, "age_s": max(0.0, now - float(e.get("at", now)))}
           for e in workerentries.fresh(r, keys.SERVER_LOAD, "servers", TTL_S, now)]
    return sorted(out, key=lambda e: str(e.get("worker")))
