"""The producer's side of a run in Redis that is not a budget decision: the Redis epoch, the collector lock, a
dataset's record and its progress fields, the chunk counter and the held-by bookkeeping of an enqueue, the
results stream.

Why here and not in producer/: budget/ owns every ``bq:`` key (docs/architecture.md, "Who touches the keys").
Nothing outside budget/ names a key or sends a command on one, so the key layout and every command on it can be
read in this package alone, and tests/redis/test_key_ownership.py can check it. What needs to be atomic because it
reads and writes depending on what it read is a script (budget/scripts.py, via budget/ledger.py); what is here
is plain bookkeeping: one writer (the dataset's collector, under its lock) or a write that is right whatever
happens around it.

The run's tokenizer files (`store_files`, `fetch_files`, below) are in Redis too (``bq:tok:{fingerprint}``, budget/keys.py): written by the producer, read by
the GPU workers that render a conversation's later turns (docs/multiturn.md, "Where rendering happens").

Why plain commands and not a script: the hash is content-addressed (the key is the Renderer fingerprint, which the
worker recomputes from the files it gets) and immutable, so there is no decision to make. Every file is written
with HSETNX in one MULTI/EXEC: a second ``produce`` of the same run, or a concurrent one, leaves the first copy as
it was, and a reader never sees part of a set. What the files are, and their size limit, is render/tokfiles.py's.
"""
from __future__ import annotations

import uuid
from typing import Any, Iterable, Mapping, Sequence

import redis

from budget import keys, scripts

#: Stream entries read per XRANGE while collecting.
RESULTS_BATCH = 1000


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RunState:
    """One client's view of the run bookkeeping. Cheap to build (no round trip: the two lock scripts are
    registered locally and loaded on first use)."""

    #: The epoch's key, for messages that tell an operator what changed.
    EPOCH_KEY = keys.EPOCH

    def __init__(self, client: "redis.Redis") -> None:
        self.r = client
        self._lock_refresh = client.register_script(scripts.LOCK_REFRESH)
        self._lock_release = client.register_script(scripts.LOCK_RELEASE)

    # -- the Redis epoch -----------------------------------------------------------------------------
    def claim_epoch(self) -> str:
        """This Redis' lifetime id, set now if it has none (SET NX, then read: whoever set it first wins)."""
        with self.r.pipeline(transaction=True) as p:
            p.set(keys.EPOCH, uuid.uuid4().hex, nx=True)
            p.get(keys.EPOCH)
            _, raw = p.execute()
        return _s(raw)

    def epoch(self) -> str | None:
        raw = self.r.get(keys.EPOCH)
        return None if raw is None else _s(raw)

    # -- the collector lock (``bq:ds:{n}:collector``): the one ``produce`` collecting a dataset ----------------
    @staticmethod
    def collector_key(name: str) -> str:
        """The lock's key, for messages that tell an operator what to look at."""
        return keys.DatasetKeys(name).collector

    def take_collector(self, name: str, token: str, ttl_ms: int) -> bool:
        return bool(self.r.set(keys.DatasetKeys(name).collector, token, nx=True, px=ttl_ms))

    def refresh_collector(self, name: str, token: str, ttl_ms: int) -> bool:
        """Extend the lock only if ``token`` still holds it (a script: read and write as one)."""
        return bool(self._lock_refresh(keys=[keys.DatasetKeys(name).collector], args=[token, ttl_ms]))

    def release_collector(self, name: str, token: str) -> None:
        self._lock_release(keys=[keys.DatasetKeys(name).collector], args=[token])

    def collector_holder(self, name: str) -> str | None:
        raw = self.r.get(keys.DatasetKeys(name).collector)
        return None if raw is None else _s(raw)

    # -- a dataset's record ---------------------------------------------------------------------------
    def datasets(self) -> list[str]:
        """Every dataset name this Redis knows, sorted."""
        raw: Any = self.r.smembers(keys.DATASETS)
        return sorted(_s(x) for x in raw)

    def exists(self, name: str) -> bool:
        return bool(self.r.exists(keys.DatasetKeys(name).meta))

    def field(self, name: str, field: str) -> str | None:
        """One field of the dataset's hash (budget/keys.py lists them), or None when unset."""
        raw = self.r.hget(keys.DatasetKeys(name).meta, field)
        return None if raw is None else _s(raw)

    def register(self, name: str, settings_json: str, created_at: float, out_dir: str | None = None) -> None:
        """Record the dataset (its name, the run's fingerprinted settings, the queue its chunks go to, the absolute
        output directory its files are in) and add it to the known datasets; ``created_at`` is kept from the
        first run. One MULTI/EXEC."""
        k = keys.DatasetKeys(name)
        mapping: dict[Any, Any] = {"name": name, "settings": settings_json, "queue": keys.QUEUE_NAME}
        if out_dir is not None:
            mapping["out_dir"] = out_dir
        with self.r.pipeline(transaction=True) as p:
            p.hset(k.meta, mapping=mapping)
            p.hsetnx(k.meta, "created_at", str(created_at))
            p.sadd(keys.DATASETS, name)
            p.execute()

    def set_run_budget(self, name: str, budget: int | None) -> None:
        """The --budget this ``produce`` gave (None: unlimited), for the next rerun to compare with."""
        self.r.hset(keys.DatasetKeys(name).meta, "run_budget", "" if budget is None else str(budget))

    def set_progress(self, name: str, selected: int, todo: int) -> None:
        """What the attached producer holds: samples selected, samples not yet handed to a chunk (for status)."""
        self.r.hset(keys.DatasetKeys(name).meta, mapping={"selected": selected, "todo": todo})

    def clear_failed(self, name: str) -> None:
        """Forget the recorded failures: a rerun tries those samples again."""
        self.r.delete(keys.DatasetKeys(name).failed)

    def forget(self, name: str) -> None:
        """Delete every key of the dataset but its collector lock (held by the caller): --new-run, after the
        dataset was closed and its queued chunks discarded (``Ledger.close``, ``Ledger.discard``)."""
        k = keys.DatasetKeys(name)
        self.r.delete(*[key for key in k.all() if key != k.collector])

    # -- enqueueing ------------------------------------------------------------------------------------
    def next_chunk_ids(self, name: str, n: int) -> list[str]:
        """``n`` new chunk (= RQ job) ids: from the dataset's counter, never reused."""
        last = int(self.r.incrby(keys.DatasetKeys(name).seq, n))
        return [keys.chunk_id(name, seq) for seq in range(last - n + 1, last + 1)]

    @staticmethod
    def hold(pipe: "redis.client.Pipeline", name: str, chunk_ids: Sequence[str], holders: Mapping[str, str]) -> None:
        """Queue on ``pipe`` (the caller's MULTI, which also enqueues the RQ jobs) the bookkeeping of new chunks:
        the dataset is known, the chunks are live and queued (score +inf), each sample is held by its chunk."""
        k = keys.DatasetKeys(name)
        pipe.sadd(keys.DATASETS, name)
        pipe.zadd(k.chunks, {cid: float("inf") for cid in chunk_ids})
        mapping: dict[Any, Any] = dict(holders)
        pipe.hset(k.pending, mapping=mapping)

    # -- the results stream ------------------------------------------------------------------------------
    def read_results(self, name: str, count: int = RESULTS_BATCH) -> list[tuple[Any, dict[Any, Any]]]:
        """The oldest ``count`` committed results not yet on disk: (entry id, fields) pairs."""
        entries: Any = self.r.xrange(keys.DatasetKeys(name).results, "-", "+", count=count)
        return list(entries)

    def drop_results(self, name: str, entry_ids: Sequence[Any]) -> None:
        """Delete results from the stream: only once they are written and fsynced."""
        if entry_ids:
            self.r.xdel(keys.DatasetKeys(name).results, *entry_ids)

    def result_ids(self, name: str) -> set[str]:
        """Sample ids committed but not yet collected."""
        stream = keys.DatasetKeys(name).results
        ids: set[str] = set()
        start = "-"
        while True:
            entries: Any = self.r.xrange(stream, start, "+", count=5000)
            for _entry_id, fields in entries:
                ids.add(_s(fields.get(b"id", fields.get("id"))))
            if len(entries) < 5000:
                return ids
            start = "(" + _s(entries[-1][0])

    def unwritten(self, name: str) -> int:
        return int(self.r.xlen(keys.DatasetKeys(name).results))

    def wait_for_results(self, names: Iterable[str], block_ms: int) -> None:
        """Return as soon as a result arrives in any of the datasets' streams, or after ``block_ms``."""
        streams: Any = {keys.DatasetKeys(n).results: "$" for n in names}
        if streams:
            self.r.xread(streams, block=block_ms, count=1)


#: The most bytes (compressed, as stored) one tokenizer's hash may hold: render/tokfiles.py refuses more than
#: 64 MiB of file bytes before compressing; this is the same bound on whatever a caller hands in.
MAX_STORED_BYTES = 64 * 1024 * 1024


class TokenizerStoreError(Exception):
    """Files refused for Redis; the message says why."""


def store_files(client: "redis.Redis", fingerprint: str, files: Mapping[str, bytes]) -> int:
    """Keep ``files`` (name -> zlib bytes) as the tokenizer files of ``fingerprint``; returns how many fields
    were new (0 when this run's files were stored already). Raises TokenizerStoreError above MAX_STORED_BYTES
    or for no files, ValueError for a fingerprint that is not a sha256 hex digest."""
    key = keys.tokenizer_files(fingerprint)
    if not files:
        raise TokenizerStoreError(f"no tokenizer files to store for fingerprint {fingerprint[:12]}")
    size = sum(len(v) for v in files.values())
    if size > MAX_STORED_BYTES:
        raise TokenizerStoreError(f"the tokenizer files take {size:,} bytes compressed, more than the "
                                  f"{MAX_STORED_BYTES:,} budgetq keeps in Redis for a run's tokenizer")
    with client.pipeline(transaction=True) as p:
        for name in sorted(files):
            p.hsetnx(key, name, files[name])
        return sum(int(x) for x in p.execute())


def fetch_files(client: "redis.Redis", fingerprint: str) -> dict[str, bytes]:
    """The stored files of ``fingerprint`` (name -> zlib bytes); empty when none were stored."""
    raw: Any = client.hgetall(keys.tokenizer_files(fingerprint))
    if any(not isinstance(v, bytes) for v in raw.values()):
        raise TokenizerStoreError("the tokenizer files are binary: read them with a client without "
                                  "decode_responses")
    return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw.items()}
