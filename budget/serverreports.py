"""What each live worker reports of its SGLang servers: which it finds down (``bq:server_health``) and what it
does with each (``bq:server_load``), for ``produce``, ``produce status``, ``produce servers`` and ``produce
metrics``.

Both keys (budget/keys.py) are one Redis hash of one JSON entry per live worker: field = the RQ worker's name,
value = a JSON object with ``worker``, ``host``, ``pid`` and ``at``, the Redis time of its last write (so the hosts'
clocks never matter). A worker rewrites its entry while it has something to say and deletes it when it stops; one
killed meanwhile writes no more: its entry is stale TTL_S after ``at``, readers leave it out, writers prune it, and
the hash itself expires TTL_S after the last write, so nothing outlives the workers. An entry that is not JSON, or
lacks the object field its key requires (``down``, ``servers``), counts as stale.

- ``bq:server_health``: a worker whose servers stop answering (worker/health.py decides what "down" is) writes
  ``{..., "down": {url: reason}, "since"}`` (``since``: Redis time when the first of them went down), every
  DOWN_REFRESH_S while any is down, and deletes it when all answer again.
- ``bq:server_load``: every worker writes ``{..., "concurrency", "window", "servers": {url: {...}}}`` every
  LOAD_REFRESH_S (worker/loadreport.py): which servers it uses, how much of its window is in flight there, how fast
  they answer, what neither the health entry nor ``bq:server_info`` (budget/serverinfo.py: what each server said
  of itself) says. ``concurrency``: BUDGETQ_CONCURRENCY, null for the automatic window; ``window``: the requests it
  keeps in flight in all. Each server's object holds SERVER_FIELDS. Ages are the worker's own (monotonic) seconds
  as of ``at``.
"""
from __future__ import annotations

import json
from typing import Any, Final, Mapping
from urllib.parse import urlsplit

import redis

from budget import keys
from budget.connection import redis_now
from budget.serverinfo import public_url

#: An entry older than this is its worker's last word before it died: not shown, pruned.
TTL_S: Final = 30.0
#: Seconds between a down worker's rewrites of its ``bq:server_health`` entry.
DOWN_REFRESH_S: Final = 10.0
#: Seconds between a worker's rewrites of its ``bq:server_load`` entry.
LOAD_REFRESH_S: Final = 5.0
#: A worker prunes dead workers' load entries once in this many writes (once a minute): readers skip them meanwhile.
PRUNE_EVERY: Final = 12
#: A server that timed out, or answered 5xx or 429, within this long is "slow" (unless down).
SLOW_S: Final = 60.0
#: Each server's fields in a load entry. ``window``, ``capacity`` (the server's max_running_requests, all DP
#: ranks) and ``peers`` (live workers sharing it) are the automatic window's (worker/window.py), null with a fixed
#: BUDGETQ_CONCURRENCY (then ``window`` is that number when the worker has one server); ``tokens`` counts the
#: completion tokens it answered this worker since the worker started, ``tok_s`` over the last LOAD_REFRESH_S;
#: ``error_age_s`` / ``unavailable_age_s``: seconds since its last failed request / its last timeout, 5xx, 429 or
#: lost connection (null: none yet).
SERVER_FIELDS: Final = ("in_flight", "window", "capacity", "peers", "tokens", "tok_s", "last_error", "error_age_s",
                        "unavailable_age_s")
_LOOPBACK: Final = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


def _write(r: "redis.Redis", key: str, worker: str, entry: dict[str, Any]) -> None:
    """Set ``worker``'s entry and push the hash's expiry TTL_S ahead, in one transaction."""
    pipe = r.pipeline(transaction=True)
    pipe.hset(key, worker, json.dumps(entry, sort_keys=True))
    pipe.expire(key, int(TTL_S))
    pipe.execute()


def _entries(r: "redis.Redis", key: str, shape: str) -> dict[bytes, dict[str, Any] | None]:
    out: dict[bytes, dict[str, Any] | None] = {}
    raw: Any = r.hgetall(key)
    for f, v in raw.items():
        try:
            entry = json.loads(v)
        except ValueError:
            entry = None
        out[f] = entry if isinstance(entry, dict) and isinstance(entry.get(shape), dict) else None
    return out


def _stale(entry: dict[str, Any] | None, now: float) -> bool:
    return entry is None or now - float(entry.get("at", 0)) > TTL_S


def _fresh(r: "redis.Redis", key: str, shape: str, now: float) -> list[dict[str, Any]]:
    """The entries written within TTL_S of ``now``."""
    return [e for e in _entries(r, key, shape).values() if e is not None and not _stale(e, now)]


def _prune(r: "redis.Redis", key: str, shape: str, now: float) -> None:
    """Delete the stale entries (it reads the whole hash)."""
    stale = [f for f, e in _entries(r, key, shape).items() if _stale(e, now)]
    if stale:
        r.hdel(key, *stale)


def store_down(r: "redis.Redis", worker: str, host: str, pid: int, down: Mapping[str, str],
               since: float | None = None) -> float:
    """Record that ``worker`` (on ``host``) finds the servers ``down`` (url -> why) down; returns ``since`` (the
    Redis time they went down, kept across rewrites by passing it back). An empty ``down`` deletes the entry."""
    if not down:
        clear_down(r, worker)
        return 0.0
    now = redis_now(r)
    since = since or now
    entry = {"worker": worker, "host": host, "pid": pid, "since": since, "at": now,
             "down": {public_url(url): str(why)[:300] for url, why in sorted(down.items())}}
    _write(r, keys.SERVER_HEALTH, worker, entry)
    _prune(r, keys.SERVER_HEALTH, "down", now)
    return since


def clear_down(r: "redis.Redis", worker: str) -> None:
    r.hdel(keys.SERVER_HEALTH, worker)


def read_down(r: "redis.Redis") -> list[dict[str, Any]]:
    """The fresh health entries, oldest outage first; each gains ``for_s``, seconds since its servers went down."""
    now = redis_now(r)
    out = [{**e, "for_s": max(0.0, now - float(e.get("since", now)))}
           for e in _fresh(r, keys.SERVER_HEALTH, "down", now)]
    return sorted(out, key=lambda e: (-e["for_s"], str(e.get("worker"))))


def describe_down(entries: list[dict[str, Any]]) -> list[str]:
    """One line per worker whose servers are down: who, where, which servers and why, for how long."""
    lines = []
    for e in entries:
        servers = "; ".join(f"{url} ({why})" for url, why in sorted(e["down"].items()))
        lines.append(f"SGLang down for worker {e.get('worker')} on host {e.get('host')} (pid {e.get('pid')}), "
                     f"{e['for_s']:.0f} s: {servers}; it gives its chunks back and takes none until a server "
                     f"answers /health")
    return lines


def server_name(url: str, host: str) -> str:
    """What names a server among workers: its public URL, prefixed with the worker's host when it is a loopback one
    (``http://127.0.0.1:30000`` on two GPU hosts is two servers)."""
    public = public_url(url)
    return f"{host} {public}" if (urlsplit(public).hostname or "") in _LOOPBACK else public


def store_load(r: "redis.Redis", worker: str, host: str, pid: int, servers: Mapping[str, Mapping[str, Any]], *,
               concurrency: int | None, window: int, prune: bool = True) -> None:
    """Record what ``worker`` (on ``host``) does with each of ``servers`` (url -> SERVER_FIELDS); with ``prune``,
    delete dead workers' entries (it reads the whole hash: a worker prunes once in PRUNE_EVERY writes)."""
    now = redis_now(r)
    kept: dict[str, dict[str, Any]] = {}
    for url, fields in sorted(servers.items()):
        kept[public_url(url)] = {k: fields.get(k) for k in SERVER_FIELDS}
        if isinstance(fields.get("last_error"), str):
            kept[public_url(url)]["last_error"] = str(fields["last_error"])[:300]
    entry = {"worker": worker, "host": host, "pid": pid, "at": now, "concurrency": concurrency, "window": window,
             "servers": kept}
    _write(r, keys.SERVER_LOAD, worker, entry)
    if prune:
        _prune(r, keys.SERVER_LOAD, "servers", now)


def clear_load(r: "redis.Redis", worker: str) -> None:
    r.hdel(keys.SERVER_LOAD, worker)


def read_load(r: "redis.Redis") -> list[dict[str, Any]]:
    """The fresh load entries, by worker name; each gains ``age_s``, seconds since it was written (Redis' clock)."""
    now = redis_now(r)
    out = [{**e, "age_s": max(0.0, now - float(e.get("at", now)))}
           for e in _fresh(r, keys.SERVER_LOAD, "servers", now)]
    return sorted(out, key=lambda e: str(e.get("worker")))
