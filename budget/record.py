"""The output record: one line of ``raw_responses.jsonl``, its version 2 shape, and the one reader of version 1.

Version 2 is a conversation with a list of regenerated turns (one today; the multi-turn issue appends more), so
that every reader walks ``turns`` from the first day and nothing has to be reshaped again when there are several:

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

Version 1 records (flat: the turn's fields on the record, no ``record_version``) are still on disk in runs made
before; `as_v2` is the one place that reads them, so resume, counting and export see one shape. Top-level ``id``
and ``completion_tokens`` are the same in both, which is all a resume reads.

Lives in budget/ because both sides build it: the worker the turn and the record without ``messages``
(`worker.trip.result_record`), the producer adds ``messages`` and writes the line (`producer.results`).
"""
from __future__ import annotations

import hashlib
from typing import Any, Final, Iterable, Mapping, Sequence

RECORD_VERSION: Final = 2
RECORD_FIELDS: Final = ("record_version", "id", "dataset", "messages", "turns", "completion_tokens", "incomplete",
                        "stopped_by", "reasoning_parser", "sampling_params")
TURN_FIELDS: Final = ("response", "reasoning", "content", "reasoning_truncated", "reasoning_unclosed",
                      "tool_calls", "tool_call_errors", "prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason",
                      "prompt_ids_sha256", "output_ids")
#: The field order of version 1 records (producer/results.py wrote them in this order).
V1_FIELDS: Final = ("id", "dataset", "messages", "response", "reasoning", "content", "reasoning_truncated",
                    "prompt_tokens", "completion_tokens", "finish_reason", "sampling_params")
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
    in any language, and a different id anywhere gives a different digest."""
    return hashlib.sha256(",".join(map(str, ids)).encode("ascii")).hexdigest()


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


def version(rec: Mapping[str, Any]) -> int:
    """2 for a record with ``record_version: 2``; 1 for a flat record without the key."""
    value = rec.get("record_version", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def as_v2(rec: Mapping[str, Any]) -> dict[str, Any]:
    """The record in the version 2 view. A version 2 record is returned as is (a shallow copy); a version 1
    record becomes one turn holding its flat fields, with what version 1 never kept set to null
    (``output_ids``, ``prompt_ids_sha256``, ``reasoning_parser``) or to what version 1 meant (no tool calls
    parsed, an unclosed block not flagged, ``cached_tokens`` 0). Unknown keys are kept on the record.

    Flat records may also carry ``reasoning_unclosed``, ``tool_calls``, ``tool_call_errors`` and
    ``reasoning_parser``: the reasoning parsers landed a little before version 2 and wrote them flat; they are
    read into the turn (and the record) like the other flat fields."""
    if version(rec) >= 2:
        return dict(rec)
    turn = make_turn(response=rec.get("response", ""), reasoning=rec.get("reasoning"),
                     content=rec.get("content", ""), reasoning_truncated=bool(rec.get("reasoning_truncated")),
                     reasoning_unclosed=bool(rec.get("reasoning_unclosed")),
                     tool_calls=list(rec.get("tool_calls") or []), prompt_tokens=rec.get("prompt_tokens", 0),
                     cached_tokens=0, completion_tokens=rec.get("completion_tokens", 0),
                     finish_reason=rec.get("finish_reason", ""), prompt_ids=None, output_ids=None,
                     tool_call_errors=int(rec.get("tool_call_errors") or 0))
    out = make_record(sample_id=rec.get("id"), dataset=rec.get("dataset", ""),  # type: ignore[arg-type]
                      turns=[turn], reasoning_parser=rec.get("reasoning_parser"),
                      sampling_params=rec.get("sampling_params") or {}, messages=rec.get("messages"))
    out["record_version"] = 1  # what it was read from: a view, not a rewrite
    out["completion_tokens"] = rec.get("completion_tokens", 0)
    read = set(V1_FIELDS) | {"reasoning_unclosed", "tool_calls", "tool_call_errors", "reasoning_parser"}
    out.update((k, v) for k, v in rec.items() if k not in read and k not in out)
    return out


def ordered(rec: Mapping[str, Any]) -> dict[str, Any]:
    """``rec`` with its fields in the documented order (v2 or v1), unknown keys after them."""
    fields: Iterable[str] = RECORD_FIELDS if version(rec) >= 2 else V1_FIELDS
    out = {k: rec.get(k) for k in fields}
    if "generation" in rec:  # beside the id it completes (docs/generations.md); absent in older records
        out = {**{k: out[k] for k in list(out)[:list(out).index("id") + 1]}, "generation": rec["generation"], **out}
    out.update((k, v) for k, v in rec.items() if k not in out)
    turns = out.get("turns")
    if version(rec) >= 2 and isinstance(turns, list):
        out["turns"] = [_ordered_turn(t) for t in turns]
    return out


def _ordered_turn(turn: Any) -> Any:
    if not isinstance(turn, dict):
        return turn
    out = {k: turn.get(k) for k in TURN_FIELDS}
    out.update((k, v) for k, v in turn.items() if k not in out)
    return out
