"""What ``produce`` says of its datasets: the progress line it prints while attached, and the summary table it
prints when it ends (``DatasetSummary``, one row a dataset), with each dataset's length distribution below it
(`picture`, which ``produce sample`` draws too; `nearest_rank` is also the manifest's quantile, so the three agree).

The length distribution is a terminal picture: a text histogram of every response's completion tokens, with its
median, p90, p99 and max, and how many were cut at max_new_tokens.

A response is one regenerated turn (one request): its length is what ``--max-tokens`` caps and its
``finish_reason`` says whether the cap cut it, where a multi-turn record's ``completion_tokens`` is a sum over
several. Read from the committed records (``raw_responses.jsonl``), the whole distribution: Redis keeps only the
last 4096 lengths, for predict (budget/keys.py ``lengths``). Bins are powers of two (1, 2-3, 4-7, ... 512-1023):
lengths run from tens to tens of thousands of tokens, and a doubling is what a reader compares with
``--max-tokens``. The responses cut at the cap get a row of their own, last: a tall one says ``--max-tokens`` is
too small.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Mapping, Sequence

from producer.generations import split_key
from producer.ops.status import (
    deadline_projection,
    deadline_total,
    eta_seconds,
    eta_text,
    server_time,
    tokens_per_second,
)
from producer.results import RESULTS, iter_results
from producer.session.attach import DatasetRun

BAR_WIDTH: Final = 24  # characters of the tallest bar
_EIGHTHS: Final = " ▏▎▍▌▋▊▉"  # a partial block, by eighths of a character


@dataclass
class DatasetSummary:
    name: str
    status: str
    done: int
    selected: int
    tokens: int
    budget: int | None
    failed: dict[str, dict[str, Any]]
    not_run: int
    invalid: int
    duplicates: int
    over_context: int
    output: Path
    #: the servers' busy seconds its requests took (stats server_ms, docs/mix.md "Cost in view")
    server_s: float = 0.0


def progress_line(runs: list[DatasetRun], now: float | None = None) -> str:
    """One line for every dataset, printed every ``--progress`` seconds while attached. Its tok/s, eta and
    deadline projection are ``produce status``'s (producer/ops/status.py): from the 10-second token buckets of the
    stats last read."""
    parts = []
    projections: list[tuple[int, int | None]] = []
    now = time.time() if now is None else now
    for d in runs:
        tps = tokens_per_second(d.stats, now)
        deadline, projected = deadline_part(d, tps, now)
        if projected is not None:
            projections.append((projected, d.budget))
        budget = f"{d.used}/{d.budget}" if d.budget is not None else f"{d.used}/unlimited"
        left = d.prepared.selected - len(d.done) - len(d.failed)
        eta_s = eta_seconds(d.budget, d.used, d.status, tps, left * d.used / len(d.done) if d.done else None)
        eta = f" eta {int(eta_s)}s" if eta_s is not None else ""
        state = "done" if d.finished else d.status
        turns = ""
        if d.prepared.conversations or d.turns_committed:  # --turns all: multi-turn conversations' turns
            p = d.prepared
            ended = sum(1 for sid in d.done if p.turns_of(sid) > 1)
            turns = f" conversations {ended}/{p.conversations} turns {d.turns_committed}/{p.conversation_turns}"
        parts.append(f"{d.name}: {state} tokens {budget} samples {len(d.done)}/{d.prepared.selected}{turns} "
                     f"{tps:.0f} tok/s{eta}{deadline}")
    total = deadline_total(projections)
    return " | ".join([*parts, *([total] if total else [])])


def deadline_part(d: DatasetRun, tps: float, now: float) -> tuple[str, int | None]:
    """The progress line's deadline (docs/mix.md): the time left and the tokens projected by then at ``tps``, with
    a warning when that is short of the budget (``deadline_projection``, the projection ``produce status``
    shows), and the projection itself for the line's total; once it passed or closed the dataset, only that
    (and no projection). '' without a deadline."""
    if d.deadline is None:
        return "", None
    if d.closed_by == "deadline":
        return " deadline reached", None
    if d.deadline <= now:
        return " deadline passed", None
    if d.status != "open" or d.finished:
        return "", None
    projected, short = deadline_projection(d.used, d.budget, tps, d.deadline - now)
    warning = f" WARNING short of the budget {d.budget} at this rate" if short else ""
    return f" deadline in {eta_text(d.deadline - now)} projected {projected}{warning}", projected


def summaries(runs: list[DatasetRun], out_dir: Path) -> list[DatasetSummary]:
    """A dataset's row: complete (every selected sample done or failed), budget reached, running (detached: its
    chunks are still out) or incomplete."""
    out = []
    for d in runs:
        p = d.prepared
        closed = d.status == "closed"
        keys = p.keys()
        not_run = sum(1 for k in keys if k not in d.done and k not in d.failed)
        reached = "deadline reached" if d.closed_by == "deadline" else "budget reached"
        status = "complete" if not_run == 0 else (reached if closed else
                                                  ("running (detached)" if d.chunk_samples else "incomplete"))
        out.append(DatasetSummary(
            name=d.name, status=status, done=len(d.done), selected=p.selected, tokens=d.used,
            budget=d.budget, failed=d.failed, not_run=not_run, invalid=len(p.invalid),
            duplicates=len(p.duplicates), over_context=len(p.over_context),
            output=out_dir / d.name / RESULTS, server_s=int(d.stats.get("server_ms", 0) or 0) / 1000))
    return out


def sample_name(key: str) -> str:
    """A sample key as a person reads it: the id, with ``(generation k)`` for k >= 1 (producer/generations.py)."""
    prompt, generation = split_key(key)
    return prompt if generation == 0 else f"{prompt} (generation {generation})"


def _fmt(n: int | None) -> str:
    return "unlimited" if n is None else f"{n:,}"


def summary_table(rows: list[DatasetSummary], detached: bool = False, max_failed: int = 20) -> str:
    head = ("dataset", "status", "done", "selected", "tokens", "budget", "failed", "not run", "invalid",
            "over ctx", "server time")
    body = [(r.name, r.status, f"{r.done:,}", f"{r.selected:,}", f"{r.tokens:,}", _fmt(r.budget),
             f"{len(r.failed):,}", f"{r.not_run:,}", f"{r.invalid:,}", f"{r.over_context:,}",
             server_time(r.server_s)) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if detached:
            continue
        lines.append(f"{r.name}: {r.output}")
        for sid in sorted(r.failed)[:max_failed]:
            lines.append(f"  failed {sample_name(sid)}: {r.failed[sid].get('reason')}")
        if len(r.failed) > max_failed:
            lines.append(f"  ... and {len(r.failed) - max_failed} more in {r.output.parent / 'failed.jsonl'}")
    if detached:
        lines.append("detached: workers run the queued chunks; run the same command without --detach to collect")
    return "\n".join(lines)


def length_pictures(rows: list[DatasetSummary]) -> str:
    """Each dataset's completion lengths (`picture`), read from its results file: what the summary
    ends with, so that a run's end says whether ``--max-tokens`` cut too many answers."""
    return "\n".join(line for r in rows for line in picture(r.name, read_lengths(r.output)))


@dataclass
class Lengths:
    """Every response's completion tokens: those that finished, and those cut at max_new_tokens (``finish_reason``
    "length")."""

    finished: list[int] = field(default_factory=list)
    cut: list[int] = field(default_factory=list)
    max_new_tokens: int | None = None

    @property
    def tokens(self) -> list[int]:
        return self.finished + self.cut

    def add(self, rec: Mapping[str, Any]) -> None:
        """Count a record's turns (a record as written: producer/results.py)."""
        for turn in rec.get("turns") or ():
            (self.cut if turn.get("finish_reason") == "length" else self.finished).append(int(turn["completion_tokens"]))
        cap = (rec.get("sampling_params") or {}).get("max_new_tokens")
        if isinstance(cap, int) and not isinstance(cap, bool):
            self.max_new_tokens = cap


def read_lengths(path: Path) -> Lengths:
    """The lengths of a results file, read as every reader reads it (up to a torn last line); an empty Lengths
    when there is no file yet."""
    lengths = Lengths()
    if path.exists():
        for result in iter_results(path):
            lengths.add(result.record)
    return lengths


def nearest_rank(ordered: Sequence[int], q: float) -> int | None:
    """The q-quantile of sorted ``ordered`` by nearest rank: a length that occurs, no interpolation."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else None


def bar(count: int, top: int, width: int = BAR_WIDTH) -> str:
    """A bar of unicode blocks, ``count / top`` of ``width`` characters, to the eighth; a count above 0 shows
    at least one eighth."""
    eighths = round(count / top * width * 8) if top else 0
    if count and not eighths:
        eighths = 1
    full, part = divmod(eighths, 8)
    return "█" * full + (_EIGHTHS[part] if part else "")


def _bins(tokens: Sequence[int]) -> list[tuple[str, int]]:
    """(label, count) of each power-of-two bin from the shortest length's to the longest's, empty ones included;
    the outer labels are clipped to the lengths that occur."""
    if not tokens:
        return []
    lo, hi = min(tokens), max(tokens)
    counts: dict[int, int] = {}
    for n in tokens:
        counts[n.bit_length()] = counts.get(n.bit_length(), 0) + 1
    rows = []
    for b in range(lo.bit_length(), hi.bit_length() + 1):
        start, end = max(lo, (1 << b) >> 1), min(hi, (1 << b) - 1)
        rows.append((f"{start:,}" if start == end else f"{start:,}-{end:,}", counts.get(b, 0)))
    return rows


def headline(name: str, lengths: Lengths) -> str:
    """The line above the bars: how many responses, the median, p90, p99 and max, and the share cut."""
    ordered = sorted(lengths.tokens)
    if not ordered:
        return f"{name}: no responses yet"
    cap = f" at max_new_tokens {lengths.max_new_tokens:,}" if lengths.max_new_tokens is not None else ""
    cut = f"{len(lengths.cut):,} ({len(lengths.cut) / len(ordered):.1%}) cut{cap}" if lengths.cut else f"none cut{cap}"
    stats = ", ".join(f"{label} {nearest_rank(ordered, q):,}" for label, q in (("median", 0.5), ("p90", 0.9),
                                                                               ("p99", 0.99)))
    return (f"{name}: {len(ordered):,} response{'s' if len(ordered) != 1 else ''}, completion tokens {stats}, "
            f"max {ordered[-1]:,}; {cut}")


def picture(name: str, lengths: Lengths, width: int = BAR_WIDTH) -> list[str]:
    """The headline, then one row per bin of the responses that finished (label, bar, count, share of all
    responses), then a ``cut`` row of those the cap cut, if any."""
    total = len(lengths.finished) + len(lengths.cut)
    rows = _bins(lengths.finished)
    if lengths.cut:
        rows.append(("cut", len(lengths.cut)))
    top = max((count for _label, count in rows), default=0)
    label_w = max((len(label) for label, _count in rows), default=0)
    count_w = max((len(f"{count:,}") for _label, count in rows), default=0)
    lines = [headline(name, lengths)]
    for label, count in rows:
        lines.append(f"  {label:>{label_w}}  {bar(count, top, width):<{width}}  {count:>{count_w},} "
                     f"{count / total:6.1%}")
    return lines
