"""The completion lengths of a dataset as a terminal picture: a text histogram of every response's completion
tokens, with its median, p90, p99 and max, and how many were cut at max_new_tokens.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Mapping, Sequence

from producer.results import iter_results

BAR_WIDTH: Final = 24  # characters of the tallest bar
_EIGHTHS: Final = " ▏▎▍▌▋▊▉"  # a partial block, by eighths of a character


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
