"""What comes after a regenerated turn: the next turn's prompt messages, or why the conversation ends there.

Pure functions over the dataset's plan (budget/history.py ``plan``) and the turns regenerated so far, so a worker
that resumes a conversation another worker started (its chunk's lease lapsed) walks the same path from the
committed turns alone: the decisions of turns 0..i depend on nothing but those turns and the dataset. In budget/
because both sides walk it: the worker between turns (worker/turns.py), the producer when it ends a started
conversation that can no longer go on (its dataset closed after the worker carrying it died).

The rules (docs/multiturn.md, "Stopping rules"):
- turn i answers step ``at[i]`` of the plan; the next turn answers the next step;
- a turn that calls tools continues with the dataset's tool results only when it calls the same functions, in the
  same order, as the dataset's answer at that step and the dataset's next step is those results; otherwise the
  conversation stops with ``tool_mismatch``. The results' ``tool_call_id`` become the regenerated calls' ids
  (the dataset's ids name calls the model never made);
- a turn without tool calls where the dataset called tools skips the dataset's tool exchange, to the next step
  that is not a run of tool results (those answer calls the model did not make);
- a turn cut by ``max_new_tokens`` (``finish_reason: length``) before the last step stops with ``length``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from budget.history import Step, history_message, tool_names
from budget.record import BUDGET, LENGTH, TOOL_MISMATCH


@dataclass
class Walk:
    """A conversation after its regenerated turns: what was sent besides them (``sent``, the record's
    ``messages``), the next turn's prompt messages (None: it ends), and why it ends early (``stopped_by``)."""

    sent: list[dict[str, Any]]
    prompt: list[dict[str, Any]] | None
    stopped_by: str | None = None
    steps_done: int = 0  # the plan steps answered or skipped so far
    at: list[int] = field(default_factory=list)  # the step each turn answered
    answered: list[dict[str, Any]] = field(default_factory=list)  # ``sent`` up to the last turn's prompt

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The record's ``messages`` if the conversation ends here: what its turns were sent, not the context of a
        next turn that never went out (budget/history.py: a record's last turn answers the end of its messages)."""
        return self.sent if self.prompt is None else self.answered


def _with_call_ids(context: Sequence[Mapping[str, Any]], turn: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The dataset's tool results after ``turn``, their ``tool_call_id`` replaced by the regenerated calls' ids in
    order (a result without the key keeps none)."""
    ids = [call.get("id") for call in turn.get("tool_calls") or []]
    out = []
    k = 0
    for message in context:
        m = dict(message)
        if m.get("role") == "tool" and "tool_call_id" in m and k < len(ids) and ids[k] is not None:
            m["tool_call_id"] = ids[k]
        if m.get("role") == "tool":
            k += 1
        out.append(m)
    return out


def walk(steps: Sequence[Step], turns: Sequence[Mapping[str, Any]]) -> Walk:
    """Replay ``turns`` (the regenerated turns, in order) over the dataset's ``steps``."""
    if not steps:
        raise ValueError("a conversation has at least one step (a user message)")
    sent: list[dict[str, Any]] = [dict(m) for m in steps[0].context]
    history: list[dict[str, Any]] = [dict(m) for m in sent]
    at: list[int] = []
    answered: list[dict[str, Any]] = []
    pos = 0
    for turn in turns:
        at.append(pos)
        history.append(history_message(turn))
        if pos + 1 >= len(steps):  # the dataset's last step: the conversation is over, however this turn ended
            return Walk(sent, None, None, pos + 1, at)
        if turn.get("finish_reason") == "length":
            return Walk(sent, None, LENGTH, pos + 1, at)
        calls = tool_names(turn)
        if calls:
            nxt = steps[pos + 1]
            if calls != steps[pos].calls or not nxt.after_tools:
                return Walk(sent, None, TOOL_MISMATCH, pos + 1, at)
            pos += 1
            context = _with_call_ids(nxt.context, turn)
        else:
            pos += 1
            while pos < len(steps) and steps[pos].after_tools:
                pos += 1  # the dataset's tool results answer calls this turn did not make
            if pos >= len(steps):
                return Walk(sent, None, None, pos, at)
            context = [dict(m) for m in steps[pos].context]
        answered = list(sent)
        sent.extend(context)
        history.extend(context)
    return Walk(sent, history, None, pos, at, answered)


def header(*, sample_id: str, dataset: str, sent: list[dict[str, Any]], turns: Sequence[Mapping[str, Any]],
           stopped_by: str | None, reasoning_parser: str | None, sampling_params: Mapping[str, Any],
           failed_reason: str | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
           tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The record of an ended conversation without its turns (``end_conversation`` adds the committed ones
    verbatim, in order; the collector sums ``completion_tokens``). A conversation that ran to its end is
    incomplete as a one-turn record is: when its last turn was cut or never closed its thinking block."""
    from budget.record import RECORD_VERSION, make_record
    rec = make_record(sample_id=sample_id, dataset=dataset, turns=[dict(t) for t in turns],
                      reasoning_parser=reasoning_parser, sampling_params=sampling_params, messages=sent,
                      chat_template_kwargs=chat_template_kwargs, tools=tools)
    del rec["turns"]
    del rec["completion_tokens"]
    rec["record_version"] = RECORD_VERSION
    if stopped_by is not None:
        rec["incomplete"] = True
        rec["stopped_by"] = stopped_by
    if failed_reason is not None:
        rec["failed_reason"] = failed_reason
    return rec


def end_as_is(ledger: Any, name: str, sample_id: str, messages: Sequence[Mapping[str, Any]], *,
              reasoning_parser: str | None, sampling_params: Mapping[str, Any],
              stopped_by: str = BUDGET, failed_reason: str | None = None,
              chat_template_kwargs: Mapping[str, Any] | None = None,
              tools: Sequence[Mapping[str, Any]] | None = None) -> Any:
    """End a started conversation with the turns it has (``stopped_by`` budget): for one no worker carries any
    more and none may pick up, because its dataset closed after the worker carrying it died (a closed dataset
    starts nothing, and its queued chunks are discarded); or ``failed`` with ``failed_reason`` for one whose
    workers died too often (producer/session/loop.py: a rerun reopens it at the turn it had reached). Its committed turns are counted; this writes them.
    Returns the EndOutcome; MISMATCH means a worker committed a turn meanwhile (it is carried on after all)."""
    from budget.history import plan
    turns = ledger.committed_turns(name, sample_id)
    if not turns:
        return None
    state = walk(plan(messages), turns)
    rec = header(sample_id=sample_id, dataset=name, sent=state.messages, turns=turns,
                 stopped_by=state.stopped_by if state.prompt is None else stopped_by,
                 reasoning_parser=reasoning_parser, sampling_params=sampling_params,
                 failed_reason=failed_reason if state.prompt is not None else None,
                 chat_template_kwargs=chat_template_kwargs, tools=tools)
    return ledger.end_conversation(name, sample_id, len(turns), rec)
