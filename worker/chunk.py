"""Run one chunk: admit, generate, commit each sample, with a lease that proves the worker is alive.

Flow per sample: ``admit`` (is the dataset open, is this chunk still the sample's holder) -> ``POST /generate``
with retries -> ``commit`` (one Lua script: exactly-once, counted, result queued for the producer). When a
commit closes the dataset, the worker discards the dataset's queued chunks at once; requests already in
flight finish and are committed (GPU work is never thrown away), but no new request of the dataset starts.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

from budget.ledger import LEASE_MS, Admission, Admit, Ledger
from budget.payload import ChunkPayload, SamplePayload, request_id
from worker.config import WorkerConfig
from worker.estimate import LengthModel, RateTracker
from worker.reasoning import split_reasoning
from worker.sglang import Generation, GenerateError, SGLangClient

log = logging.getLogger("budgetq.worker")

CLOSE_REASON = "budget reached"


@dataclass
class ChunkReport:
    chunk: str
    status: str = "ok"  # ok / revoked / closed
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


def backoff(attempt: int, cap: float, retry_after: float | None) -> float:
    """Full-jitter exponential backoff, never sooner than the server's Retry-After."""
    delay = random.uniform(0, min(cap, 0.5 * 2 ** attempt))
    return max(delay, retry_after or 0.0)


async def generate_sample(client: SGLangClient, config: WorkerConfig, dataset: str, sample: SamplePayload,
                          sampling_params: dict[str, Any], report: ChunkReport) -> Generation:
    """Try a sample up to ``max_attempts`` times; raises the last GenerateError when every attempt failed."""
    max_new = int(sampling_params["max_new_tokens"])
    attempt = 0
    rid_no = 0
    while True:
        payload = {"input_ids": sample["input_ids"], "sampling_params": sampling_params,
                   "rid": request_id(dataset, sample["id"], rid_no)}
        report.attempts += 1
        try:
            return await client.generate(payload, max_new)
        except GenerateError as err:
            rid_no += 1
            if err.new_rid and rid_no < 100:
                continue  # a previous run of this sample still holds the rid: not a failure
            attempt += 1
            if not err.retryable or attempt >= config.max_attempts:
                err.attempts = rid_no
                raise
            log.info("%s/%s attempt %d failed (%s), retrying", dataset, sample["id"], attempt, err.reason)
            await asyncio.sleep(backoff(attempt, config.backoff_cap, err.retry_after))


def result_record(dataset: str, sample: SamplePayload, gen: Generation, chunk: ChunkPayload) -> dict[str, Any]:
    think = chunk["think"]
    split = split_reasoning(gen.text, start=think["start"] if think else None, end=think["end"] if think else None,
                            opens_think=sample["opens_think"], finish_reason=gen.finish_reason)
    return {
        "id": sample["id"], "dataset": dataset, "response": gen.text, "reasoning": split.reasoning,
        "content": split.content, "reasoning_truncated": split.reasoning_truncated,
        "prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
        "finish_reason": gen.finish_reason, "sampling_params": chunk["sampling_params"],
    }


@dataclass
class Flight:
    """A request in flight and what it reserves (budget/scripts.py ADMIT, COMMIT)."""

    started: float
    reserved: int


class Budgeting:
    """What a worker knows about a dataset's budget mode and lengths, refreshed from Redis every few seconds."""

    REFRESH_S = 5.0

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.rates = RateTracker()
        self._models: dict[str, tuple[float, str, LengthModel]] = {}

    def model(self, dataset: str) -> tuple[str, LengthModel]:
        now = time.monotonic()
        cached = self._models.get(dataset)
        if cached is None or now - cached[0] > self.REFRESH_S:
            lengths, prior, max_new, mode = self.ledger.length_sample(dataset)
            cached = (now, mode, LengthModel(lengths, prior, max_new))
            self._models[dataset] = cached
        return cached[1], cached[2]

    def expected(self, dataset: str, elapsed: float = 0.0) -> int:
        return self.model(dataset)[1].expected(self.rates.progress(elapsed))


async def _keep_lease(ledger: Ledger, dataset: str, chunk: str, lost: asyncio.Event, beat: Any,
                      flights: dict[str, Flight], budgeting: Budgeting, interval: float) -> None:
    """Refresh the lease every LEASE_MS/4 and, in predict mode, grow running requests' reservations every
    ``interval`` seconds: a request that has run long is expected to run longer."""
    last_lease = time.monotonic()
    while True:
        await asyncio.sleep(min(interval, LEASE_MS / 4000))
        now = time.monotonic()
        reserved: int | None = None
        try:
            mode, model = budgeting.model(dataset)
            if mode == "predict" and flights:
                for f in flights.values():
                    f.reserved = model.expected(budgeting.rates.progress(now - f.started))
                reserved = sum(f.reserved for f in flights.values())
            elif now - last_lease < LEASE_MS / 4000:
                continue
            ok = ledger.refresh_chunk(dataset, chunk, reserved=reserved)
            last_lease = now
            if beat is not None:
                beat()
        except Exception as exc:  # Redis hiccup: keep trying; the lease has slack for three misses
            log.warning("lease refresh for %s failed: %s", chunk, exc)
            continue
        if not ok:
            log.warning("chunk %s was reclaimed or discarded: starting nothing more of it", chunk)
            lost.set()
            return


async def process_chunk(chunk: ChunkPayload, *, ledger: Ledger, client: SGLangClient, config: WorkerConfig,
                        heartbeat: Any = None, budgeting: Budgeting | None = None) -> ChunkReport:
    dataset, chunk_id = chunk["dataset"], chunk["chunk"]
    budgeting = budgeting or Budgeting(ledger)
    report = ChunkReport(chunk_id)
    started = ledger.start_chunk(dataset, chunk_id)
    if started != "ok":
        report.status = started
        report.not_started = len(chunk["samples"])
        return report

    lost = asyncio.Event()
    flights: dict[str, Flight] = {}
    progressed = asyncio.Event()  # set whenever a request of this chunk ends
    lease = asyncio.create_task(_keep_lease(ledger, dataset, chunk_id, lost, heartbeat, flights, budgeting,
                                            config.reserve_interval))
    slots = asyncio.Semaphore(config.concurrency)
    tasks: list[asyncio.Task[None]] = []

    async def run_one(sample: SamplePayload, flight: Flight) -> None:
        sid = sample["id"]
        try:
            try:
                gen = await generate_sample(client, config, dataset, sample, chunk["sampling_params"], report)
            except GenerateError as err:
                report.errors.append(f"{sid}: {err.reason}")
                if ledger.fail(dataset, sid, chunk_id, {"id": sid, "reason": err.reason, "status": err.status,
                                                         "attempts": err.attempts}, reserved=flight.reserved):
                    report.failed += 1
                return
            budgeting.rates.observe(gen.completion_tokens, time.monotonic() - flight.started)
            outcome = ledger.commit(dataset, sid, gen.completion_tokens, result_record(dataset, sample, gen, chunk),
                                    chunk=chunk_id, reserved=flight.reserved, finish_reason=gen.finish_reason)
            if outcome.committed:
                report.committed += 1
                report.tokens += gen.completion_tokens
                report.late += outcome.late
            else:
                report.duplicates += 1
            if outcome.closed_now:
                n = ledger.discard(dataset, CLOSE_REASON)
                log.info("%s reached its budget (%d tokens): closed, %d queued chunks discarded",
                         dataset, outcome.used, n)
        finally:
            flights.pop(sid, None)
            progressed.set()
            slots.release()

    try:
        samples = chunk["samples"]
        i = 0
        while i < len(samples):
            sample = samples[i]
            await slots.acquire()
            if lost.is_set():
                admission = Admission(Admit.REVOKED, 0)
            else:
                admission = ledger.admit(dataset, sample["id"], chunk_id, budgeting.expected(dataset))
            verdict = admission.verdict
            if verdict is Admit.FULL and flights:
                # The budget is reserved by requests in flight. Ours will end and free some: wait for that.
                slots.release()
                progressed.clear()
                try:
                    await asyncio.wait_for(progressed.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    pass
                continue
            if verdict is Admit.SKIP:
                report.skipped += 1
                slots.release()
                i += 1
                continue
            if verdict is not Admit.START:
                report.status = {Admit.CLOSED: "closed", Admit.FULL: "full"}.get(verdict, "revoked")
                report.not_started = len(samples) - i
                slots.release()
                if verdict is Admit.CLOSED:
                    ledger.discard(dataset, CLOSE_REASON)  # strict closes at admission; safe to repeat
                break
            flight = Flight(time.monotonic(), admission.reserved)
            flights[sample["id"]] = flight
            tasks.append(asyncio.create_task(run_one(sample, flight)))
            i += 1
        if tasks:
            await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        lease.cancel()
        await asyncio.gather(lease, return_exceptions=True)
    ledger.finish_chunk(dataset, chunk_id)
    return report
