"""Turn rendered samples into chunk jobs on the shared RQ queue, atomically with budgetq's bookkeeping.

A batch of chunks goes in one MULTI/EXEC: the RQ jobs, their ids in the dataset's live-chunk set (score +inf:
queued) and each sample's holder in the pending hash. A ``produce`` killed mid-enqueue leaves either a whole
batch or nothing, so a rerun never enqueues a sample twice and never loses one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from budget import keys
from budget.payload import JOB_FUNCTION, VERSION, ChunkPayload, SamplePayload, ThinkPayload


@dataclass(frozen=True)
class JobSettings:
    job_timeout: int = 6 * 3600  # a chunk's whole run; liveness is the lease, not this
    result_ttl: int = 24 * 3600  # how long finished chunks stay visible in rq-dashboard
    failure_ttl: int = 7 * 24 * 3600  # always explicit: RQ's failure stream never expires otherwise


@dataclass(frozen=True)
class Item:
    """A sample ready to send."""

    id: str
    input_ids: list[int]
    opens_think: bool


def make_queue(client: "redis.Redis") -> Queue:
    return Queue(keys.QUEUE_NAME, connection=client, serializer=JSONSerializer)


def enqueue_chunks(client: "redis.Redis", queue: Queue, dataset: str, chunks: Sequence[Sequence[Item]], *,
                   sampling_params: dict[str, Any], think: ThinkPayload | None,
                   settings: JobSettings) -> list[str]:
    """Enqueue ``chunks`` (lists of samples) for ``dataset``; returns their chunk ids in order."""
    if not chunks:
        return []
    k = keys.DatasetKeys(dataset)
    last = int(client.incrby(k.seq, len(chunks)))
    ids = [keys.chunk_id(dataset, seq) for seq in range(last - len(chunks) + 1, last + 1)]
    datas = []
    pending: dict[Any, Any] = {}
    for cid, items in zip(ids, chunks):
        samples: list[SamplePayload] = [
            {"id": it.id, "input_ids": it.input_ids, "opens_think": it.opens_think} for it in items]
        payload: ChunkPayload = {"v": VERSION, "dataset": dataset, "chunk": cid,
                                 "sampling_params": sampling_params, "think": think, "samples": samples}
        first, final = items[0].id, items[-1].id
        datas.append(Queue.prepare_data(
            JOB_FUNCTION, args=(payload,), job_id=cid, timeout=settings.job_timeout,
            result_ttl=settings.result_ttl, failure_ttl=settings.failure_ttl,
            description=f"{dataset}: {len(items)} samples ({first} .. {final})",
            meta={"dataset": dataset, "samples": len(items), "first": first, "last": final}))
        for it in items:
            pending[it.id] = cid
    with client.pipeline(transaction=True) as pipe:
        pipe.sadd(keys.DATASETS, dataset)
        pipe.zadd(k.chunks, {cid: float("inf") for cid in ids})
        pipe.hset(k.pending, mapping=pending)
        queue.enqueue_many(datas, pipeline=pipe)
        pipe.execute()
    return ids
