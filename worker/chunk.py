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
from dataclasses import dataclass, field
from typing import Any

from budget.ledger import LEASE_MS, Admit, Ledger
from budget.payload import ChunkPayload, SamplePayload, request_id
from worker.config import WorkerConfig
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


async def _keep_lease(ledger: Ledger, dataset: str, chunk: str, lost: asyncio.Event, beat: Any) -> None:
    while True:
        await asyncio.sleep(LEASE_MS / 4000)
        try:
            ok = ledger.refresh_chunk(dataset, chunk)
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
                        heartbeat: Any = None) -> ChunkReport:
    dataset, chunk_id = chunk["dataset"], chunk["chunk"]
    report = ChunkReport(chunk_id)
    started = ledger.start_chunk(dataset, chunk_id)
    if started != "ok":
        report.status = started
        report.not_started = len(chunk["samples"])
        return report

    lost = asyncio.Event()
    lease = asyncio.create_task(_keep_lease(ledger, dataset, chunk_id, lost, heartbeat))
    slots = asyncio.Semaphore(config.concurrency)
    tasks: list[asyncio.Task[None]] = []

    async def run_one(sample: SamplePayload) -> None:
        try:
            try:
                gen = await generate_sample(client, config, dataset, sample, chunk["sampling_params"], report)
            except GenerateError as err:
                report.errors.append(f"{sample['id']}: {err.reason}")
                if ledger.fail(dataset, sample["id"], chunk_id,
                               {"id": sample["id"], "reason": err.reason, "status": err.status,
                                "attempts": err.attempts}):
                    report.failed += 1
                return
            outcome = ledger.commit(dataset, sample["id"], gen.completion_tokens,
                                    result_record(dataset, sample, gen, chunk))
            if outcome.committed:
                report.committed += 1
                report.tokens += gen.completion_tokens
            else:
                report.duplicates += 1
            if outcome.closed_now:
                n = ledger.discard(dataset, CLOSE_REASON)
                log.info("%s reached its budget (%d tokens): closed, %d queued chunks discarded",
                         dataset, outcome.used, n)
        finally:
            slots.release()

    try:
        for i, sample in enumerate(chunk["samples"]):
            await slots.acquire()
            verdict = Admit.REVOKED if lost.is_set() else ledger.admit(dataset, sample["id"], chunk_id)
            if verdict is Admit.SKIP:
                report.skipped += 1
                slots.release()
                continue
            if verdict is not Admit.START:
                report.status = "closed" if verdict is Admit.CLOSED else "revoked"
                report.not_started = len(chunk["samples"]) - i
                slots.release()
                break
            tasks.append(asyncio.create_task(run_one(sample)))
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
