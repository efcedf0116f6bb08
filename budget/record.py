"""The output record: one line of ``raw_responses.jsonl``, record version 2 (``RECORD_VERSION``).

A record is a conversation with a list of regenerated turns (one per assistant answer the model made):

- record: ``record_version`` (2), ``id``, ``dataset``, ``messages`` (what was sent, the dataset's own assistant
  answer removed), ``tools`` (only on a record whose dataset record had tool definitions: every turn's prompt was
  rendered with them), ``turns``, ``completion_tokens`` (the sum over turns: what the budget counted), ``incomplete``,
  ``stopped_by``, ``reasoning_parser``, ``sampling_params``;
- turn: what SGLang answered (``response``, ``output_ids``, the counts, ``finish_reason``), the worker's parse of it
  (``reasoning``, ``content``, ``reasoning_truncated``, ``reasoning_unclosed``, ``tool_calls``, and
  ``tool_call_errors``: calls that did not parse and stayed text), and
  ``prompt_ids_sha256``: a digest of the prompt ids the turn was generated from, so an export that renders the
  prompt again can prove id by id that it has the ids the model saw, without storing them (docs/export.md has
  the measured sizes: the prompt ids would roughly double a record, the digest costs 86 bytes).

A record of another version is refused where the file is read (producer/results.py ``iter_results``).

Lives in budget/ because both sides build it: the worker the turn and the record without ``messages``
(`worker.trip.result_record`), the producer adds ``messages`` and writes the line (`producer.results`).
"""
from __future__ import annotations

import hashlib
from typing import Any, Final, Mapping, Sequence

import orjson

RECORD_VERSION: Final = 2
RECORD_FIELDS: Final = ("record_version", "id", "dataset", "messages", "turns", "completion_tokens", "incomplete",
                        "stopped_by", "reasoning_parser", "sampling_params")
TURN_FIELDS: Final = ("response", "reasoning", "content", "reasoning_truncated", "reasoning_unclosed",
                      "tool_calls", "tool_call_errors", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason",
                      "prompt_ids_sha256", "output_ids")
#: The one vocabulary of ``stopped_by``: why a record's conversation ended before its planned end (null: it did
#: not), whether it has one turn or many (docs/multiturn.md "Stopping rules").
LENGTH: Final = "length"  # a turn was cut by max_new_tokens (SGLang's finish_reason "length")
REASONING_UNCLOSED: Final = "reasoning_unclosed"  # the model stopped (EOS) inside an unclosed thinking block
BUDGET: Final = "budget"  # the dataset closed before the conversation's next turn
FAILED: Final = "failed"  # a turn's every attempt failed; the record keeps the turns before it
CONTEXT: Final = "context"  # the next turn's prompt leaves no room for a completion
TOOL_MISMATCH: Final = "tool_mismatch"  # the model's tool calls do not match the dataset's tool results
STOPPED_BY: Final = (LENGTH, REASONING_UNCLOSED, BUDGET, FAILED, CONTEXT, TOOL_MISMATCH)


def prompt_digest(ids: Sequence[int]) -> str:
    """sha256 hex of the prompt ids written as decimal numbers joined by commas (``"1,2,3"``): easy to recompute
    in any language, and a different id anywhere gives a different digest.

    That text is orjson's JSON array of the ids without its brackets (ints in decimal, no spaces); the worker takes
    it of every prompt it sends, and ``",".join(map(str, ids))`` cost 6-9x as much (9 µs for 30 ids, 580 µs
    for 3,000 on the bench machine)."""
    return hashlib.sha256(orjson.dumps(ids if isinstance(ids, list) else list(ids),
                                       option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]).hexdigest()


def make_turn(*, response: str, reasoning: str | None, content: str, reasoning_truncated: bool,
              reasoning_unclosed: bool, tool_calls: list[dict[str, Any]], prompt_tokens: int, cached_tokens: int,
              completion_tokens: int, finish_reason: str, prompt_ids: Sequence[int] | None,
              output_ids: list[int] | None, tool_call_errors: int = 0) -> dict[str, Any]:
    """One regenerated turn, fields in TURN_FIELDS order. ``prompt_ids`` are hashed, not stored."""
    return {
        "response": response, "reasoning": reasoning, "content": content,
        "reasoning_truncated": reasoning_truncated, "reasoning_unclosed": reasoning_unclosed,
        "tool_calls": tool_calls, "tool_call_errors": tool_call_errors, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
        "completion_tokens": completion_tokens, "finish_reason": finish_reason,
        "prompt_ids_sha256": prompt_digest(prompt_ids) if prompt_ids is not None else None,
        "output_ids": output_ids,
    }


def make_record(*, sample_id: str, dataset: str, turns: list[dict[str, Any]], reasoning_parser: str | None,
                sampling_params: Mapping[str, Any], messages: Any = None,
                chat_template_kwargs: Mapping[str, Any] | None = None,
                tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """A version 2 record over ``turns``; ``messages`` is filled by the producer when it writes the line.
    ``tools``: the sample's tool definitions, kept after ``messages`` (left out when it has none).
    ``chat_template_kwargs``: what a sample of a ``--template-kwargs-mix`` was rendered with (the field is left
    out otherwise: the run's, in run.json)."""
    incomplete, stopped_by = _ending(turns)
    rec = {
        "record_version": RECORD_VERSION, "id": sample_id, "dataset": dataset, "messages": messages,
        **({"tools": [dict(t) for t in tools]} if tools else {}), "turns": turns, "completion_tokens": sum(int(t["completion_tokens"]) for t in turns),
        "incomplete": incomplete, "stopped_by": stopped_by, "reasoning_parser": reasoning_parser,
        "sampling_params": dict(sampling_params),
    }
    if chat_template_kwargs is not None:
        rec["chat_template_kwargs"] = dict(chat_template_kwargs)
    return rec


def _ending(turns: Sequence[Mapping[str, Any]]) -> tuple[bool, str | None]:
    """(incomplete, stopped_by) from the last turn: a turn cut by max_new_tokens, or stopped inside a thinking
    block it never closed, is not a finished turn, whatever a chat template would make of it."""
    if not turns:
        return True, None
    last = turns[-1]
    if last.get("finish_reason") == "length" or last.get("reasoning_truncated"):
        return True, LENGTH
    if last.get("reasoning_unclosed"):
        return True, REASONING_UNCLOSED
    return False, None


def ordered(rec: Mapping[str, Any]) -> dict[str, Any]:
    """``rec`` with its fields in the documented order, unknown keys after them."""
    out = {k: rec.get(k) for k in RECORD_FIELDS}
    if "generation" in rec:  # beside the id it completes (docs/generations.md)
        out = {**{k: out[k] for k in list(out)[:list(out).index("id") + 1]}, "generation": rec["generation"], **out}
    out.update((k, v) for k, v in rec.items() if k not in out)
    turns = out.get("turns")
    if isinstance(turns, list):
        out["turns"] = [_ordered_turn(t) for t in turns]
    return out


def _ordered_turn(turn: Any) -> Any:
    if not isinstance(turn, dict):
        return turn
    out = {k: turn.get(k) for k in TURN_FIELDS}
    out.update((k, v) for k, v in turn.items() if k not in out)
    return out


def is_truncated(rec: Mapping[str, Any]) -> bool:
    """A record that ``--truncated drop`` leaves out: incomplete (its conversation ended before
    its last user turn, or its last turn is unfinished), or with a turn cut by max_new_tokens or stopped inside
    an unclosed thinking block (a multi-turn record's truncated last turn is not ``incomplete``). A chat template
    would still close such a turn as a finished one."""
    return bool(rec["incomplete"]) or any(
        t.get("finish_reason") == "length" or t.get("reasoning_truncated") or t.get("reasoning_unclosed")
        for t in rec["turns"])
