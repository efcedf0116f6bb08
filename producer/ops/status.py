"""What every dataset is doing, told three ways: ``produce status`` (read-only, from any machine that reaches
Redis), and ``produce budget``, the one change made from there: a dataset's budget, while it runs; ``produce``'s
own progress line while attached and its summary table when it ends (`DatasetSummary`, one row a dataset, below
the status), with each dataset's length distribution (`picture`, which ``produce sample`` draws too;
`nearest_rank` is also the manifest's quantile, so the three agree). One module, so the progress line's tok/s and
deadline projection are the status's own.

The length distribution is a terminal picture: a text histogram of every response's completion tokens, with its
median, p90, p99 and max, and how many were cut at max_new_tokens. A response is one regenerated turn (one
request): its length is what ``--max-tokens`` caps and its ``finish_reason`` says whether the cap cut it, where a
multi-turn record's ``completion_tokens`` is a sum over several. Read from the committed records
(``raw_responses.jsonl``), the whole distribution: Redis keeps only the last 4096 lengths, for predict
(budget/keys.py ``lengths``). Bins are powers of two (1, 2-3, 4-7, ... 512-1023): lengths run from tens to tens of
thousands of tokens, and a doubling is what a reader compares with ``--max-tokens``. The responses cut at the cap
get a row of their own, last: a tall one says ``--max-tokens`` is too small.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Mapping, Sequence

import redis

from budget import serverinfo
from budget.ledger import DatasetState, Ledger, Mix, MixStore, mix_id
from budget.runstate import RunState
from producer.errors import UsageError
from producer.generations import split_key
from producer.results import RESULTS, iter_results
from producer.settings import parse_amount, parse_mix

if TYPE_CHECKING:
    from producer.session.attach import DatasetRun

RATE_WINDOW_S = 60  # tokens/s over the last minute of 10-second buckets


@dataclass(frozen=True)
class DatasetStatus:
    name: str
    mode: str
    status: str
    budget: int | None
    used: int
    reserved: int
    in_flight: int
    done: int
    failed: int
    selected: int | None
    not_run: int  # samples a closed dataset will not run (its budget was reached): the summary's "not run"
    discarded_chunks: int
    queued_chunks: int
    tokens_per_s: float
    eta_s: float | None  # to the budget or to the dataset's last sample, whichever comes first
    finish_stop: int
    finish_length: int
    truncation_rate: float | None
    mean_completion: float | None
    late: int
    unwritten: int
    #: --turns all: turns of multi-turn conversations committed (commit_turn), conversations ended
    #: (end_conversation), conversations started and not ended (still in Redis); 0 for a single-turn run.
    turns: int = 0
    conversations: int = 0
    conversations_open: int = 0
    #: seconds the dataset's requests ran, start to answer, summed (finish_chunk's stats request_ms)
    request_s: float = 0.0
    #: the servers' busy seconds its requests took, each charged dt / N while N ran at its server (stats
    #: server_ms, docs/mix.md "Cost in view"): what it cost, in server time (x a server's GPUs for GPU time)
    server_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def tokens_per_second(stats: dict[str, str], now: float | None = None) -> float:
    """The one tok/s of budgetq (``produce status``, its metrics and ``produce``'s progress line): completion tokens
    committed per second, from the commit scripts' 10-second token buckets in the stats hash, over the full buckets
    of the last minute, the running bucket excluded. The span starts at the first of those buckets with tokens: a
    run that started (or resumed) 20 s ago reads its rate over those 20 s, not a third of it over a minute, and its
    eta is not three times too long. Every process reads the same figure, and it survives a reattach."""
    now = time.time() if now is None else now
    current = int(now // 10)
    window = {int(k[2:]): int(v) for k, v in stats.items()
              if k.startswith("t:") and current - RATE_WINDOW_S // 10 <= int(k[2:]) < current and int(v) > 0}
    if not window:
        return 0.0
    return sum(window.values()) / (10 * (current - min(window)))


def eta_seconds(budget: int | None, used: int, status: str, tps: float,
                left_tokens: float | None = None) -> float | None:
    """Seconds until the dataset ends at ``tps``: until ``used`` reaches the budget, or until its samples left
    (``left_tokens``, their expected tokens) are done, whichever comes first. None when it is not open, the
    rate is 0, or neither end is known (unlimited, and no sample has finished to price the rest)."""
    if status != "open" or tps <= 0:
        return None
    ends = [max(0.0, budget - used)] if budget is not None else []
    if left_tokens is not None:
        ends.append(max(0.0, left_tokens))
    return min(ends) / tps if ends else None


def deadline_projection(used: int, budget: int | None, tps: float, seconds_left: float) -> tuple[int, bool]:
    """The tokens a dataset is projected to have by its deadline, ``seconds_left`` from now, at ``tps`` (capped at
    its budget), and whether that is short of the budget: what ``produce status`` and ``produce``'s progress line
    both show (docs/mix.md). A linear projection at the current rate: it does not know that admission stops a
    request's expected duration before the deadline."""
    projected = used + round(tps * max(0.0, seconds_left))
    if budget is not None:
        projected = min(projected, budget)
    return projected, budget is not None and projected < budget


def deadline_total(projections: list[tuple[int, int | None]]) -> str:
    """The sum of several datasets' projections by their deadline (``(projected, budget)`` each, from
    ``deadline_projection``), as status and the progress line end with it: '' for fewer than two."""
    if len(projections) < 2:
        return ""
    projected = sum(p for p, _ in projections)
    budgets = [b for _, b in projections]
    if any(b is None for b in budgets):
        return f"total: projected {projected:,} tokens by the deadline over {len(projections)} datasets"
    budget = sum(b for b in budgets if b is not None)
    short = f"; warning: short of their budgets' {budget:,}" if projected < budget else f" of {budget:,}"
    return f"total: projected {projected:,} tokens by the deadline over {len(projections)} datasets{short}"


def display_status(state: DatasetState) -> str:
    """``closed`` (its budget reached) as the ledger keeps it; ``open``, or ``complete`` when an open dataset has
    every selected sample handed out and nothing left running, queued or unwritten: nothing more will happen to
    it (a closed one stays ``closed``: what it did not run is its ``not run``)."""
    idle = not (state.live_chunks or state.queued_chunks or state.in_flight or state.unwritten)
    todo = state.fields.get("todo")
    if state.status == "open" and todo is not None and int(todo or 0) == 0 and idle:
        return "complete"
    return state.status


def dataset_status(state: DatasetState, now: float | None = None, conversations_open: int = 0) -> DatasetStatus:
    stats = state.stats
    stop, length = int(stats.get("finish_stop", 0)), int(stats.get("finish_length", 0))
    tps = tokens_per_second(stats, now)
    selected = int(state.fields.get("selected") or 0) or None
    todo = int(state.fields.get("todo", 0) or 0)
    status = display_status(state)
    mean = state.used / state.done if state.done else None
    left = (selected - state.done - state.failed) * mean if selected is not None and mean is not None else None
    return DatasetStatus(
        name=state.name, mode=state.mode, status=status, budget=state.budget, used=state.used,
        reserved=state.reserved, in_flight=state.in_flight, done=state.done, failed=state.failed,
        selected=selected, not_run=todo if state.status == "closed" else 0,
        discarded_chunks=state.discarded_chunks, queued_chunks=state.queued_chunks, tokens_per_s=tps,
        eta_s=eta_seconds(state.budget, state.used, status, tps, left),
        finish_stop=stop, finish_length=length,
        truncation_rate=length / (stop + length) if stop + length else None,
        mean_completion=mean,
        late=int(stats.get("late", 0)), unwritten=state.unwritten, turns=int(stats.get("turns", 0) or 0),
        conversations=int(stats.get("conversations", 0) or 0), conversations_open=conversations_open,
        request_s=int(stats.get("request_ms", 0) or 0) / 1000, server_s=int(stats.get("server_ms", 0) or 0) / 1000)


def all_status(client: "redis.Redis", names: list[str] | None = None,
               now: float | None = None) -> list[DatasetStatus]:
    """Every dataset's (or ``names``') status; ``now`` (unix time, default: the clock) is when its tok/s is read."""
    ledger = Ledger(client)
    store = RunState(client)
    if not names:
        names = store.datasets()
    unknown = [n for n in names if not store.exists(n)]
    if unknown:
        raise UsageError(f"no dataset {', '.join(map(repr, unknown))} in this Redis "
                         f"(it has: {', '.join(store.datasets()) or 'none'})")
    return [dataset_status(ledger.state(n), now, conversations_open=ledger.open_conversations(n)) for n in names]


def parse_budget_change(name: str, amount: str) -> int | None:
    """``produce budget NAME AMOUNT`` checked before Redis is asked: the new budget, None for unlimited."""
    from producer.inputs.reader import valid_name
    if not valid_name(name):
        raise UsageError(f"invalid dataset name {name!r}")
    try:
        return None if amount.lower() in ("unlimited", "none") else parse_amount(amount)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def parse_mix_change(values: tuple[str, ...], total: str | None) -> tuple[dict[str, Fraction], int | None]:
    """``produce budget --mix ... [--total AMOUNT]`` checked before Redis is asked."""
    try:
        return parse_mix(values), None if total is None else parse_amount(total)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def change_mix(client: "redis.Redis", weights: dict[str, Fraction], total: int | None) -> str:
    """Give the mix of exactly these datasets new weights (and a new total): every member's budget becomes its new
    share at once; a member whose share is at or below what it used closes, and its queued chunks are discarded.
    Tokens already spent stay counted; the dry members keep what they used. Returns the lines saying so."""
    store = MixStore(client)
    stored = store.load(mix_id(weights))
    if stored is None:
        raise UsageError(f"no mix of exactly {', '.join(sorted(weights))} in this Redis: --mix names every member "
                         "of the run's mix (produce status lists them)")
    new = Mix(total=stored.total if total is None else total, weights=weights, dry=stored.dry)
    store.save(new)
    ledger = Ledger(client)
    lines = [new.describe()]
    for name, status in store.apply(ledger, new).items():
        discarded = ledger.discard(name, "budget lowered") if status == "closed" else 0
        state = ledger.state(name)
        lines.append(f"{name}: budget {_n(state.budget)}, used {state.used:,}, {status}"
                     + (f", {discarded} queued chunks discarded" if discarded else ""))
    return "\n".join(lines)


def change_budget(client: "redis.Redis", name: str, budget: int | None) -> str:
    """Set dataset ``name``'s budget: raising it reopens the dataset (the attached produce tops up its queue),
    lowering it to what is used closes it and discards its queued chunks at once. Returns the line saying so.
    A mix's member is refused: its budget is its share (``change_mix``)."""
    if not RunState(client).exists(name):
        raise UsageError(f"no dataset {name!r} in this Redis")
    in_mix = MixStore(client).mix_of(name)
    if in_mix:
        raise UsageError(f"{name} is in the mix of {in_mix.replace(',', ', ')}: its budget is its share of the mix; "
                         f"change the weights or the total: produce budget --mix "
                         f"{','.join(f'{n}=W' for n in in_mix.split(','))} [--total AMOUNT]")
    ledger = Ledger(client)
    status = ledger.set_budget(name, budget)
    discarded = ledger.discard(name, "budget lowered") if status == "closed" else 0
    state = ledger.state(name)
    return (f"{name}: budget {'unlimited' if budget is None else f'{budget:,}'}, used {state.used:,}, {status}"
            + (f", {discarded} queued chunks discarded" if discarded else ""))


def _n(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}"


def eta_text(seconds: float | None) -> str:
    """A duration as status shows it: 1h05m, 4m30s; "-" for None."""
    if seconds is None:
        return "-"
    h, rem = divmod(int(seconds), 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def server_time(seconds: float) -> str:
    """A dataset's server time as a person reads it: seconds under a minute, minutes under an hour, then hours."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:,.2f} h"


def status_table(rows: list[DatasetStatus]) -> str:
    head: tuple[str, ...] = ("dataset", "mode", "status", "used", "budget", "reserved", "in flight", "done", "failed", "not run",
            "tok/s", "eta", "stop/length", "trunc", "mean len", "server time")
    body: list[tuple[str, ...]] = [(r.name, r.mode, r.status, _n(r.used), "unlimited" if r.budget is None else _n(r.budget), _n(r.reserved),
             _n(r.in_flight), _n(r.done) + (f"/{r.selected:,}" if r.selected else ""), _n(r.failed),
             _n(r.not_run), f"{r.tokens_per_s:,.0f}", eta_text(r.eta_s), f"{r.finish_stop}/{r.finish_length}",
             "-" if r.truncation_rate is None else f"{r.truncation_rate:.1%}",
             "-" if r.mean_completion is None else f"{r.mean_completion:,.0f}", server_time(r.server_s))
            for r in rows]
    if not body:
        return "no datasets in this Redis"
    if any(r.turns or r.conversations_open for r in rows):  # multi-turn: turns beside conversations
        head = (*head, "conversations", "turns")
        body = [(*row, f"{r.conversations:,}" + (f" (+{r.conversations_open:,} open)" if r.conversations_open else ""),
                 _n(r.turns)) for row, r in zip(body, rows, strict=True)]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def mix_lines(client: "redis.Redis", names: list[str]) -> str:
    """One line per mix among ``names`` (docs/mix.md), after the table: its total, what its members used, and each
    member's weight and share; '' if none. A member's share is its budget in the table."""
    store, lines, seen = MixStore(client), [], set()
    for name in names:
        mid = store.mix_of(name)
        if not mid or mid in seen:
            continue
        seen.add(mid)
        mix = store.load(mid)
        if mix is not None:
            used = sum(Ledger(client).state(n).used for n in mix.weights)
            lines.append(f"{mix.describe()}; used {used:,} ({used / mix.total:.1%})" if mix.total else mix.describe())
    return "".join(f"\n{line}" for line in lines)


def deadline_lines(client: "redis.Redis", rows: list[DatasetStatus], now: float | None = None) -> str:
    """One line per dataset with a deadline (docs/mix.md): when, and the tokens it is projected to have by then at
    its current tok/s (capped at its budget), warning when that is short of the budget; '' if none."""
    now = time.time() if now is None else now
    lines = []
    projections: list[tuple[int, int | None]] = []
    for row in rows:
        raw = RunState(client).field(row.name, "deadline")
        if not raw:
            continue
        at = int(raw) / 1000
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(at))
        if at <= now or row.status != "open":
            closed = RunState(client).field(row.name, "closed_by") == "deadline"
            lines.append(f"{row.name}: deadline {when}{' reached' if closed else ''}")
            continue
        projected, short = deadline_projection(row.used, row.budget, row.tokens_per_s, at - now)
        projections.append((projected, row.budget))
        lines.append(f"{row.name}: deadline {when} (in {eta_text(at - now)}): projected {projected:,} tokens by then at "
                     f"{row.tokens_per_s:,.0f} tok/s" + (f"; warning: short of its budget {row.budget:,}" if short
                                                          else ""))
    total = deadline_total(projections)
    return "".join(f"\n{line}" for line in [*lines, *([total] if total else [])])


def status_text(client: "redis.Redis", rows: list[DatasetStatus]) -> str:
    """``produce status``'s screen: the table, then the mixes, the deadlines and the workers whose servers are down.
    The dashboard's budget page shows the same text, so the two never disagree."""
    return (status_table(rows) + mix_lines(client, [r.name for r in rows]) + deadline_lines(client, rows)
            + down_servers(client))


def down_servers(client: "redis.Redis") -> str:
    """The lines naming each worker whose SGLang servers are down (budget/serverinfo.py), after the table; '' if
    none."""
    lines = serverinfo.describe_down(serverinfo.read_down(client))
    return "\n" + "\n".join(lines) if lines else ""


# -- produce's progress line and summary table, and the length distribution ------------------------------

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
