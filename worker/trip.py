"""One sample's trip: generate with retries, then the record that gets committed.

The retry policy lives here: 5xx, 429, resets, timeouts, aborted generations and malformed bodies are retried
with full-jitter backoff (never before Retry-After) up to ``BUDGETQ_MAX_ATTEMPTS``; a 400 is final, except
"Duplicate request ID" (a previous run of the sample still holds the rid), retried at once under the next rid.
A 401/403 (the server refused ``SGLANG_API_KEY``) is given up at once too, but it is not the sample's failure:
worker/dispatch.py gives the sample back and stops the worker.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from budget.payload import ChunkPayload, SamplePayload, request_id, sampling_params_of
from budget.record import make_record, make_turn
from worker.config import WorkerConfig
from worker.reasoning import parse_turn
from worker.running import ChunkReport
from worker.sglang import Generation, GenerateError, SGLangClient

log = logging.getLogger("budgetq.worker")

#: Why a commit that closed its dataset discards the dataset's queued chunks: the reason their canceled RQ jobs
#: carry in their description (rq-dashboard).
CLOSE_REASON = "budget reached"


def backoff(attempt: int, cap: float, retry_after: float | None) -> float:
    """Full-jitter exponential backoff, never sooner than the server's Retry-After."""
    delay = random.uniform(0, min(cap, 0.5 * 2 ** attempt))
    return max(delay, retry_after or 0.0)


async def generate_sample(client: SGLangClient, config: WorkerConfig, dataset: str, sample: SamplePayload,
                          sampling_params: dict[str, Any], report: ChunkReport, *, rid_key: str | None = None,
                          prefer: str | None = None) -> Generation:
    """Generate one sample; raises the last GenerateError when it is given up.

    Given up: at once on a final error (a 400); after ``max_attempts`` unusable answers (aborts, broken bodies);
    and for an unavailable server (5xx, 429, resets, timeouts) only after ``retry_for`` seconds of trying, so
    an outage of SGLang is waited out instead of failing every sample in flight.

    ``rid_key`` names the request in its rid (default the sample id; a conversation's later turns add the turn);
    ``prefer`` is the server a conversation's previous turn ran on (SGLangClient.pick_server).
    """
    key = sample["id"] if rid_key is None else rid_key
    max_new = int(sampling_params["max_new_tokens"])
    first = time.monotonic()
    unusable = 0  # aborts and broken answers
    tries = 0  # requests that were not a duplicate-rid refusal
    rid_no = 0
    while True:
        payload = {"input_ids": sample["input_ids"], "sampling_params": sampling_params,
                   "rid": request_id(dataset, key, rid_no)}
        report.attempts += 1
        try:
            return await client.generate(payload, max_new, prefer)
        except GenerateError as err:
            rid_no += 1
            if err.new_rid and rid_no < 100:
                continue  # a previous run of this sample still holds the rid: not a failure
            tries += 1
            if not err.unavailable:
                unusable += 1
            waited = time.monotonic() - first
            if (not err.retryable or unusable >= config.max_attempts
                    or (err.unavailable and waited >= config.retry_for and tries >= config.max_attempts)):
                err.attempts = rid_no
                raise
            log.info("%s/%s attempt %d failed (%s), retrying", dataset, sample["id"], tries, err.reason)
            await asyncio.sleep(backoff(tries, config.backoff_cap, err.retry_after))


def parse_response(dataset: str, chunk: ChunkPayload, sample: SamplePayload, gen: Generation) -> dict[str, Any]:
    """The turn's parse by the run's reasoning parser (the chunk's ``reasoning_parser``)."""
    turn = parse_turn(chunk["reasoning_parser"], gen.text, opens_think=sample["opens_think"],
                      finish_reason=gen.finish_reason, call_id_seed=f"{dataset}\0{sample['id']}")
    return {"reasoning": turn.reasoning, "content": turn.content,
            "reasoning_truncated": turn.reasoning_truncated, "reasoning_unclosed": turn.reasoning_unclosed,
            "tool_calls": list(turn.tool_calls), "tool_call_errors": turn.tool_call_errors}


def result_record(dataset: str, sample: SamplePayload, gen: Generation, chunk: ChunkPayload) -> dict[str, Any]:
    """The version 2 record (budget/record.py) of a one-turn sample, without ``messages``: the producer holds the
    prompt messages and adds them when it writes the line. The prompt ids are hashed, not sent back."""
    parsed = parse_response(dataset, chunk, sample, gen)
    turn = make_turn(response=gen.text, prompt_tokens=gen.prompt_tokens, cached_tokens=gen.cached_tokens,
                     completion_tokens=gen.completion_tokens, finish_reason=gen.finish_reason,
                     prompt_ids=sample["input_ids"], output_ids=gen.output_ids, **parsed)
    rec = make_record(sample_id=sample["id"], dataset=dataset, turns=[turn],
                      reasoning_parser=chunk.get("reasoning_parser"),
                      sampling_params=sampling_params_of(chunk, sample),
                      chat_template_kwargs=sample.get("chat_template_kwargs"))
    del rec["messages"]
    return rec
