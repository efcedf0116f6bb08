"""How a record's ``messages`` and ``turns`` make one conversation: which messages each regenerated turn answers,
and the message a regenerated turn becomes in the prompts after it.

One definition for every side that needs it (the worker rendering turn i+1, the export rendering turn i again to
check its digest, the export writing the conversation), because one message of difference between them is a
prompt whose digest no longer matches, or a training row that is not what the model saw. docs/export.md
("Multi-turn records") states the rule; in short:

- A one-turn record answers all of its ``messages`` (what ``--turns last`` and every record before multi-turn
  wrote: they may hold the dataset's own earlier assistant turns, kept as context).
- A record of k > 1 turns holds in ``messages`` only what was sent besides the model's own turns: system, user
  turns and the dataset's tool results spliced after a turn that called tools (never an assistant message). An
  *answer point* is the end of a user message and the end of a run of consecutive tool messages; turn i answers
  the i-th answer point, and the last turn answers the end of ``messages``, so there are exactly k points and
  the last is the end. Turn i's prompt is the messages up to its point with turns 0..i-1 inserted at theirs.
- In a prompt, a regenerated turn is `history_message`: its ``content``, its ``reasoning`` as
  ``reasoning_content`` (when the parser split one) and its parsed ``tool_calls``. The chat template decides what
  of it to render (Qwen3 drops the reasoning of turns before the last user message; a template that keeps
  reasoning renders it).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence


class HistoryError(ValueError):
    """A record whose messages and turns do not interleave (a bug in what wrote it), with a message naming the
    field."""


def history_message(turn: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message a regenerated turn is in the prompt of every later turn."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.get("content") or ""}
    if turn.get("reasoning") is not None:
        message["reasoning_content"] = turn["reasoning"]
    if turn.get("tool_calls"):
        message["tool_calls"] = [dict(call) for call in turn["tool_calls"]]
    return message


def answer_points(messages: Sequence[Mapping[str, Any]], turns: int) -> list[int]:
    """Where each turn goes: the number of ``messages`` before turn i, for every turn (non-decreasing, the last
    = ``len(messages)``). Raises HistoryError when a multi-turn record's messages do not fit its turns."""
    if turns == 1:
        return [len(messages)]
    points = []
    for j, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            raise HistoryError(f"messages[{j}] is an assistant message: a record of {turns} turns holds only what "
                               "was sent besides the model's own turns (system, user, tool)")
        following = messages[j + 1].get("role") if j + 1 < len(messages) else None
        if role == "user" or (role == "tool" and following != "tool"):
            points.append(j + 1)
    if len(points) != turns or not points or points[-1] != len(messages):
        raise HistoryError(f"turns: {turns} turns, but messages has {len(points)} answer points (user messages and "
                           "runs of tool results) ending "
                           f"{'at its end' if points and points[-1] == len(messages) else 'before its end'}")
    return points


def conversation(messages: Sequence[Mapping[str, Any]], answers: Sequence[Mapping[str, Any]],
                 points: Sequence[int], upto: int | None = None) -> list[dict[str, Any]]:
    """``messages`` with ``answers[i]`` (assistant messages, one per turn) inserted at ``points[i]``, for the
    turns before ``upto`` (all when None): turn ``upto``'s prompt, or the whole conversation."""
    count = len(answers) if upto is None else upto
    out: list[dict[str, Any]] = []
    start = 0
    for i in range(count):
        out.extend(dict(m) for m in messages[start:points[i]])
        out.append(dict(answers[i]))
        start = points[i]
    end = len(messages) if upto is None or upto >= len(points) else points[upto]
    out.extend(dict(m) for m in messages[start:end])
    return out


def turn_prompts(messages: Sequence[Mapping[str, Any]],
                 turns: Sequence[Mapping[str, Any]]) -> list[list[dict[str, Any]]]:
    """The messages each turn was rendered from (with ``add_generation_prompt``), in turn order."""
    points = answer_points(messages, len(turns))
    history = [history_message(t) for t in turns]
    return [conversation(messages, history, points, upto=i) for i in range(len(turns))]


class Step:
    """One turn of a conversation to regenerate, as the dataset lays it out: the messages sent before it (a user
    message, or the dataset's tool results after a turn that called tools; the system message and the first user
    message for turn 0) and the names of the tools the dataset's own answer at that point called, in order (empty:
    it called none, or the dataset has no answer there)."""

    __slots__ = ("context", "calls", "after_tools")

    def __init__(self, context: list[dict[str, Any]], calls: list[str], after_tools: bool) -> None:
        self.context = context
        self.calls = calls
        self.after_tools = after_tools  # the context is a run of tool results (spliced only after matching calls)

    def __repr__(self) -> str:
        return f"Step({self.context!r}, calls={self.calls!r}, after_tools={self.after_tools})"


def tool_names(message: Mapping[str, Any]) -> list[str]:
    """The function names an assistant message calls, in order (OpenAI shape: ``function.name``, or ``name``)."""
    names = []
    for call in message.get("tool_calls") or []:
        if not isinstance(call, Mapping):
            continue
        fn = call.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else call.get("name")
        names.append(str(name))
    return names


def plan(messages: Sequence[Mapping[str, Any]]) -> list[Step]:
    """The turns a dataset conversation becomes under ``--turns all``: one Step per answer point of its
    non-assistant messages (the rule of ``answer_points``), each with the dataset's tool calls at that point.
    The dataset's assistant messages are never sent; only their tool-call names are kept, to decide whether the
    dataset's tool results may follow a regenerated turn (docs/multiturn.md)."""
    steps: list[Step] = []
    context: list[dict[str, Any]] = []
    for j, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant":
            if steps:
                steps[-1].calls.extend(tool_names(message))
            continue
        context.append(dict(message))
        following = messages[j + 1].get("role") if j + 1 < len(messages) else None
        if role == "user" or (role == "tool" and following != "tool"):
            steps.append(Step(context, [], after_tools=role == "tool"))
            context = []
    if context and steps:  # messages after the last answer point (none: a record ends with a user or tool turn)
        steps[-1].context.extend(context)
    return steps

