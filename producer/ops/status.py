"""``produce status``: what every dataset in Redis is doing, read-only, from any machine that reaches Redis; and
``produce budget``, the one change made from there: a dataset's budget, while it runs."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import redis

from budget import serverinfo
from budget.ledger import DatasetState, Ledger
from budget.mix import Mix, MixStore, mix_id
from budget.runstate import RunState
from producer.errors import UsageError
from producer.settings import parse_amount, parse_mix

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
