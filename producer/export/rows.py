"""The rows a conversation export writes: a record's conversation in OpenAI messages or ShareGPT shape, whole
(every regenerated turn in place, the dataset's assistant turns never) or one row per regenerated turn
(``--per-turn``: the history the turn's prompt was rendered from, then the turn). Which messages each turn
answers is budget/history.py's rule; docs/export.md ("Multi-turn records") shows the shapes. Below them: whether
a row trains on exactly what the model generated, rendered as its trainer renders it (`trained_conversations`,
`is_exact`)."""
from __future__ import annotations

from typing import Any, Final, Mapping, Sequence

from budget import history
from producer.export.files import ExportError
from render.chat import Renderer, RenderError

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
    """One message as a ShareGPT turn: ``from``/``value``, every other key kept as it is (``tool_calls``,
    ``reasoning_content``, ``tool_call_id``, ``name``). SpecForge and speculators both read ``from``/``value`` and
    keep ``tool_calls`` on the turn, which the chat template renders as the model wrote them; a null content (a
    turn that only calls tools) is ``""``, which templates render as null."""
    role = message.get("role")
    if role not in SHAREGPT_FROM:
        raise ExportError(f"message role {role!r} has no ShareGPT equivalent")
    content = message.get("content")
    turn: dict[str, Any] = {"from": SHAREGPT_FROM[str(role)], "value": content if isinstance(content, str) else ""}
    turn.update((key, value) for key, value in message.items() if key not in ("role", "content"))
    return turn


def answers(rec: Mapping[str, Any], reasoning_mode: str, think: tuple[str, str]) -> list[dict[str, Any]]:
    """Every regenerated turn as the assistant message the export writes (``--reasoning`` applied)."""
    out = []
    for t in rec["turns"]:
        reasoning = None if reasoning_mode == "drop" else t.get("reasoning")
        out.append(assistant_turn(reasoning, t["content"], reasoning_mode, think, t.get("tool_calls") or ()))
    return out


def _shaped(fmt: str, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    # Both formats under ``conversations``: the only key SpecForge's and speculators' loaders read.
    if fmt == "openai-messages":
        return {"conversations": [dict(m) for m in messages]}
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


# Whether a conversation row trains on exactly what the model generated, rendered the way its trainer renders it.
#
# A row is exact when, for every turn it trains, the trainer's rendering of the row (or of the part it trains that
# turn on) starts with that turn's prompt ids, the ones the worker sent (checked by their digest), followed by the
# server's ``output_ids``: the trainer then supervises the model's own tokens, from the prompt's end. How each
# trainer renders a row (read from their source; tests/e2e/test_trainers.py runs both):
#
# - SpecForge renders a row whole and supervises its assistant spans; with ``train_only_last_turn`` (which
#   ``--for specforge`` rows need: one row per turn) only the last. A whole row (``--whole``) trains every turn on
#   the whole row's rendering, where templates that drop earlier turns' reasoning (Qwen3, GLM-4.5, DeepSeek-R1,
#   Kimi-K2) render the earlier turns without it: not exact.
# - speculators renders every assistant turn on its own prefix (the conversation through that turn) and
#   supervises each: a whole row (``--for speculators``) is exact turn by turn; a per-turn row would train its
#   history's turns again, so that combination is refused (producer/export/writer.py).
#
# Both render without budgetq's ``chat_template_kwargs`` (neither takes them from a row), so the check renders
# without them too; both render with the row's ``tools`` (the record's), so the check renders with them. The check needs the run's tokenizer (``produce export --tokenizer``); producer/export/writer.py counts
# the rows that fail it and leaves them out unless asked (``--inexact keep``).


#: The message keys speculators passes to the template (data_generation/preprocessing.py
#: ``_normalize_conversation``): a tool message's ``name`` is not one of them.
SPECULATORS_KEYS: Final = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content")


def trained_conversations(messages: Sequence[Mapping[str, Any]], written: Sequence[Mapping[str, Any]],
                          past: Sequence[Mapping[str, Any]], points: Sequence[int], *, per_turn: bool,
                          trainer: str | None) -> list[list[tuple[int, list[dict[str, Any]]]]]:
    """For each row a record gives, the turns it trains and the messages its trainer renders for each: a
    per-turn row trains its last turn on the row itself; a whole row trains every turn, on the row (SpecForge)
    or on the conversation through that turn (speculators, and by default), each message with only the keys
    speculators keeps."""
    if trainer == "speculators":
        messages, written = [_speculators(m) for m in messages], [_speculators(m) for m in written]
    if per_turn:
        return [[(i, [*history.conversation(messages, past, points, upto=i), dict(written[i])])]
                for i in range(len(written))]
    if trainer == "specforge":
        whole = history.conversation(messages, written, points)
        return [[(i, whole) for i in range(len(written))]]
    return [[(i, [*history.conversation(messages, written, points, upto=i), dict(written[i])])
             for i in range(len(written))]]


def _speculators(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as speculators gives it to the template: content always (null as ""), the other keys it keeps
    only when they are not empty."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    out.update((k, message[k]) for k in SPECULATORS_KEYS[2:] if message.get(k))
    return out


def is_exact(renderer: Renderer, conversation: list[dict[str, Any]], prompt: list[int],
             output: Sequence[int], tools: Sequence[Mapping[str, Any]] | None = None) -> bool:
    """The trainer's rendering of ``conversation`` (no generation prompt) starts with ``prompt`` + ``output``.
    ``tools``: the record's (the row's ``tools``), which both trainers pass to the chat template with the row
    (SpecForge's parsers: ``apply_chat_template(messages, tools=tools or None)``; speculators: the render
    request's ``tools``), as the prompt was rendered with them."""
    try:
        ids = renderer.render(conversation, tools or None, generation_prompt=False).input_ids
    except RenderError:
        return False
    want = [*prompt, *output]
    return ids[:len(want)] == want
