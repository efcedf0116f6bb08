"""One sample's trip: generate with retries, then the record that gets committed.

The retry policy lives here: 5xx, 429, resets, timeouts, aborted generations and malformed bodies are retried
with full-jitter backoff (never before Retry-After) up to ``BUDGETQ_MAX_ATTEMPTS``; a 400 is final, except
"Duplicate request ID" (a previous run of the sample still holds the rid), retried at once under the next rid.
A 401/403 (the server refused ``SGLANG_API_KEY``) is given up at once too, but it is not the sample's failure:
the sample is given back and the worker stops (``RequestContext.generate``). Nothing is retried while the worker
holds its requests (a warm stop, or every server down: worker/health.py): the sample is given back unfailed, so
neither a SIGTERM nor a dead server waits out ``BUDGETQ_RETRY_FOR``.

``RequestContext`` is what a request needs from its worker, on both paths: a one-turn sample
(worker/dispatch.py ``Dispatcher._run_one``) and each turn of a conversation (worker/turns.py). It holds the
steps the two share (generate or give back, fail, discard on close, wait for room) so that they are written once.

``RunningChunk`` (at the end) is a chunk while it runs, from its ``start_chunk`` until its last request is
committed: its requests in flight (``Flight``) and what each reserves, their tasks, whether its lease was lost,
and its ``ChunkReport``, which the RQ job returns once the chunk is dispatched and whose counts go on growing
until the chunk finishes (rq-dashboard shows them through the job's meta).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from budget.ledger import Ledger
from budget.payload import ChunkPayload, SamplePayload, request_id, sampling_params_of
from budget.record import make_record, make_turn
from budget.serverinfo import public_url
from worker.batch import Batcher, in_thread_until_answered
from worker.config import WorkerConfig
from worker.estimate import LengthModels
from worker.reasoning import parse_turn
from worker.sglang import GenerateError, Generation, SGLangClient

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
            if client.hold.is_set() and not err.held:  # stopping, or every server down: give it back, not retry
                err.held = True
            if not err.unavailable:
                unusable += 1
            waited = time.monotonic() - first
            if (not err.retryable or err.held or unusable >= config.max_attempts
                    or (err.unavailable and waited >= config.retry_for and tries >= config.max_attempts)):
                err.attempts = rid_no
                raise
            log.info("%s/%s attempt %d failed (%s), retrying", dataset, sample["id"], tries, err.reason)
            await client.pause(backoff(tries, config.backoff_cap, err.retry_after))  # cut short by a hold


def parse_response(dataset: str, chunk: ChunkPayload, sample: SamplePayload, gen: Generation) -> dict[str, Any]:
    """The turn's parse by the run's reasoning parser (the chunk's ``reasoning_parser``). With
    ``skip_special_tokens`` false the text holds special tokens, and the family's end-of-turn ones are left out of
    the parsed fields (worker/reasoning.py END_OF_TURN_TOKENS); ``response`` and ``output_ids`` stay verbatim."""
    kept = sampling_params_of(chunk, sample).get("skip_special_tokens", True) is False
    turn = parse_turn(chunk["reasoning_parser"], gen.text, opens_think=sample["opens_think"],
                      finish_reason=gen.finish_reason, call_id_seed=f"{dataset}\0{sample['id']}",
                      special_tokens=kept)
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
                      chat_template_kwargs=sample.get("chat_template_kwargs"), tools=sample.get("tools"))
    del rec["messages"]
    return rec


#: The tail of every fault message: what the worker does about it.
_GIVING_BACK = "starting no more requests, giving the chunk back"


@dataclass(frozen=True)
class RequestContext:
    """What a request needs from its worker; one per Dispatcher, shared by all its requests."""

    ledger: Ledger
    batcher: Batcher
    client: SGLangClient
    config: WorkerConfig
    length_models: LengthModels
    ended: asyncio.Event  # set whenever a request of the worker ends
    stop_requested: asyncio.Event  # the dispatcher's warm stop
    #: Stops the worker for a fault of its own (worker/dispatch.py), once however often it is called.
    fault: Callable[[str, Mapping[str, Any]], None]

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    async def generate(self, rc: RunningChunk, flight: Flight, sample: SamplePayload,
                       sampling_params: dict[str, Any], *, label: str, rid_key: str | None = None,
                       prefer: str | None = None) -> Generation | GenerateError | None:
        """``generate_sample``, its answer observed by the rate tracker. A GenerateError given up is noted in the
        chunk's report (``label`` names the request) and returned: the caller decides what it fails. None when the
        server refused this worker's credentials: not the sample's failure but the worker's, so the sample is
        given back unfailed (its reservation and in-flight count stay with the chunk until the chunk ends:
        finish_chunk drops both) and the worker stops. None too when the worker holds its requests (a warm stop,
        or every server down: SGLangClient.hold): the sample is given back the same way, and the worker goes on."""
        try:
            gen = await generate_sample(self.client, self.config, rc.dataset, sample, sampling_params, rc.report,
                                        rid_key=rid_key, prefer=prefer)
        except GenerateError as err:
            rc.report.errors.append(f"{label}: {err.reason}")
            if err.held:  # the worker is stopping or every server is down: given back, uncounted and unfailed
                rc.report.not_started += 1
                if rc.report.status == "ok":
                    rc.report.status = "stopped" if self.stopping else "server down"
                return None
            if not err.auth:
                return err
            url = public_url(err.server) if err.server else "SGLang"
            self.give_back(rc, f"SGLang server {url} refused this worker's credentials ({err.reason}): "
                               f"SGLANG_API_KEY is {'wrong' if self.config.api_key else 'not set'}; {_GIVING_BACK}",
                           {"server": url, "status": err.status})
            return None
        ran = time.monotonic() - flight.started
        self.length_models.rates.observe(gen.completion_tokens, ran)
        rc.request_s += ran
        rc.server_s += gen.server_s
        return gen

    def give_back(self, rc: RunningChunk, fault: str, log_extra: Mapping[str, Any] | None = None) -> None:
        """Give a sample back unfailed for a fault of this worker (``fault`` says which), and stop the worker."""
        rc.report.not_started += 1
        rc.report.status = "unauthorized"
        self.fault(fault, log_extra or {})

    def tokenizer_fault(self, rc: RunningChunk, message: str) -> None:
        """The run's tokenizer files cannot be had or do not give the run's fingerprint (worker/turns.py):
        every later turn this worker renders would be wrong alike, so it is the worker's fault, handled as a
        refused key."""
        self.give_back(rc, f"cannot render later turns of conversations: {message}; {_GIVING_BACK}")

    async def fail(self, rc: RunningChunk, flight: Flight, sid: str, err: GenerateError) -> None:
        """Record sample ``sid`` failed (failed.jsonl), releasing what its flight reserved; counted once."""
        if await self.batcher.call_until_answered("fail", self.ledger.fail_call(
                rc.dataset, sid, rc.id, {"id": sid, "reason": err.reason, "status": err.status,
                                         "attempts": err.attempts}, reserved=flight.reserved)):
            rc.report.failed += 1

    async def after_commit(self, dataset: str, closed_now: bool, used: int) -> None:
        """A commit that closed its dataset discards the dataset's queued chunks at once (discard is idempotent)."""
        if closed_now:
            n = await in_thread_until_answered("discard", self.ledger.discard, dataset, CLOSE_REASON)
            log.info("%s reached its budget (%d tokens): closed, %d queued chunks discarded", dataset, used, n)

    async def wait_for_room(self) -> None:
        """After a FULL admission: the budget is reserved by requests in flight, and one of them ending may free
        room. Wait until a request of this worker ends, or a second (another worker's may end)."""
        self.ended.clear()
        try:
            await asyncio.wait_for(self.ended.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass


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
