"""Typed Python calls for the budget scripts: the only way the rest of budgetq changes budget state.

The ledger is policy-free mechanism: it answers "is this sample admitted", "was this commit new", "did this
commit close the dataset". Workers and the producer decide what to do with the answers.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Sequence

import redis

from budget import keys, scripts

#: How long a running chunk's lease lasts without a refresh. Workers refresh every LEASE_MS / 4, so a lease
#: expires only when its worker stopped refreshing (killed, frozen, cut off from Redis) for this long.
LEASE_MS = 20_000


class Admit(enum.IntEnum):
    START = 1
    CLOSED = 0
    REVOKED = -1
    SKIP = -2


@dataclass(frozen=True)
class CommitOutcome:
    committed: bool  # False: a duplicate; nothing was changed
    used: int
    closed_now: bool  # this commit brought the counter to the budget and closed the dataset


@dataclass(frozen=True)
class DatasetState:
    name: str
    status: str  # open / closed / '' (never set up)
    budget: int | None
    used: int
    committed: int
    done: int
    failed: int
    live_chunks: int
    queued_chunks: int
    unwritten: int  # results in the stream, not yet on disk
    discarded_chunks: int
    fields: dict[str, str]


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Ledger:
    """Budget state of every dataset in one Redis database. Pass it the client; it registers the scripts."""

    def __init__(self, client: "redis.Redis") -> None:
        self.r = client
        self._set_budget = client.register_script(scripts.SET_BUDGET)
        self._start = client.register_script(scripts.START_CHUNK)
        self._refresh = client.register_script(scripts.REFRESH_CHUNK)
        self._admit = client.register_script(scripts.ADMIT)
        self._commit = client.register_script(scripts.COMMIT)
        self._fail = client.register_script(scripts.FAIL)
        self._discard = client.register_script(scripts.DISCARD)
        self._reclaim = client.register_script(scripts.RECLAIM)
        self._reconcile = client.register_script(scripts.RECONCILE)
        self._uncommit = client.register_script(scripts.UNCOMMIT)
        self._lock_refresh = client.register_script(scripts.LOCK_REFRESH)
        self._lock_release = client.register_script(scripts.LOCK_RELEASE)

    # -- the producer's side -------------------------------------------------------------------------
    def set_budget(self, name: str, budget: int | None) -> str:
        k = keys.DatasetKeys(name)
        status, _used = self._set_budget(keys=[k.meta, k.used], args=["" if budget is None else budget])
        return _s(status)

    def reconcile(self, name: str, records: Sequence[tuple[str, int]], batch: int = 2000) -> tuple[int, int]:
        """Count on-disk responses Redis does not know. Returns (samples added, tokens added)."""
        k = keys.DatasetKeys(name)
        added = tokens = 0
        for i in range(0, len(records), batch):
            args: list[Any] = []
            for sid, n in records[i:i + batch]:
                args += [sid, n]
            a, t, _ = self._reconcile(keys=[k.meta, k.used, k.done], args=args)
            added += int(a)
            tokens += int(t)
        return added, tokens

    def uncommit(self, name: str, ids: Sequence[str]) -> tuple[int, int]:
        k = keys.DatasetKeys(name)
        if not ids:
            return 0, 0
        removed, tokens, _ = self._uncommit(keys=[k.meta, k.used, k.done], args=list(ids))
        return int(removed), int(tokens)

    def reclaim(self, name: str) -> list[str]:
        k = keys.DatasetKeys(name)
        return [_s(x) for x in self._reclaim(keys=[k.chunks])]

    def discard(self, name: str, reason: str) -> int:
        k = keys.DatasetKeys(name)
        return int(self._discard(keys=[k.meta, k.chunks, keys.RQ_QUEUE, keys.RQ_CANCELED],
                                 args=[keys.RQ_JOB_PREFIX, reason]))

    def acquire_lock(self, key: str, token: str, ttl_ms: int) -> bool:
        return bool(self.r.set(key, token, nx=True, px=ttl_ms))

    def refresh_lock(self, key: str, token: str, ttl_ms: int) -> bool:
        return bool(self._lock_refresh(keys=[key], args=[token, ttl_ms]))

    def release_lock(self, key: str, token: str) -> None:
        self._lock_release(keys=[key], args=[token])

    # -- the worker's side ---------------------------------------------------------------------------
    def start_chunk(self, name: str, chunk: str, lease_ms: int = LEASE_MS) -> str:
        k = keys.DatasetKeys(name)
        return _s(self._start(keys=[k.meta, k.chunks], args=[chunk, lease_ms]))

    def refresh_chunk(self, name: str, chunk: str, lease_ms: int = LEASE_MS) -> bool:
        k = keys.DatasetKeys(name)
        return bool(self._refresh(keys=[k.chunks], args=[chunk, lease_ms]))

    def finish_chunk(self, name: str, chunk: str) -> None:
        self.r.zrem(keys.DatasetKeys(name).chunks, chunk)

    def admit(self, name: str, sample: str, chunk: str) -> Admit:
        k = keys.DatasetKeys(name)
        return Admit(int(self._admit(keys=[k.meta, k.chunks, k.pending, k.done], args=[sample, chunk])))

    def commit(self, name: str, sample: str, completion_tokens: int, result: dict[str, Any]) -> CommitOutcome:
        k = keys.DatasetKeys(name)
        body = json.dumps(result, ensure_ascii=False, separators=(",", ":"))
        ok, used, closed = self._commit(keys=[k.meta, k.used, k.done, k.pending, k.results, k.failed],
                                        args=[sample, completion_tokens, body])
        return CommitOutcome(bool(ok), int(used), bool(closed))

    def fail(self, name: str, sample: str, chunk: str, reason: dict[str, Any]) -> bool:
        k = keys.DatasetKeys(name)
        return bool(self._fail(keys=[k.done, k.pending, k.failed],
                               args=[sample, chunk, json.dumps(reason, ensure_ascii=False)]))

    # -- reading -------------------------------------------------------------------------------------
    def state(self, name: str) -> DatasetState:
        k = keys.DatasetKeys(name)
        with self.r.pipeline(transaction=True) as p:
            p.hgetall(k.meta)
            p.get(k.used)
            p.hlen(k.done)
            p.hlen(k.failed)
            p.zcard(k.chunks)
            p.zcount(k.chunks, "+inf", "+inf")
            p.xlen(k.results)
            meta, used, done, failed, live, queued, unwritten = p.execute()
        fields = {_s(a): _s(b) for a, b in meta.items()}
        budget = fields.get("budget", "")
        return DatasetState(
            name=name, status=fields.get("status", ""), budget=int(budget) if budget else None,
            used=int(used or 0), committed=int(fields.get("committed", 0)), done=int(done),
            failed=int(failed), live_chunks=int(live), queued_chunks=int(queued), unwritten=int(unwritten),
            discarded_chunks=int(fields.get("discarded_chunks", 0)), fields=fields)

    def done_ids(self, name: str) -> dict[str, int]:
        return {_s(a): int(b) for a, b in self.r.hgetall(keys.DatasetKeys(name).done).items()}

    def failed(self, name: str) -> dict[str, dict[str, Any]]:
        return {_s(a): json.loads(b) for a, b in self.r.hgetall(keys.DatasetKeys(name).failed).items()}

    def live_chunks(self, name: str) -> set[str]:
        return {_s(x) for x in self.r.zrange(keys.DatasetKeys(name).chunks, 0, -1)}

    def holders(self, name: str) -> dict[str, str]:
        """sample id -> chunk id, for samples the pending hash assigns to a chunk (live or not)."""
        return {_s(a): _s(b) for a, b in self.r.hgetall(keys.DatasetKeys(name).pending).items()}
