"""A chunk while it runs: from its ``start_chunk`` until its last request is committed.

What the dispatcher (worker/dispatch.py) keeps per chunk: its requests in flight and what each reserves, their
tasks, whether its lease was lost, and its report, which the RQ job returns once the chunk is dispatched and whose
counts go on growing until the chunk finishes (rq-dashboard shows them through the job's meta).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from budget.payload import ChunkPayload


@dataclass
class ChunkReport:
    """What happened to a chunk. The RQ job returns it when the chunk is dispatched (every sample started or
    given back); the counts of its requests still running keep growing until the chunk finishes."""

    chunk: str
    status: str = "ok"  # ok / stopped / revoked / closed / full / unauthorized / server down
    committed: int = 0
    duplicates: int = 0
    failed: int = 0
    skipped: int = 0
    not_started: int = 0
    tokens: int = 0
    late: int = 0  # committed after this chunk had lost its lease (its reservation had expired)
    attempts: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["errors"] = self.errors[:5]
        return d


@dataclass
class Flight:
    """A request in flight and what it reserves (budget/scripts.py ADMIT, COMMIT)."""

    started: float
    reserved: int
    #: predict: what a conversation's later turns are expected to add, reserved with this turn (worker/turns.py)
    future: int = 0
    #: a conversation's flight, and the turn it is on: predict prices it with that turn's model (TurnModels)
    conversation: bool = False
    turn: int = 0


class RunningChunk:
    """A chunk from its start until its last request is committed."""

    def __init__(self, chunk: ChunkPayload) -> None:
        self.chunk = chunk
        self.dataset, self.id = chunk["dataset"], chunk["chunk"]
        self.report = ChunkReport(self.id)
        self.flights: dict[str, Flight] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.lost = asyncio.Event()
        self.lease: asyncio.Task[None] | None = None
        self.started = 0  # requests started (admitted and sent)
        self.resume: dict[str, int] = {}  # conversations of this chunk started before (sample -> turns committed)
        self.meta_at = 0.0  # monotonic time of the last progress write to the RQ job's meta
        self.request_s = 0.0  # seconds its answered requests ran, start to answer: the dataset's request time
        self.server_s = 0.0  # their share of the servers' busy time (Generation.server_s): the dataset's GPU time

    def meta(self, state: str) -> dict[str, Any]:
        """The RQ job's meta: what the producer wrote at enqueue (dataset, samples, first, last) plus progress.
        ``state``: running (requests may still start or run), done (last request committed), interrupted (the
        worker's code or shutdown cut it short: the lease lapses and the producer re-enqueues the rest), or
        revoked/closed (given back at its start: reclaimed, discarded, or its dataset closed)."""
        samples, r = self.chunk["samples"], self.report
        return {"dataset": self.dataset, "samples": len(samples),
                "first": samples[0]["id"] if samples else None, "last": samples[-1]["id"] if samples else None,
                "state": state, "started": self.started, "in_flight": len(self.flights), "committed": r.committed,
                "failed": r.failed, "skipped": r.skipped, "not_started": r.not_started, "tokens": r.tokens,
                "stop_reason": None if r.status == "ok" else r.status,
                "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
