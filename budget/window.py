"""Which workers share each SGLang server (``bq:window``), for their automatic windows (worker/window.py).

A worker without BUDGETQ_CONCURRENCY sizes its window as its share of what its servers can run, so it must know how
many workers share each server: workers on several hosts may use one URL (a load balancer, the router), and a host
runs several workers. Each such worker renews one member per server, ``"<server>SEP<worker id>"``, every second,
scored with the Redis time (ms) at which it lapses (TTL_MS later): a worker that dies without a word drops out of
every count TTL_MS later. The count is whatever is live on Redis' clock, so the hosts' clocks never matter.

``server`` is the name worker/window.py gives a server (its public URL; a loopback URL is prefixed with the worker's
host, since ``http://127.0.0.1:30000`` on two hosts is two servers). The key expires TTL_MS after the last renewal,
so once every worker has stopped it disappears by itself.
"""
from __future__ import annotations

from typing import Any, Final, Sequence

import redis

from budget import keys

#: A registration not renewed within this long has lapsed (its worker is gone).
TTL_MS: Final = 10_000


def _now_ms(r: "redis.Redis") -> int:
    sec, usec = r.time()
    return int(sec) * 1000 + int(usec) // 1000


def beat(r: "redis.Redis", worker: str, servers: Sequence[str], ttl_ms: int = TTL_MS) -> dict[str, int]:
    """Renew ``worker``'s registration on each of ``servers``; prune lapsed ones. Returns, for each of ``servers``,
    how many live workers share it (this one included)."""
    now = _now_ms(r)
    pipe = r.pipeline(transaction=True)
    pipe.zremrangebyscore(keys.WINDOW, "-inf", now)
    if servers:
        pipe.zadd(keys.WINDOW, {f"{s}{keys.SEP}{worker}": now + ttl_ms for s in servers})
    pipe.pexpire(keys.WINDOW, ttl_ms)
    pipe.zrange(keys.WINDOW, 0, -1)
    members: Any = pipe.execute()[-1]
    counts = {s: 0 for s in servers}
    for raw in members:
        server = (raw.decode() if isinstance(raw, bytes) else str(raw)).rpartition(keys.SEP)[0]
        if server in counts:
            counts[server] += 1
    return {s: max(1, n) for s, n in counts.items()}


def leave(r: "redis.Redis", worker: str, servers: Sequence[str]) -> None:
    """Drop ``worker``'s registrations at once (a worker that stops), so that the others take its share now."""
    if servers:
        r.zrem(keys.WINDOW, *[f"{s}{keys.SEP}{worker}" for s in servers])
