"""A Redis hash of one JSON entry per live worker, the shape budget/health.py (``bq:server_health``) and
budget/serverload.py (``bq:server_load``) share.

Field = the RQ worker's name, value = a JSON object with ``at``, the Redis time of its last write (so the hosts'
clocks never matter). A worker rewrites its entry while it has something to say and deletes it when it stops; one
killed meanwhile writes no more: its entry is stale ``ttl`` seconds after ``at``, readers leave it out, writers prune
it, and the hash itself expires ``ttl`` after the last write, so nothing outlives the workers. An entry that is not
JSON, or lacks the object field its owner requires (``shape``), counts as stale.
"""
from __future__ import annotations

import json
from typing import Any

import redis


def redis_now(r: "redis.Redis") -> float:
    """Redis' own clock, in seconds: the one clock every worker and reader shares."""
    sec, usec = r.time()
    return float(sec) + float(usec) / 1e6


def write(r: "redis.Redis", key: str, worker: str, entry: dict[str, Any], ttl: float) -> None:
    """Set ``worker``'s entry and push the hash's expiry ``ttl`` ahead, in one transaction."""
    pipe = r.pipeline(transaction=True)
    pipe.hset(key, worker, json.dumps(entry, sort_keys=True))
    pipe.expire(key, int(ttl))
    pipe.execute()


def clear(r: "redis.Redis", key: str, worker: str) -> None:
    r.hdel(key, worker)


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


def _stale(entry: dict[str, Any] | None, now: float, ttl: float) -> bool:
    return entry is None or now - float(entry.get("at", 0)) > ttl


def fresh(r: "redis.Redis", key: str, shape: str, ttl: float, now: float) -> list[dict[str, Any]]:
    """The entries written within ``ttl`` of ``now``."""
    return [e for e in _entries(r, key, shape).values() if e is not None and not _stale(e, now, ttl)]


def prune(r: "redis.Redis", key: str, shape: str, ttl: float, now: float) -> None:
    """Delete the stale entries (it reads the whole hash)."""
    stale = [f for f, e in _entries(r, key, shape).items() if _stale(e, now, ttl)]
    if stale:
        r.hdel(key, *stale)
