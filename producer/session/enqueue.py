"""Turn rendered samples into chunk jobs on the shared RQ queue, atomically with budgetq's bookkeeping.

A batch of chunks goes in one MULTI/EXEC: the RQ jobs, their ids in the dataset's live-chunk set (score +inf:
queued) and each sample's holder in the pending hash. A ``produce`` killed mid-enqueue leaves either a whole
batch or nothing, so a rerun never enqueues a sample twice and never loses one. ``produce --detach`` sends a
dataset in batches of ``BATCH_CHUNKS`` chunks (producer/session/loop.py): one MULTI/EXEC of everything would hold every
payload in memory at once (1.9 GB for 100,000 prompts) for no gain in safety, since each batch is atomic.

Serialization is the producer's hot spot (benchmark 4, docs/performance.md): a chunk of 64 prompts is ~100 KB of
JSON. RQ's own path (stdlib ``json`` of Python int lists, then ``zlib`` at level 6 in ``Job.to_dict``) cost
103 µs a sample, more than a third of ``produce``. Here the job data is the same standard JSON, written by orjson
straight from the rendered ``array``s (through a zero-copy numpy view: no Python int per token) and compressed
at level 1: ~17 µs a sample, for ~15% more bytes in Redis. Workers need no change: they read job data with rq's
``JSONSerializer`` (stdlib ``json.loads``), and RQ's ``Job.restore`` decompresses any zlib level.
"""
from __future__ import annotations

import json
import zlib
from array import array
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np
import orjson
import redis
from rq import Queue, Worker
from rq.job import Job

from budget import keys
from budget.record import JOB_FUNCTION, VERSION, ConversationPayload, ThinkPayload
from budget.runstate import RunState

#: Chunks per MULTI/EXEC when a whole dataset is enqueued (``--detach``, the first fill): 64 chunks of 64
#: prompts are ~2 MB on the wire, so a batch costs little memory and the round trips stay few.
BATCH_CHUNKS = 64
#: Threads compressing chunk data while the producer's thread serializes the next chunks: zlib releases the GIL.
COMPRESS_THREADS = 2
#: zlib level of job data. Level 1 compresses a chunk's JSON ~2.9x (level 6: ~3.7x) at a third of the CPU.
ZLIB_LEVEL = 1
#: The tail (docs/performance.md, figure 8): a chunk's unstarted samples start only on the worker holding it, so
#: when the queue runs dry the other workers idle while it works through them. Chunks shrink as a dataset's
#: to-do list falls: a chunk holds at most 1/(TAIL_SPREAD x workers) of the to-do left when it is made, so what
#: comes after it always gives every worker TAIL_SPREAD chunks of at least its size.
TAIL_SPREAD = 2
#: ... but never fewer samples than this (unless --chunk-size is smaller): a chunk costs a job, a start and a
#: finish; the last chunks of a run are this size, and a worker's window (BUDGETQ_CONCURRENCY, 64) starts one
#: in a single admission.
MIN_CHUNK = 8
#: Workers assumed while none is registered on the queue: a first fill made before the workers start would
#: otherwise cut the tail of a small dataset into chunks sized for one worker.
ASSUMED_WORKERS = 4


@dataclass(frozen=True)
class JobSettings:
    job_timeout: int = 6 * 3600  # a chunk's whole run; liveness is the lease, not this
    result_ttl: int = 24 * 3600  # how long finished chunks stay visible in rq-dashboard
    failure_ttl: int = 7 * 24 * 3600  # always explicit: RQ's failure stream never expires otherwise


TokenIds = Union[list[int], "array[int]"]


@dataclass(frozen=True)
class Item:
    """A sample ready to send. ``input_ids`` may stay the compact ``array('i')`` prepare made: it is written to
    JSON from the array itself."""

    id: str
    input_ids: TokenIds
    opens_think: bool
    #: ``--turns all``, a conversation of more than one turn: the dataset's messages and its turns at most
    #: (budget/record.py SamplePayload); None and 1 for every other sample.
    messages: list[dict[str, Any]] | None = None
    turns: int = 1
    #: What this sample's generation sends differently from the chunk (producer/generations.py); None: the chunk's.
    sampling_params: dict[str, Any] | None = None
    #: --template-kwargs-mix: the kwargs the sample was rendered with, and (a conversation) their Renderer's
    #: fingerprint (budget/record.py SamplePayload); None: the run's.
    chat_template_kwargs: dict[str, Any] | None = None
    tokenizer: str | None = None
    #: The record's tool definitions (budget/record.py SamplePayload); None: none.
    tools: list[dict[str, Any]] | None = None


class ChunkSerializer:
    """Standard JSON out (orjson, numpy int arrays as JSON arrays), stdlib ``json`` in, as the workers read it.

    Only this process writes with it; anything reading a chunk job (workers, rq-dashboard, tests) uses rq's
    ``JSONSerializer`` and gets the same values."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)

    @staticmethod
    def loads(data: bytes) -> Any:
        return json.loads(data)


class ChunkJob(Job):
    """RQ's job, with its data compressed at ``ZLIB_LEVEL`` instead of zlib's default level 6, possibly ahead of
    time in another thread (``compressed``: zlib releases the GIL, so a batch's chunks compress in parallel
    with the job bookkeeping on this thread).

    ``Job.to_dict`` calls ``zlib.compress(self.data)`` with no level and offers no hook, so the data is swapped
    for an empty string while RQ builds the rest of the hash (every other field stays RQ's), then put in
    compressed here. tests/redis/test_enqueue.py checks the result against RQ's own ``to_dict``."""

    compressed: "Future[bytes] | None" = None

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict[str, Any]:
        data = self.data
        self._data = b""
        try:
            obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        finally:
            self._data = data
        obj["data"] = self.compressed.result() if self.compressed is not None else zlib.compress(data, ZLIB_LEVEL)
        return obj


def chunk_size_for(todo: int, maximum: int, workers: int) -> int:
    """Samples in the next chunk of a dataset with ``todo`` samples not yet in any chunk: ``maximum``
    (--chunk-size) while the to-do list is long, then ceil(todo / (TAIL_SPREAD x workers)), down to MIN_CHUNK.
    ``workers``: the RQ workers listening; before any has registered (produce usually starts first),
    ASSUMED_WORKERS."""
    spread = TAIL_SPREAD * (workers if workers > 0 else ASSUMED_WORKERS)
    return max(1, min(maximum, max(MIN_CHUNK, -(-todo // spread))))


def listening_workers(queue: Queue) -> int:
    """RQ workers registered on the chunk queue (RQ's own registry; a crashed worker stays in it until RQ's
    cleanup), for ``chunk_size_for``. 0 when none has started yet."""
    return Worker.count(queue=queue)


def make_queue(client: "redis.Redis") -> Queue:
    return Queue(keys.QUEUE_NAME, connection=client, serializer=ChunkSerializer, job_class=ChunkJob)


def wire_ids(ids: TokenIds) -> Any:
    """What orjson writes as the JSON array of ``ids``: a numpy view of an ``array('i')`` (no copy, no Python
    ints), a list as it is."""
    if isinstance(ids, array):
        return np.frombuffer(ids, dtype=np.intc)
    return ids


def _sample(it: Item) -> dict[str, Any]:
    sample: dict[str, Any] = {"id": it.id, "input_ids": wire_ids(it.input_ids), "opens_think": it.opens_think}
    if it.turns > 1:
        sample["messages"] = it.messages
        sample["turns"] = it.turns
    if it.sampling_params:
        sample["sampling_params"] = it.sampling_params
    if it.chat_template_kwargs is not None:
        sample["chat_template_kwargs"] = it.chat_template_kwargs
        if it.turns > 1 and it.tokenizer is not None:
            sample["tokenizer"] = it.tokenizer
    if it.tools:
        sample["tools"] = it.tools
    return sample


def enqueue_chunks(client: "redis.Redis", queue: Queue, dataset: str, chunks: Sequence[Sequence[Item]], *,
                   sampling_params: dict[str, Any], think: ThinkPayload | None,
                   settings: JobSettings, reasoning_parser: str = "none", compress: Executor | None = None,
                   conversation: ConversationPayload | None = None, at_front: bool = False) -> list[str]:
    """Enqueue ``chunks`` (lists of samples) for ``dataset`` in one MULTI/EXEC; returns their chunk ids in order.

    The payload is ``budget.record.ChunkPayload`` on the wire; ``input_ids`` arrays are written as JSON arrays
    without becoming lists first. ``reasoning_parser`` names the parser the workers split the responses with (``none``: no split). With ``compress`` (a thread pool), each chunk's data is compressed there while
    the next chunks are serialized and the jobs built here. A sample with ``turns`` > 1 carries its ``messages`` and
    ``turns``, and its chunk carries ``conversation`` (what a worker needs to render the later turns: required
    then, and left out of a chunk of one-turn samples). ``at_front``: the chunks go to the front of the queue, in
    their order (samples given back, which come before what is queued)."""
    if not chunks:
        return []
    store = RunState(client)
    ids = store.next_chunk_ids(dataset, len(chunks))
    jobs = []
    pending: dict[str, str] = {}
    for cid, items in zip(ids, chunks, strict=True):
        samples = [_sample(it) for it in items]
        payload: dict[str, Any] = {"v": VERSION, "dataset": dataset, "chunk": cid, "sampling_params": sampling_params,
                                   "think": think, "reasoning_parser": reasoning_parser, "samples": samples}
        if any(it.turns > 1 for it in items):
            if conversation is None:
                raise ValueError(f"chunk {cid} holds multi-turn samples but no conversation block was given")
            payload["conversation"] = conversation
        first, final = items[0].id, items[-1].id
        job = queue.create_job(
            JOB_FUNCTION, args=(payload,), job_id=cid, timeout=settings.job_timeout,
            result_ttl=settings.result_ttl, failure_ttl=settings.failure_ttl,
            description=f"{dataset}: {len(items)} samples ({first} .. {final})",
            meta={"dataset": dataset, "samples": len(items), "first": first, "last": final})
        if compress is not None and isinstance(job, ChunkJob):
            job.compressed = compress.submit(zlib.compress, job.data, ZLIB_LEVEL)
        jobs.append(job)
        for it in items:
            pending[it.id] = cid
    with client.pipeline(transaction=True) as pipe:
        pipe.multi()  # explicit: RQ's enqueue_job puts a pipeline in MULTI mode itself unless it already is
        store.hold(pipe, dataset, ids, pending)
        for job in reversed(jobs) if at_front else jobs:  # each at_front push goes before the one pushed before it
            queue.enqueue_job(job, pipeline=pipe, at_front=at_front)
        pipe.execute()
    return ids
