"""One conversation's trip (``--turns all``): turn after turn in one worker, each committed once, until it ends.

Turn 0 is admitted with the chunk's other samples (worker/dispatch.py ``_start_all``: a new conversation starts
only while its dataset is open); every later turn asks ``admit_turn``, which lets a started conversation finish
while the dataset is closed (drain, predict) and stops it when the budget was cut (docs/multiturn.md). Each turn's
tokens are committed by ``commit_turn``, keyed by (sample, turn): a resend, a zombie's copy or an RQ retry is a
duplicate and counts nothing. The conversation ends with ``end_conversation``, which moves the committed turns
into one record on the results stream, once.

A conversation keeps its slot of the window from turn 0 to its end. Between turns it holds the slot for a
commit's round trip and a render (milliseconds, against seconds for a turn), and keeping it means a started
conversation never waits behind unstarted ones for its next turn, so started conversations finish first and
their state leaves Redis (measured in docs/performance.md, the multi-turn efficiency figure).

Later turns are rendered here, in a thread, with the run's tokenizer files from Redis (worker/tokenizer_cache.py):
transformers is imported on the first such turn, never in a single-turn run. A worker that resumes a conversation
another one started renders its history from the committed turns in Redis, never from memory.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from budget.conversation import BUDGET, CONTEXT, FAILED, header, walk
from budget.history import plan
from budget.outcomes import EndVerdict, TurnAdmit, TurnVerdict
from budget.payload import SamplePayload, sampling_params_of, turn_request_key
from budget.record import make_turn
from budget.serverinfo import public_url
from budget.vocab import turn_refusal
from worker.batch import in_thread_until_answered
from worker.running import Flight, RunningChunk
from worker.sglang import GenerateError
from worker.trip import CLOSE_REASON, generate_sample, parse_response

if TYPE_CHECKING:
    from render.chat import Renderer
    from worker.dispatch import Dispatcher

log = logging.getLogger("budgetq.worker")


def _renderer(d: "Dispatcher", rc: RunningChunk, sample: SamplePayload) -> "Renderer":
    """The run's Renderer, or with a template kwargs mix the sample's (its own kwargs and fingerprint; the
    tokenizer files are the run's, stored under the conversation block's fingerprint)."""
    from worker.tokenizer_cache import renderer_for
    from render.chat import ThinkMarkers
    conv = rc.chunk["conversation"]
    markers = conv.get("open_markers")
    kwargs = sample.get("chat_template_kwargs")
    fingerprint = sample.get("tokenizer") if kwargs is not None else None
    return renderer_for(d.ledger.r, fingerprint or conv["tokenizer"], files=conv["tokenizer"],
                        chat_template_kwargs=kwargs if fingerprint else conv.get("chat_template_kwargs") or {},
                        opens_markers=ThinkMarkers(markers[0], markers[1]) if markers else None)


async def run_conversation(d: "Dispatcher", rc: RunningChunk, sample: SamplePayload, flight: Flight,
                           resumed: bool) -> None:
    """Carry conversation ``sample`` to its end (or until it is no longer this chunk's). ``resumed``: it has
    committed turns already (another worker started it); its turn 0 was not admitted with the chunk."""
    from worker.tokenizer_cache import TokenizerFault
    dataset, sid, report, chunk = rc.dataset, sample["id"], rc.report, rc.chunk
    sampling_params = sampling_params_of(chunk, sample)  # the generation's override, for every turn
    max_new = int(sampling_params["max_new_tokens"])
    steps = plan(sample["messages"])
    turns: list[dict[str, Any]] = []
    if resumed:
        turns = await in_thread_until_answered("committed turns", d.ledger.committed_turns, dataset, sid)
    renderer: "Renderer | None" = None
    prefer: str | None = turns[-1].get("server") if turns else None
    stopped_by: str | None = None
    failed_reason: str | None = None
    while True:
        state = walk(steps, turns)
        if state.prompt is None:
            stopped_by = state.stopped_by
            break
        i = len(turns)
        if i == 0:
            ids, opens = sample["input_ids"], sample["opens_think"]
        else:
            try:
                if renderer is None:
                    renderer = await asyncio.to_thread(_renderer, d, rc, sample)
                rendered = await asyncio.to_thread(renderer.render, state.prompt)
            except TokenizerFault as exc:
                report.not_started += 1
                report.status = "unauthorized"
                d.tokenizer_fault(str(exc))
                return
            except Exception as exc:  # the template refused the regenerated history: the data, not the worker
                from render.chat import RenderError
                if not isinstance(exc, RenderError):
                    raise
                stopped_by, failed_reason = FAILED, f"turn {i}: {exc}"
                break
            ids, opens = rendered.input_ids, rendered.opens_think
            if (oov := turn_refusal(ids, chunk["conversation"], i)) is not None:  # budget/vocab.py: never sent
                stopped_by, failed_reason = FAILED, oov
                break
            if len(ids) + max_new > chunk["conversation"]["max_context"]:
                stopped_by = CONTEXT
                break
            if d.stopping:
                # A warm stop (or a fault) between turns: leave the conversation between turns in Redis; its
                # chunk ends, the producer re-enqueues it and any worker resumes it at this turn. Waiting for all
                # its turns would hold the worker's shutdown for a whole conversation.
                report.not_started += 1
                return
            verdict = await _admit(d, rc, sid, i, flight, later=max(0, len(steps) - state.steps_done - 1))
            if verdict is TurnAdmit.STOP:
                stopped_by = BUDGET
                break
            if verdict is not TurnAdmit.START:  # no longer this chunk's, or someone else carries it on
                report.skipped += 1
                return
        key = turn_request_key(sid, i)
        turn_sample: SamplePayload = {"id": key, "input_ids": ids, "opens_think": opens}
        try:
            gen = await generate_sample(d.client, d.config, dataset, turn_sample, sampling_params, report,
                                        rid_key=key, prefer=prefer if d.config.affinity else None)
        except GenerateError as err:
            report.errors.append(f"{sid} turn {i}: {err.reason}")
            if err.auth:  # the worker's misconfiguration: given back unfailed, resumed at this turn later
                report.not_started += 1
                report.status = "unauthorized"
                d._config_fault(err)
                return
            if i == 0:  # nothing committed: a failed sample, as a one-turn one (failed.jsonl)
                if await d.batcher.call_until_answered("fail", d.ledger.fail_call(
                        dataset, sid, rc.id, {"id": sid, "reason": err.reason, "status": err.status,
                                              "attempts": err.attempts}, reserved=flight.reserved)):
                    report.failed += 1
                return
            flight.reserved = flight.future = 0  # the chunk's next reservation update drops what it held
            stopped_by, failed_reason = FAILED, f"turn {i}: {err.reason}"
            break
        d.length_models.rates.observe(gen.completion_tokens, time.monotonic() - flight.started)
        parsed = parse_response(dataset, chunk, turn_sample, gen)
        turn = make_turn(response=gen.text, prompt_tokens=gen.prompt_tokens, cached_tokens=gen.cached_tokens,
                         completion_tokens=gen.completion_tokens, finish_reason=gen.finish_reason, prompt_ids=ids,
                         output_ids=gen.output_ids, **parsed)
        turn["server"] = public_url(gen.server)
        outcome = await d.batcher.call_until_answered("commit turn", d.ledger.commit_turn_call(
            dataset, sid, i, gen.completion_tokens, turn, chunk=rc.id, reserved=flight.reserved,
            finish_reason=gen.finish_reason))
        flight.reserved = 0
        if outcome.verdict is TurnVerdict.COMMITTED:
            report.tokens += gen.completion_tokens
            report.late += outcome.late
            turns.append(turn)
        elif outcome.verdict is TurnVerdict.DUPLICATE:
            # Committed already (our own resend after a lost reply, or a zombie's copy): go on from what Redis
            # counted, so the history is always what the budget counted. Empty: the conversation is written.
            report.duplicates += 1
            turns = await in_thread_until_answered("committed turns", d.ledger.committed_turns, dataset, sid)
            if len(turns) <= i:
                return
        else:  # OUT_OF_ORDER: another worker is ahead of us on this conversation
            report.duplicates += 1
            return
        prefer = gen.server
        if outcome.closed_now:
            n = await in_thread_until_answered("discard", d.ledger.discard, dataset, CLOSE_REASON)
            log.info("%s reached its budget (%d tokens): closed, %d queued chunks discarded", dataset, outcome.used, n)
        flight.started = time.monotonic()
    if not turns:
        return
    rec = header(sample_id=sid, dataset=dataset, sent=walk(steps, turns).messages, turns=turns, stopped_by=stopped_by,
                 reasoning_parser=chunk.get("reasoning_parser"), sampling_params=sampling_params,
                 failed_reason=failed_reason, chat_template_kwargs=sample.get("chat_template_kwargs"))
    # How far it went says something of the data (predict's continuation shares) unless the budget or a failure
    # ended it.
    planned = len(steps) if stopped_by not in (BUDGET, FAILED) else 0
    ended = await d.batcher.call_until_answered("end conversation", d.ledger.end_conversation_call(
        dataset, sid, len(turns), rec, planned=planned))
    if ended.verdict is EndVerdict.ENDED:
        report.committed += 1
    elif ended.verdict is EndVerdict.DUPLICATE:
        report.duplicates += 1
    else:
        log.warning("%s/%s: %d turns here, %d committed in Redis: another worker carries the conversation on",
                    dataset, sid, len(turns), ended.tokens)


async def _admit(d: "Dispatcher", rc: RunningChunk, sid: str, turn: int, flight: Flight,
                 later: int) -> TurnAdmit:
    """Ask ``admit_turn`` until it answers something other than FULL (strict: the budget is reserved by requests
    in flight; one of them ending may free room). A START books ``flight.reserved`` for the turn's commit: in
    predict, the turn's expected length plus that of the ``later`` turns the dataset still plans after it, each
    priced by its own turn's model and weighed by the share of conversations that get there (worker/estimate.py
    TurnModels; a conversation that stops sooner frees the rest when it ends)."""
    while True:
        if rc.lost.is_set():
            return TurnAdmit.REVOKED
        reservation = 0
        mode, _model = await d.length_models.model(rc.dataset)
        if mode == "predict":
            models = await d.length_models.turns(rc.dataset)
            flight.future = models.future(turn, turn + 1 + later)
            reservation = models.current(turn, 0.0) + flight.future
        admission = await d.batcher.call_until_answered("admit turn", d.ledger.admit_turn_call(
            rc.dataset, sid, turn, rc.id, reservation))
        if admission.verdict is TurnAdmit.START:
            flight.reserved = admission.reserved
            flight.started = time.monotonic()
            flight.turn = turn
            return admission.verdict
        if admission.verdict is not TurnAdmit.FULL:
            return admission.verdict
        d.ended.clear()
        try:
            await asyncio.wait_for(d.ended.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass
