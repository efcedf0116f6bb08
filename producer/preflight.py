"""Checks of the Redis a run is about to trust with its budget state, before anything is written to it.

A queue on an evicting Redis loses jobs and counters silently under memory pressure; a Redis without AOF loses
everything since its last snapshot on a crash (with AOF everysec, a kill -9 lost nothing acknowledged here).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

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


def seed_warning(servers: Sequence[Mapping[str, Any]], sampling_params: Mapping[str, Any]) -> str | None:
    """A warning when ``sampling_seed`` is sent to servers that ignore it; None when there is nothing to say.

    SGLang applies the per-request seed only when the server runs with ``--enable-deterministic-inference``
    (sglang/srt/sampling/sampling_batch_info.py), otherwise the seed is accepted and silently unused."""
    seed = sampling_params.get("sampling_seed")
    if seed is None or not servers:
        return None
    from budget.serverinfo import seed_honoured
    if seed_honoured(servers):
        return None
    without = sum(1 for s in servers if s.get("enable_deterministic_inference") is not True)
    return (f"warning: --seed {seed} is sent as sampling_seed, but {without} of the {len(servers)} SGLang servers "
            "the workers recorded do not report running with --enable-deterministic-inference: SGLang ignores "
            "the seed without it, so the run is not reproducible")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def check_out_dirs(out_dir: Path, names: Iterable[str]) -> None:
    """Every dataset's output folder can be created and written, checked before Redis is touched: a run that
    found out only when it opened its files had already taken its collector locks and registered its datasets
    (seen in a container whose ``out/`` belonged to another user: a traceback, and a rerun refused for 30 s).
    Writing a probe file is the honest test; ``os.access`` says yes to root on a read-only mount."""
    for name in sorted(names):
        folder = out_dir / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".budgetq-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise ProduceError(f"--out {out_dir}: cannot write {folder} ({exc.strerror or exc}); give an --out "
                               "folder this user can write", 2) from None
