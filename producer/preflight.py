"""Checks of the Redis a run is about to trust with its budget state, before anything is written to it.

A queue on an evicting Redis loses jobs and counters silently under memory pressure; a Redis without AOF loses
everything since its last snapshot on a crash (with AOF everysec, a kill -9 lost nothing acknowledged here).
"""
from __future__ import annotations

from typing import Any, Callable

import redis

from producer.errors import ProduceError


def check_redis(client: "redis.Redis", *, allow_eviction: bool, require_aof: bool,
                warn: Callable[[str], None]) -> None:
    try:
        config: Any = client.config_get("maxmemory-policy")
        policy = _text(config.get("maxmemory-policy", ""))
        aof = _text(client.config_get("appendonly").get("appendonly", ""))
    except redis.ResponseError as exc:  # an ACL user without CONFIG, or a managed Redis that hides it
        message = f"cannot check Redis persistence and eviction settings ({exc})"
        if require_aof:
            raise ProduceError(message + "; --require-aof needs them", 1) from None
        warn(f"warning: {message}; make sure it runs with appendonly yes and maxmemory-policy noeviction")
        return
    if policy and policy != "noeviction" and not allow_eviction:
        raise ProduceError(f"Redis evicts keys under memory pressure (maxmemory-policy {policy}): queued chunks "
                           "and budget counters could vanish silently. Set maxmemory-policy noeviction, or "
                           "pass --allow-eviction to run anyway.", 1)
    if aof != "yes":
        if require_aof:
            raise ProduceError("Redis runs without AOF (appendonly no): a crash loses every commit since its "
                               "last snapshot. Enable appendonly yes (appendfsync everysec).", 1)
        warn("warning: Redis runs without AOF (appendonly no): a Redis crash loses recent commits from Redis; "
             "the output files keep them and a rerun recounts them, but enable appendonly yes")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
