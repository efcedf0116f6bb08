"""What ``produce`` says of its datasets: the progress line it prints while attached, and the summary table it
prints when it ends (``DatasetSummary``, one row a dataset), with each dataset's length distribution below it."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer.generations import split_key
from producer.ops.lengths import picture, read_lengths
from producer.ops.status import (
    deadline_projection,
    deadline_total,
    eta_seconds,
    eta_text,
    server_time,
    tokens_per_second,
)
from producer.results import RESULTS
from producer.session.state import DatasetRun


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
    """Each dataset's completion lengths (producer/ops/lengths.py), read from its results file: what the summary
    ends with, so that a run's end says whether ``--max-tokens`` cut too many answers."""
    return "\n".join(line for r in rows for line in picture(r.name, read_lengths(r.output)))
