"""What every dataset is doing, told three ways: ``produce status`` (read-only, from any machine that reaches
Redis), and ``produce budget``, the one change made from there: a dataset's budget, while it runs; ``produce``'s
own progress line while attached and its summary table when it ends (`DatasetSummary`, one row a dataset, below
the status), with each dataset's length distribution (`picture`, which ``produce sample`` draws too;
`nearest_rank` is also the manifest's quantile, so the three agree). One module, so the progress line's tok/s and
deadline projection are the status's own. And what the servers are doing (the last section): ``produce servers``,
one row per SGLang server, and the one or two lines ``produce run`` says of the workers and servers before it
enqueues (`preflight`).

The length distribution is a terminal picture: a text histogram of every response's completion tokens, with its
median, p90, p99 and max, and how many were cut at max_new_tokens. A response is one regenerated turn (one
request): its length is what ``--max-tokens`` caps and its ``finish_reason`` says whether the cap cut it, where a
multi-turn record's ``completion_tokens`` is a sum over several. Read from the committed records
(``raw_responses.jsonl``), the whole distribution: Redis keeps only the last 4096 lengths, for predict
(budget/keys.py ``lengths``). Bins are powers of two (1, 2-3, 4-7, ... 512-1023): lengths run from tens to tens of
thousands of tokens, and a doubling is what a reader compares with ``--max-tokens``. The responses cut at the cap
get a row of their own, last: a tall one says ``--max-tokens`` is too small.

The servers' view reads only what the workers write, nothing asked over the network from here: RQ's worker registry
of budgetq's queue (who listens, on which host), ``bq:server_load`` (budget/serverinfo.py: each worker's requests in
flight, window, max_running_requests, tokens/s and last error per server) and ``bq:server_health``
(budget/serverinfo.py: who finds which server down, since when). A server is named as the workers name it
(budget/serverinfo.py ``server_name``): its URL, with the host in front of a loopback one. Its state: ``down`` when
a worker finds it down (no connection, or /health 503), ``slow`` when a request to it timed out or was answered
5xx or 429 within SLOW_S, else ``ok``.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Final, Mapping, Sequence

import redis
from rq import Queue, Worker

from budget import keys, serverinfo
from budget.ledger import DatasetState, Ledger, Mix, MixStore, mix_id
from budget.runstate import RunState
from budget.runtime import redis_now
from budget.serverinfo import utc_iso
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
    deadline projection are ``produce status``'s: from the 10-second token buckets of the
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

# -- produce servers: the SGLang servers as the workers record them ------------------------------------------

WORKER_COMMAND = "rq worker -w worker.Worker -c worker.settings"


@dataclass
class ServerUse:
    """What the live workers of one host do with one server (one series of ``produce metrics``)."""

    server: str
    host: str
    workers: list[str] = field(default_factory=list)
    in_flight: int = 0
    window: int | None = None
    capacity: int | None = None
    tok_s: float | None = None
    down: dict[str, str] = field(default_factory=dict)  # worker -> why, for the workers that find it down
    down_since: float | None = None  # Redis time the first of them went down
    slow: bool = False
    last_error: str | None = None
    error_age_s: float | None = None


@dataclass(frozen=True)
class ServerRow:
    """One server: who uses it and how it does (``produce servers``, ``--json``)."""

    server: str
    hosts: list[str]
    workers: list[str]
    state: str  # ok / slow / down
    down_since: str | None  # UTC ISO time the first worker found it down
    down_for_s: float | None
    down_workers: list[str]
    in_flight: int
    window: int | None  # the windows its workers keep on it, summed (None: none known)
    max_running_requests: int | None
    tokens_per_s: float | None  # completion tokens/s its workers got from it over their last report
    last_error: str | None
    last_error_age_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _add(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


def server_uses(loads: list[dict[str, Any]], down: list[dict[str, Any]], now: float) -> list[ServerUse]:
    """Join the load entries and health entries (as budget/ loads them) into one ServerUse per (server, host)."""
    uses: dict[tuple[str, str], ServerUse] = {}

    def use(url: str, host: str) -> ServerUse:
        name = serverinfo.server_name(url, host)
        return uses.setdefault((name, host), ServerUse(name, host))

    for entry in loads:
        host, worker, age = str(entry.get("host")), str(entry.get("worker")), float(entry.get("age_s", 0.0))
        for url, f in entry["servers"].items():
            u = use(url, host)
            u.workers.append(worker)
            u.in_flight += int(f.get("in_flight") or 0)
            if isinstance(f.get("window"), int):
                u.window = int(_add(u.window, f["window"]) or 0)
            if isinstance(f.get("capacity"), int):
                u.capacity = max(u.capacity or 0, f["capacity"])
            if isinstance(f.get("tok_s"), (int, float)):
                u.tok_s = _add(u.tok_s, float(f["tok_s"]))
            unavailable = f.get("unavailable_age_s")
            if isinstance(unavailable, (int, float)) and unavailable + age <= serverinfo.SLOW_S:
                u.slow = True
            error_age = f.get("error_age_s")
            if isinstance(f.get("last_error"), str) and isinstance(error_age, (int, float)) \
                    and (u.error_age_s is None or error_age + age < u.error_age_s):
                u.last_error, u.error_age_s = f["last_error"], round(error_age + age, 1)
    for entry in down:
        host, worker = str(entry.get("host")), str(entry.get("worker"))
        since = float(entry.get("since", now))
        for url, why in entry["down"].items():
            u = use(url, host)
            if worker not in u.workers:
                u.workers.append(worker)
            u.down[worker] = str(why)
            u.down_since = since if u.down_since is None else min(u.down_since, since)
            u.last_error, u.error_age_s = str(why), 0.0  # what /health says now outranks an older request's error
    for u in uses.values():
        u.workers.sort()
    return sorted(uses.values(), key=lambda u: (u.server, u.host))


def server_rows(uses: list[ServerUse], now: float) -> list[ServerRow]:
    """One row per server, its hosts' uses summed."""
    by_server: dict[str, list[ServerUse]] = {}
    for u in uses:
        by_server.setdefault(u.server, []).append(u)
    rows = []
    for name, group in sorted(by_server.items()):
        down_workers = sorted(w for u in group for w in u.down)
        since = min((u.down_since for u in group if u.down_since is not None), default=None)
        window = None
        for u in group:
            window = _add(window, u.window)
        tok_s = None
        for u in group:
            tok_s = _add(tok_s, u.tok_s)
        errors = [u for u in group if u.last_error is not None]
        latest = min(errors, key=lambda u: u.error_age_s or 0.0) if errors else None
        capacities = [u.capacity for u in group if u.capacity]
        rows.append(ServerRow(
            server=name, hosts=sorted({u.host for u in group}), workers=sorted({w for u in group for w in u.workers}),
            state="down" if down_workers else "slow" if any(u.slow for u in group) else "ok",
            down_since=utc_iso(since) if since is not None else None,
            down_for_s=round(max(0.0, now - since), 1) if since is not None else None, down_workers=down_workers,
            in_flight=sum(u.in_flight for u in group), window=None if window is None else int(window),
            max_running_requests=max(capacities) if capacities else None,
            tokens_per_s=None if tok_s is None else round(tok_s, 1),
            last_error=latest.last_error if latest else None,
            last_error_age_s=latest.error_age_s if latest else None))
    return rows


@dataclass(frozen=True)
class ServersView:
    """Everything ``produce servers`` shows: who listens on the queue, and each server."""

    rq_workers: list[str]  # RQ worker names registered on budgetq's queue
    rq_hosts: list[str]
    uses: list[ServerUse]
    rows: list[ServerRow]

    def as_dict(self) -> dict[str, Any]:
        return {"queue": keys.QUEUE_NAME, "rq_workers": self.rq_workers, "rq_hosts": self.rq_hosts,
                "servers": [r.as_dict() for r in self.rows]}


def listening_workers(client: "redis.Redis") -> list[Any]:
    """The RQ workers registered on budgetq's queue (RQ's worker registry, through RQ's API)."""
    return sorted(Worker.all(queue=Queue(keys.QUEUE_NAME, connection=client)), key=lambda w: str(w.name))


def read_view(client: "redis.Redis") -> ServersView:
    """Read the view from Redis (raises redis.RedisError)."""
    now = redis_now(client)
    listening = listening_workers(client)
    uses = server_uses(serverinfo.read_load(client), serverinfo.read_down(client), now)
    return ServersView(rq_workers=[str(w.name) for w in listening],
                       rq_hosts=sorted({str(w.hostname) for w in listening if w.hostname}),
                       uses=uses, rows=server_rows(uses, now))


def _ago(seconds: float) -> str:
    s = int(seconds)
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s" if s >= 60 else f"{s}s"


def state_text(row: ServerRow) -> str:
    if row.state != "down":
        return row.state
    since = (row.down_since or "")[11:] or "?"
    share = "" if len(row.down_workers) == len(row.workers) else f", {len(row.down_workers)} of {len(row.workers)} workers"
    return f"down since {since} ({_ago(row.down_for_s or 0.0)}{share})"


def workers_line(view: ServersView) -> str:
    n, hosts = len(view.rq_workers), view.rq_hosts
    if not n:
        return f"no rq worker listens on queue {keys.QUEUE_NAME}"
    return (f"{n} rq worker{'s' if n != 1 else ''} listen{'s' if n == 1 else ''} on queue {keys.QUEUE_NAME}, on "
            f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} ({', '.join(hosts)})")


def _names(workers: list[str], most: int = 3) -> str:
    """The workers by name while they are few, else how many (--json lists them all)."""
    return ",".join(workers) if len(workers) <= most else f"{len(workers)} ({','.join(workers[:2])},...)"


def servers_table(view: ServersView) -> str:
    """The first line says who listens on the queue; then one row per server, or a line saying none is recorded."""
    head = ("server", "hosts", "workers", "state", "in flight", "window", "max running", "tok/s", "last error")
    body = [(r.server, ",".join(r.hosts), _names(r.workers), state_text(r), f"{r.in_flight:,}",
             "-" if r.window is None else f"{r.window:,}",
             "-" if r.max_running_requests is None else f"{r.max_running_requests:,}",
             "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
             "-" if r.last_error is None else f"{r.last_error} ({_ago(r.last_error_age_s or 0.0)} ago)")
            for r in view.rows]
    first = workers_line(view)
    if not body:
        return first + "\nno worker has recorded an SGLang server (none runs, or none started in the last 30 s)"
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return first + "\n" + "\n".join(lines)


def preflight(client: "redis.Redis", *, echo: Callable[[str], None], warn: Callable[[str], None],
              to_enqueue: int) -> None:
    """What ``produce run`` says before it enqueues: one line of who listens and how the recorded servers are; a
    warning when no worker listens (the work waits queued: a warning, workers may start later) and one when every
    recorded server is down. Both only when there is work for the workers (``to_enqueue`` samples, or chunks in
    the queue): a rerun of a finished run needs none. Best effort: a Redis error here is the run's to report."""
    try:
        view = read_view(client)
        waiting = to_enqueue > 0 or Queue(keys.QUEUE_NAME, connection=client).count > 0
    except redis.RedisError:
        return
    counts: dict[str, int] = {}
    for row in view.rows:
        counts[row.state] = counts.get(row.state, 0) + 1
    servers = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none recorded yet"
    if view.rq_workers or not waiting:
        echo(f"{workers_line(view)}; SGLang servers as the workers record them: {servers}")
    else:
        warn(f"warning: no rq worker listens on queue {keys.QUEUE_NAME}: start one with `{WORKER_COMMAND}` "
             "(REDIS_URL and SGLANG_URL set); the work waits queued")
    if waiting and view.rows and all(r.state == "down" for r in view.rows):
        named = "; ".join(f"{r.server} on {','.join(r.hosts)} ({r.last_error})" for r in view.rows)
        warn(f"warning: every SGLang server the workers recorded is down: {named}; their workers take no chunk "
             "until one answers /health (produce servers)")
