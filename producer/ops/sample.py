"""``produce sample``: a few committed records of a dataset, shown to a person, read-only, while the run goes or
after it.

It reads ``OUT/<dataset>/raw_responses.jsonl`` as every reader does (producer/results.py ``iter_results``: up to a
torn last line, which the collector may be writing), and nothing else: no Redis, no write. The records are a
uniform random pick of those committed so far (reservoir sampling, one pass, N records in memory), not the
latest: the file is in commit order, so its tail is one moment of the run (the answers that finished together,
from the same few chunks; soon after the start the short ones, at the end the longest), where a random pick
spreads over all of it. ``--latest`` shows the tail, for what is arriving now.
"""
from __future__ import annotations

import random
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from producer.errors import UsageError
from producer.generations import record_key
from producer.inputs.reader import valid_name
from producer.ops.status import Lengths, picture, sample_name
from producer.results import RESULTS, RUN, ReadEnd, Result, iter_results


def results_of(out_dir: Path, name: str) -> Path:
    """``OUT/<name>/raw_responses.jsonl``, of a dataset's output folder (one with the run.json its run wrote at
    attach: the results file may not exist yet), or a UsageError naming the datasets that ``out_dir`` has."""
    path = out_dir / name
    if valid_name(name) and (path / RUN).is_file():
        return path / RESULTS
    found = [p.parent.name for p in sorted(out_dir.glob(f"*/{RUN}")) if valid_name(p.parent.name)] \
        if out_dir.is_dir() else []
    raise UsageError(f"no dataset {name!r} in {out_dir} (it has: {', '.join(found) or 'none'})")


@dataclass
class Picked:
    """The records chosen (in file order), how many were read, why reading stopped, and every response's length."""

    results: list[Result]
    read: int
    end: ReadEnd
    lengths: Lengths = field(default_factory=Lengths)


def pick(path: Path, count: int, seed: int | None = None, latest: bool = False) -> Picked:
    """``count`` records of the results file at ``path``: a uniform random pick (seeded: the same seed over the same
    records picks the same), or the last ones (``latest``); and the lengths of all of them. No file yet: none."""
    rng = random.Random(seed)
    chosen: list[Result] | deque[Result] = deque(maxlen=count) if latest else []
    end, lengths, read = ReadEnd(), Lengths(), 0
    if path.exists():
        for result in iter_results(path, end):
            lengths.add(result.record)
            if latest or len(chosen) < count:
                chosen.append(result)
            else:  # Algorithm R: the record replaces a kept one with probability count / (read + 1)
                slot = rng.randrange(read + 1)
                if slot < count:
                    chosen[slot] = result
            read += 1
    return Picked(sorted(chosen, key=lambda x: x.number), read, end, lengths)


def shorten(text: str, chars: int) -> str:
    """``text`` on one line (runs of whitespace made one space), cut after ``chars`` characters with how many
    more there were; ``chars`` 0: the whole text as it is."""
    if chars == 0:
        return text
    flat = re.sub(r"\s+", " ", text).strip()
    return flat if len(flat) <= chars else f"{flat[:chars].rstrip()}… (+{len(flat) - chars:,} chars)"


def _last_user(messages: Any) -> tuple[str, int]:
    """The text of the last user message and how many user messages there are."""
    users = [m for m in messages or () if isinstance(m, Mapping) and m.get("role") == "user"]
    if not users:
        return "", 0
    content = users[-1].get("content")
    if isinstance(content, list):  # OpenAI content parts: their text
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content or ""), len(users)


def _field(label: str, text: str | None, chars: int) -> str:
    if not text:
        return f"    {label}: (none)"
    body = shorten(text, chars)
    if chars == 0:
        body = body.replace("\n", "\n      ")
    return f"    {label} ({len(text):,} chars): {body}"


def show(result: Result, chars: int) -> list[str]:
    """One record as a person reads it: a rule naming it, the prompt's last user turn, then each turn's
    reasoning, content, tool calls, completion tokens and finish reason."""
    rec = result.record
    turns = rec.get("turns") or []
    stopped = f" · stopped by {rec['stopped_by']}" if rec.get("stopped_by") else ""
    lines = [f"── {sample_name(record_key(rec))} · line {result.number} · {len(turns)} turn"
             f"{'s' if len(turns) != 1 else ''} · {result.tokens:,} completion tokens{stopped}"]
    text, users = _last_user(rec.get("messages"))
    of = f" (last of {users})" if users > 1 else ""
    lines.append(f"  user{of}: {shorten(text, chars) or '(none)'}")
    for i, turn in enumerate(turns, 1):
        lines.append(f"  turn {i}: {int(turn.get('completion_tokens') or 0):,} tokens, finish "
                     f"{turn.get('finish_reason')}" + (", reasoning cut" if turn.get("reasoning_truncated") else ""))
        lines.append(_field("reasoning", turn.get("reasoning"), chars))
        lines.append(_field("content", turn.get("content"), chars))
        for call in turn.get("tool_calls") or ():
            function = call.get("function") or {}
            lines.append(f"    tool call: {function.get('name')}({shorten(str(function.get('arguments', '')), chars)})")
        if turn.get("tool_call_errors"):
            lines.append(f"    {turn['tool_call_errors']} tool call(s) did not parse (left in the content)")
    return lines


def report(name: str, path: Path, picked: Picked, chars: int) -> str:
    """The records shown, then a line saying what was read."""
    lines = [line for result in picked.results for line in show(result, chars)]
    how = f"{len(picked.results)} of {picked.read:,} records" if picked.results else f"{picked.read:,} records"
    note = ""
    if picked.end.torn:
        note = "; the last line is being written (or was torn by a crash), not read"
    elif picked.end.bad_line is not None:
        note = f"; line {picked.end.bad_line} is not a record, nothing after it read"
    if lines:
        lines.append("")
    lines += [f"{how} of {path}{note}", *picture(name, picked.lengths)]
    return "\n".join(lines)
