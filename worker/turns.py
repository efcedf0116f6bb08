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

Later turns are rendered here, in a thread, with the run's tokenizer files from Redis (`renderer_for`, below):
transformers is imported on the first such turn, never in a single-turn run. A worker that resumes a conversation
another one started renders its history from the committed turns in Redis, never from memory.

The run's Renderer (`renderer_for(client, fingerprint, ...)`, docs/multiturn.md "Where rendering happens")
fetches ``bq:tok:{fingerprint}`` (budget/runstate.py), writes the files to ``$TMPDIR/budgetq-tok/{fingerprint}/``
(render/tokfiles.py: a temporary directory renamed into place; reused when present), loads them with transformers
offline (render/chat.py ``load_tokenizer``, ``local_files_only``), builds the Renderer with the run's
chat_template_kwargs and checks that its fingerprint is the one asked for. One Renderer per process per
(fingerprint, markers), built once: loading costs about a second. Every failure there is a `TokenizerFault`, a
fault of this worker's configuration or of the run's setup (no files in Redis, files that give another
fingerprint, a cache directory it may not trust), never of the samples: the caller gives the chunk back, as for a
refused API key, and no sample is failed for it. A fingerprint mismatch is `TokenizerMismatch`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from budget import runstate
from budget.ledger import EndVerdict, TurnAdmit, TurnVerdict
from budget.record import (
    BUDGET,
    CONTEXT,
    FAILED,
    SamplePayload,
    Walk,
    header,
    make_turn,
    plan,
    sampling_params_of,
    turn_request_key,
    walk,
)
from budget.serverinfo import public_url, turn_refusal
from render import RenderError
from worker.batch import in_thread_until_answered
from worker.sglang import Flight, GenerateError, Generation, RequestContext, RunningChunk, parse_response

if TYPE_CHECKING:
    import redis

    from render.chat import Renderer

log = logging.getLogger("budgetq.worker")


@dataclass(frozen=True)
class _End:
    """How a conversation ends on this worker: its record says ``stopped_by`` (and ``failed_reason``)."""

    stopped_by: str | None
    failed_reason: str | None = None


@dataclass(frozen=True)
class _Prompt:
    """A turn's prompt, rendered and admitted."""

    input_ids: list[int]
    opens_think: bool


def _renderer(client: "redis.Redis", rc: RunningChunk, sample: SamplePayload) -> "Renderer":
    """The run's Renderer, or with a template kwargs mix the sample's (its own kwargs and fingerprint; the
    tokenizer files are the run's, stored under the conversation block's fingerprint)."""
    from render.chat import ThinkMarkers
    conv = rc.chunk["conversation"]
    markers = conv.get("open_markers")
    kwargs = sample.get("chat_template_kwargs")
    fingerprint = sample.get("tokenizer") if kwargs is not None else None
    return renderer_for(client, fingerprint or conv["tokenizer"], files=conv["tokenizer"],
                        chat_template_kwargs=kwargs if fingerprint else conv.get("chat_template_kwargs") or {},
                        opens_markers=ThinkMarkers(markers[0], markers[1]) if markers else None)


async def run_conversation(ctx: RequestContext, rc: RunningChunk, sample: SamplePayload, flight: Flight,
                           resumed: bool) -> None:
    """Carry conversation ``sample`` to its end (or until it is no longer this chunk's). ``resumed``: it has
    committed turns already (another worker started it); its turn 0 was not admitted with the chunk."""
    conversation = _Conversation(ctx, rc, sample, flight)
    if resumed:
        await conversation.reload_turns()
    end = await conversation.take_turns()
    if end is not None and conversation.turns:
        await conversation.end(end)


class _Conversation:
    """One conversation on this worker, from its first turn here to its end: the turns it has (the committed
    ones, in order), the server of the last one, and the renderer of its later turns."""

    def __init__(self, ctx: RequestContext, rc: RunningChunk, sample: SamplePayload, flight: Flight) -> None:
        self.ctx, self.rc, self.sample, self.flight = ctx, rc, sample, flight
        self.sid = sample["id"]
        self.sampling_params = sampling_params_of(rc.chunk, sample)  # the generation's override, for every turn
        self.steps = plan(sample["messages"])
        self.turns: list[dict[str, Any]] = []
        self.renderer: "Renderer | None" = None
        self.prefer: str | None = None  # the server of the last turn (SGLangClient.pick_server)

    async def reload_turns(self) -> None:
        """The turns Redis holds committed: the history is always what the budget counted."""
        self.turns = await in_thread_until_answered("committed turns", self.ctx.ledger.committed_turns,
                                                    self.rc.dataset, self.sid)
        self.prefer = self.turns[-1].get("server") if self.turns else None

    async def take_turns(self) -> _End | None:
        """Turn after turn, each committed before the next is rendered, until the conversation ends here (how)
        or leaves this worker (None: given back, no longer this chunk's, or carried on by another worker;
        nothing more is written here). Each step below answers so: go on (a prompt, a generation, True), end
        here (_End) or leave (None, False)."""
        while True:
            state = walk(self.steps, self.turns)
            if state.prompt is None:
                return _End(state.stopped_by)
            i = len(self.turns)
            prompt = _Prompt(self.sample["input_ids"], self.sample["opens_think"]) if i == 0 else \
                await self._next_prompt(state, i)
            if not isinstance(prompt, _Prompt):
                return prompt
            request: SamplePayload = {"id": turn_request_key(self.sid, i), "input_ids": prompt.input_ids,
                                      "opens_think": prompt.opens_think}
            gen = await self._generate(i, request)
            if not isinstance(gen, Generation):
                return gen
            if not await self._commit(i, request, gen):
                return None
            self.flight.started = time.monotonic()

    async def _next_prompt(self, state: Walk, i: int) -> "_Prompt | _End | None":
        """Turn ``i`` > 0: rendered from the history, then admitted (``admit_turn``)."""
        prompt = await self._render(state, i)
        if not isinstance(prompt, _Prompt):
            return prompt
        if (oov := turn_refusal(prompt.input_ids, self.rc.chunk["conversation"], i)) is not None:
            return _End(FAILED, oov)  # budget/serverinfo.py: an id the model cannot take is never sent
        max_new = int(self.sampling_params["max_new_tokens"])
        if len(prompt.input_ids) + max_new > self.rc.chunk["conversation"]["max_context"]:
            return _End(CONTEXT)
        if self.ctx.stopping:
            # A warm stop (or a fault) between turns: leave the conversation between turns in Redis; its
            # chunk ends, the producer re-enqueues it and any worker resumes it at this turn. Waiting for all
            # its turns would hold the worker's shutdown for a whole conversation.
            self.rc.report.not_started += 1
            return None
        verdict = await _admit(self.ctx, self.rc, self.sid, i, self.flight,
                               later=max(0, len(self.steps) - state.steps_done - 1))
        if verdict is TurnAdmit.STOP:
            return _End(BUDGET)
        if verdict is not TurnAdmit.START:  # no longer this chunk's, or someone else carries it on
            self.rc.report.skipped += 1
            return None
        return prompt

    async def _render(self, state: Walk, i: int) -> "_Prompt | _End | None":
        """Turn ``i``'s prompt ids, rendered in a thread (the first one loads the run's tokenizer)."""
        assert state.prompt is not None
        try:
            if self.renderer is None:
                self.renderer = await asyncio.to_thread(_renderer, self.ctx.ledger.r, self.rc, self.sample)
            rendered = await asyncio.to_thread(self.renderer.render, state.prompt, self.sample.get("tools"))
        except TokenizerFault as exc:
            self.ctx.tokenizer_fault(self.rc, str(exc))
            return None
        except RenderError as exc:  # the template refused the regenerated history: the data, not the worker
            return _End(FAILED, f"turn {i}: {exc}")
        return _Prompt(rendered.input_ids, rendered.opens_think)

    async def _generate(self, i: int, request: SamplePayload) -> "Generation | _End | None":
        """Turn ``i``'s generation. Given up on turn 0 (nothing committed), the conversation is a failed sample,
        as a one-turn one (failed.jsonl); on a later turn it ends FAILED with the turns it has."""
        got = await self.ctx.generate(self.rc, self.flight, request, self.sampling_params,
                                      label=f"{self.sid} turn {i}", rid_key=request["id"],
                                      prefer=self.prefer if self.ctx.config.affinity else None)
        if not isinstance(got, GenerateError):
            return got
        if i == 0:
            await self.ctx.fail(self.rc, self.flight, self.sid, got)
            return None
        self.flight.reserved = self.flight.future = 0  # the chunk's next reservation update drops what it held
        return _End(FAILED, f"turn {i}: {got.reason}")

    async def _commit(self, i: int, request: SamplePayload, gen: Generation) -> bool:
        """Commit turn ``i`` (``commit_turn``, once per (sample, turn)); False: the conversation leaves here."""
        rc = self.rc
        parsed = parse_response(rc.dataset, rc.chunk, request, gen)
        turn = make_turn(response=gen.text, prompt_tokens=gen.prompt_tokens, cached_tokens=gen.cached_tokens,
                         completion_tokens=gen.completion_tokens, finish_reason=gen.finish_reason,
                         prompt_ids=request["input_ids"], output_ids=gen.output_ids, **parsed)
        turn["server"] = public_url(gen.server)
        outcome = await self.ctx.batcher.call_until_answered("commit turn", self.ctx.ledger.commit_turn_call(
            rc.dataset, self.sid, i, gen.completion_tokens, turn, chunk=rc.id, reserved=self.flight.reserved,
            finish_reason=gen.finish_reason))
        self.flight.reserved = 0
        if outcome.verdict is TurnVerdict.COMMITTED:
            rc.report.tokens += gen.completion_tokens
            rc.report.late += outcome.late
            self.turns.append(turn)
        elif outcome.verdict is TurnVerdict.DUPLICATE:
            # Committed already (our own resend after a lost reply, or a zombie's copy): go on from what Redis
            # counted, so the history is always what the budget counted. Empty: the conversation is written.
            rc.report.duplicates += 1
            await self.reload_turns()
            if len(self.turns) <= i:
                return False
        else:  # OUT_OF_ORDER: another worker is ahead of us on this conversation
            rc.report.duplicates += 1
            return False
        self.prefer = gen.server
        await self.ctx.after_commit(rc.dataset, outcome.closed_now, outcome.used)
        return True

    async def end(self, end: _End) -> None:
        """Move the committed turns into one record on the results stream (``end_conversation``, once)."""
        rc, sample = self.rc, self.sample
        rec = header(sample_id=self.sid, dataset=rc.dataset, sent=walk(self.steps, self.turns).messages,
                     turns=self.turns, stopped_by=end.stopped_by, reasoning_parser=rc.chunk.get("reasoning_parser"),
                     sampling_params=self.sampling_params, failed_reason=end.failed_reason,
                     chat_template_kwargs=sample.get("chat_template_kwargs"), tools=sample.get("tools"))
        # How far it went says something of the data (predict's continuation shares) unless the budget or a failure
        # ended it.
        planned = len(self.steps) if end.stopped_by not in (BUDGET, FAILED) else 0
        ended = await self.ctx.batcher.call_until_answered("end conversation", self.ctx.ledger.end_conversation_call(
            rc.dataset, self.sid, len(self.turns), rec, planned=planned))
        if ended.verdict is EndVerdict.ENDED:
            rc.report.committed += 1
        elif ended.verdict is EndVerdict.DUPLICATE:
            rc.report.duplicates += 1
        else:
            log.warning("%s/%s: %d turns here, %d committed in Redis: another worker carries the conversation on",
                        rc.dataset, self.sid, len(self.turns), ended.tokens)


async def _admit(ctx: RequestContext, rc: RunningChunk, sid: str, turn: int, flight: Flight,
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
        mode, model = await ctx.length_models.model(rc.dataset)
        if mode == "predict":
            models = await ctx.length_models.turns(rc.dataset)
            flight.future = models.future(turn, turn + 1 + later)
            reservation = models.current(turn, 0.0) + flight.future
            model = models.model(turn)
        admission = await ctx.batcher.call_until_answered("admit turn", ctx.ledger.admit_turn_call(
            rc.dataset, sid, turn, rc.id, reservation, duration_ms=ctx.length_models.deadline_ms(model)))
        if admission.verdict is TurnAdmit.START:
            flight.reserved = admission.reserved
            flight.started = time.monotonic()
            flight.turn = turn
            return admission.verdict
        if admission.verdict is not TurnAdmit.FULL:
            return admission.verdict
        await ctx.wait_for_room()


# -- the run's Renderer on a GPU worker, from the tokenizer files in Redis ------------------------------

if TYPE_CHECKING:
    import redis

    from render.chat import Renderer, ThinkMarkers


#: Under the temporary directory ($TMPDIR, else /tmp): one subdirectory per fingerprint.
CACHE_DIR_NAME = "budgetq-tok"


class TokenizerFault(Exception):
    """This worker cannot render the run's conversations: a configuration fault (give the chunk back)."""


class TokenizerMismatch(TokenizerFault):
    """The files from Redis load into a tokenizer whose fingerprint is not the run's."""


_lock = threading.Lock()
_renderers: dict[tuple[str, str], "Renderer"] = {}


def cache_root() -> Path:
    """``$TMPDIR/budgetq-tok``, created private (0700). Refused when it is not ours: in a shared /tmp another user
    could have made it, and what is loaded from it must be the run's files."""
    root = Path(tempfile.gettempdir()) / CACHE_DIR_NAME
    root.mkdir(mode=0o700, exist_ok=True)
    st = root.lstat()
    if root.is_symlink() or not root.is_dir() or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise TokenizerFault(f"{root}: not a directory this worker owns and alone may write; remove it or point "
                             "TMPDIR elsewhere")
    return root


def renderer_for(client: "redis.Redis", fingerprint: str, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                 opens_markers: "ThinkMarkers | None" = None, root: Path | None = None,
                 files: str | None = None) -> "Renderer":
    """The Renderer of the run whose settings say ``tokenizer: fingerprint`` (and these chat_template_kwargs;
    ``opens_markers`` as the producer's, for a parser with markers of its own). ``files``: the fingerprint the
    tokenizer files are stored under, when it is not ``fingerprint`` (a sample of a template kwargs mix renders
    with the run's files and kwargs of its own). Raises TokenizerFault."""
    markers = "" if opens_markers is None else json.dumps([opens_markers.start, opens_markers.end])
    with _lock:  # rendering runs in threads; one load per fingerprint, whoever asks first
        cached = _renderers.get((fingerprint, markers))
        if cached is None:
            cached = _build(client, fingerprint, chat_template_kwargs, opens_markers, root or cache_root(),
                            files or fingerprint)
            _renderers[(fingerprint, markers)] = cached
        return cached


def _build(client: "redis.Redis", fingerprint: str, kwargs: Mapping[str, Any] | None,
           opens_markers: "ThinkMarkers | None", root: Path, files_key: str) -> "Renderer":
    from render import tokfiles
    try:
        directory = root / files_key
        if directory.is_dir():
            try:
                return _load(directory, fingerprint, kwargs, opens_markers)
            except TokenizerFault as exc:  # a stale or damaged local copy: Redis holds the run's files
                log.warning("tokenizer cache %s is not usable (%s): fetching it again", directory, exc)
                tokfiles.discard(directory)
        files = runstate.fetch_files(client, files_key)
        if not files:
            raise TokenizerFault(f"Redis holds no tokenizer files for fingerprint {files_key[:12]} "
                                 "(the run's produce has not stored them)")
        tokfiles.unpack(files, directory)
        renderer = _load(directory, fingerprint, kwargs, opens_markers)
    except (tokfiles.TokenizerFilesError, runstate.TokenizerStoreError, ValueError, OSError) as exc:
        raise TokenizerFault(f"tokenizer {fingerprint[:12]}: {exc}") from exc
    log.info("tokenizer %s loaded from Redis into %s", fingerprint[:12], directory)
    return renderer


def _load(directory: Path, fingerprint: str, kwargs: Mapping[str, Any] | None,
          opens_markers: "ThinkMarkers | None") -> "Renderer":
    from render.chat import Renderer, RenderError, load_tokenizer
    try:
        renderer = Renderer(load_tokenizer(directory), chat_template_kwargs=kwargs, opens_markers=opens_markers)
    except RenderError as exc:
        raise TokenizerFault(str(exc)) from exc
    got = renderer.fingerprint()
    if got != fingerprint:
        raise TokenizerMismatch(f"the tokenizer files in {directory} give fingerprint {got[:12]}, not the run's "
                                f"{fingerprint[:12]}: another tokenizer, template or chat_template_kwargs")
    return renderer


def forget() -> None:
    """Drop the loaded Renderers (tests)."""
    with _lock:
        _renderers.clear()
