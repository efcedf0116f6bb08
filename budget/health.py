"""Which SGLang servers each worker finds down, for ``produce``, ``produce status`` and ``produce metrics``.

A worker whose servers stop answering (worker/health.py decides what "down" is) writes one entry to
``bq:server_health`` (budget/keys.py): field = the RQ worker's name, value = JSON ``{"worker", "host", "pid",
"down": {url: reason}, "since", "at"}`` (``since``: Redis time when the first of them went down; ``at``: the last
write). It rewrites it every REFRESH_S while any is down and deletes it when all answer again. A worker killed
meanwhile writes no more: its entry is stale after TTL_S and readers leave it out (and writers prune it); the hash
itself expires TTL_S after the last write, so nothing outlives the workers.
"""
from __future__ import annotations

from typing import Any, Final, Mapping

import redis

from budget import keys, workerentries
from budget.serverinfo import public_url

#: Seconds between a down worker's rewrites of its entry.
REFRESH_S: Final = 10.0
#: An entry older than this is its worker's last word before it died: not shown, pruned.
TTL_S: Final = 30.0


def store(r: "redis.Redis", worker: str, host: str, pid: int, down: Mapping[str, str], since: float | None = None
          ) -> float:
    """Record that ``worker`` (on ``host``) finds the servers ``down`` (url -> why) down; returns ``since`` (the
    Redis time they went down, kept across rewrites by passing it back). An empty ``down`` deletes the entry."""
    if not down:
        clear(r, worker)
        return 0.0
    now = workerentries.redis_now(r)
    since = since or now
    entry = {"worker": worker, "host": host, "pid": pid, "since": since, "at": now,
             "down": {public_url(url): str(why)[:300] for url, why in sorted(down.items())}}
    workerentries.write(r, keys.SERVER_HEALTH, worker, entry, TTL_S)
    workerentries.prune(r, keys.SERVER_HEALTH, "down", TTL_S, now)
    return since


def clear(r: "redis.Redis", worker: str) -> None:
    workerentries.clear(r, keys.SERVER_HEALTH, worker)


def load(r: "redis.Redis") -> list[dict[str, Any]]:
    """The fresh entries, oldest outage first; each gains ``for_s``, seconds since its servers went down."""
    now = workerentries.redis_now(r)
    out = [{**e, "for_s": max(0.0, now - float(e.get("since", now)))}
           for e in workerentries.fresh(r, keys.SERVER_HEALTH, "down", TTL_S, now)]
    return sorted(out, key=lambda e: (-e["for_s"], str(e.get("worker"))))


def describe(entries: list[dict[str, Any]]) -> list[str]:
    """One line per worker whose servers are down: who, where, which servers and why, for how long."""
    lines = []
    for e in entries:
        servers = "; ".join(f"{url} ({why})" for url, why in sorted(e["down"].items()))
        lines.append(f"SGLang down for worker {e.get('worker')} on host {e.get('host')} (pid {e.get('pid')}), "
                     f"{e['for_s']:.0f} s: {servers}; it gives its chunks back and takes none until a server "
                     f"answers /health")
    return lines
