"""The summary table ``produce`` prints when it ends."""
from __future__ import annotations

from producer.generations import split_key
from producer.run import DatasetSummary


def sample_name(key: str) -> str:
    """A sample key as a person reads it: the id, with ``(generation k)`` for k >= 1 (producer/generations.py)."""
    prompt, generation = split_key(key)
    return prompt if generation == 0 else f"{prompt} (generation {generation})"


def _fmt(n: int | None) -> str:
    return "unlimited" if n is None else f"{n:,}"


def summary_table(rows: list[DatasetSummary], detached: bool = False, max_failed: int = 20) -> str:
    head = ("dataset", "status", "done", "selected", "tokens", "budget", "failed", "not run", "invalid",
            "over ctx")
    body = [(r.name, r.status, f"{r.done:,}", f"{r.selected:,}", f"{r.tokens:,}", _fmt(r.budget),
             f"{len(r.failed):,}", f"{r.not_run:,}", f"{r.invalid:,}", f"{r.over_context:,}") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *body)]
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
