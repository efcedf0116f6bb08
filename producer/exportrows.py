"""The rows a conversation export writes: a record's conversation in OpenAI messages or ShareGPT shape, whole
(every regenerated turn in place, the dataset's assistant turns never) or one row per regenerated turn
(``--per-turn``: the history the turn's prompt was rendered from, then the turn). Which messages each turn
answers is budget/history.py's rule; docs/export.md ("Multi-turn records") shows the shapes."""
from __future__ import annotations

import json
from typing import Any, Final, Mapping, Sequence

from budget import history
from producer.exportfiles import ExportError

#: OpenAI role -> ShareGPT "from". SpecForge's parser maps human/gpt back and passes system/tool through.
SHAREGPT_FROM: Final = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def is_truncated(rec: Mapping[str, Any]) -> bool:
    """A record (version 2 view) that ``--truncated drop`` leaves out: incomplete (its conversation ended before
    its last user turn, or its last turn is unfinished), or with a turn cut by max_new_tokens or stopped inside
    an unclosed thinking block (a multi-turn record's truncated last turn is not ``incomplete``). A chat template
    would still close such a turn as a finished one."""
    return bool(rec["incomplete"]) or any(
        t.get("finish_reason") == "length" or t.get("reasoning_truncated") or t.get("reasoning_unclosed")
        for t in rec["turns"])


def assistant_turn(reasoning: str | None, content: str, mode: str, think: tuple[str, str],
                    tool_calls: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The regenerated turn. Inline is the shape Qwen3/DeepSeek-R1 templates render and split again. Parsed tool
    calls go in ``tool_calls`` (OpenAI shape), where chat templates render them back as the model wrote them."""
    if mode == "inline" and reasoning is not None:
        start, end = think
        turn: dict[str, Any] = {"role": "assistant", "content": f"{start}\n{reasoning}\n{end}\n\n{content}"}
    else:
        turn = {"role": "assistant", "content": content}
        if mode == "field" and reasoning is not None:
            turn["reasoning_content"] = reasoning
    if tool_calls:
        turn["tool_calls"] = [dict(call) for call in tool_calls]
    return turn


def sharegpt_turn(message: Mapping[str, Any]) -> dict[str, Any]:
    """One prompt message as a ShareGPT turn.

    ShareGPT has no tool_calls: an assistant turn's calls are appended to its text as the JSON list the dataset
    had (one line, keys in the dataset's order), after a newline when there is text. Keys ShareGPT has no place
    for (tool_call_id, name, reasoning_content...) stay on the turn, so nothing the dataset said is lost.
    """
    role = message.get("role")
    if role not in SHAREGPT_FROM:
        raise ExportError(f"message role {role!r} has no ShareGPT equivalent")
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    tool_calls = message.get("tool_calls")
    rendered = bool(tool_calls)
    if rendered:
        text = (text + "\n" if text else "") + json.dumps(tool_calls, ensure_ascii=False)
    turn: dict[str, Any] = {"from": SHAREGPT_FROM[str(role)], "value": text}
    skip = {"role", "content", "tool_calls"} if rendered else {"role", "content"}
    turn.update((key, value) for key, value in message.items() if key not in skip)
    return turn



def answers(rec: Mapping[str, Any], reasoning_mode: str, think: tuple[str, str]) -> list[dict[str, Any]]:
    """Every regenerated turn as the assistant message the export writes (``--reasoning`` applied)."""
    out = []
    for t in rec["turns"]:
        reasoning = None if reasoning_mode == "drop" else t.get("reasoning")
        out.append(assistant_turn(reasoning, t["content"], reasoning_mode, think, t.get("tool_calls") or ()))
    return out


def _shaped(fmt: str, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    if fmt == "openai-messages":
        return {"messages": [dict(m) for m in messages]}
    return {"conversations": [sharegpt_turn(m) for m in messages]}


def generation(rec: Mapping[str, Any]) -> dict[str, int]:
    """A row's ``generation`` (docs/generations.md), after its ``id``: the record's; none for a record
    without one."""
    return {"generation": int(rec["generation"])} if "generation" in rec else {}


def template_kwargs(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A row's ``chat_template_kwargs``: the record's own, which a --template-kwargs-mix drew for it (a trainer
    renders the row with them, e.g. gpt-oss's reasoning_effort); none for every other record (the run's)."""
    kwargs = rec.get("chat_template_kwargs")
    return {"chat_template_kwargs": kwargs} if kwargs is not None else {}


def record_tools(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A row's ``tools``: the tool definitions its prompts were rendered with (a trainer renders the row with
    them too); none for a record without any."""
    tools = rec.get("tools")
    return {"tools": tools} if tools else {}


def conversation_row(rec: Mapping[str, Any], fmt: str, reasoning_mode: str, think: tuple[str, str],
                     points: Sequence[int]) -> dict[str, Any]:
    """One conversation: the record's messages with every regenerated turn at its answer point (a one-turn
    record: the messages, then the turn)."""
    out: dict[str, Any] = {"id": rec["id"], **generation(rec)}
    out.update(_shaped(fmt, history.conversation(rec["messages"], answers(rec, reasoning_mode, think), points)))
    out.update(template_kwargs(rec))
    out.update(record_tools(rec))
    if is_truncated(rec):
        out["truncated"] = True
    return out


def turn_rows(rec: Mapping[str, Any], fmt: str, reasoning_mode: str, think: tuple[str, str],
              points: Sequence[int]) -> list[dict[str, Any]]:
    """``--per-turn``: one row per regenerated turn, its history exactly the messages its prompt was rendered
    from (earlier turns as budget.history.history_message: the template decides what of them it renders, as it
    did for the prompt), then the turn itself as the answer, ``--reasoning`` applied to it alone."""
    written = answers(rec, reasoning_mode, think)
    past = [history.history_message(t) for t in rec["turns"]]
    rows = []
    for i, answer in enumerate(written):
        row: dict[str, Any] = {"id": rec["id"], **generation(rec), "turn": i}
        row.update(_shaped(fmt, [*history.conversation(rec["messages"], past, points, upto=i), answer]))
        row.update(template_kwargs(rec))
        row.update(record_tools(rec))
        if is_truncated(rec):
            row["truncated"] = True
        rows.append(row)
    return rows
