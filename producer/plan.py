"""``produce --dry-run``: know before launching what a run will cost and how long it will take.

A run launched without an estimate can be on course to 2.7 times its target (26.6M tokens against 10M, seen
in a run launched without one) before anyone looks. A plan reads, validates and renders everything (the same code
path as a real run), writes nothing to Redis, and projects per dataset: samples needed to reach the budget at
the expected completion length, tokens, and the time at a given throughput. The expected length comes from
``--expect-mean``, from an existing ``raw_responses.jsonl`` (a resumed run), or from ``--pilot N`` real requests
sent straight to SGLang.

With ``--turns all`` a multi-turn conversation makes up to k requests: the expected length is per turn, a sample's
tokens are its turns times it, and the ETA is also bounded by the longest conversation, whose turns run one after
another: k turns take about k times one turn's latency, ``mean x in_flight / throughput`` when ``in_flight``
requests share the deployment's throughput (``sequential_eta``).
"""
from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Sequence

import aiohttp

from producer.prepare import Prepared
from producer.results import RESULTS, iter_results
from render.modeldir import Context

#: Requests the deployment runs at once when --in-flight is not given: one worker's window (BUDGETQ_CONCURRENCY).
DEFAULT_IN_FLIGHT: Final = 64


def sequential_eta(tokens: float, throughput: float, longest_turns: int, mean: float, in_flight: int) -> float:
    """Seconds to generate ``tokens`` at ``throughput`` when a conversation's turns run in sequence: the larger of
    the throughput bound and the longest conversation's ``longest_turns`` turn latencies (``mean`` tokens each
    at ``throughput / in_flight`` tokens a second per request). One-turn samples: the throughput bound alone."""
    bound = tokens / throughput
    if longest_turns <= 1:
        return bound
    return max(bound, longest_turns * mean * in_flight / throughput)


@dataclass(frozen=True)
class DatasetPlan:
    name: str
    valid: int  # selected: valid, fitting the context, within --max-samples
    invalid: int
    over_context: int
    prompt_tokens_sum: int
    prompt_tokens_mean: float
    prompt_tokens_p95: int
    expected_completion: float | None
    expected_source: str  # "--expect-mean", "existing output", "pilot (N requests)", "unknown"
    done_already: int
    tokens_already: int
    budget: int | None
    samples_needed: int | None  # to reach the budget (all remaining when unbudgeted)
    projected_tokens: int | None
    eta_s: float | None
    order: str = "file"  # the order prompts are sent in (producer/settings.py): which ones a budget keeps
    conversations: int = 0  # --turns all: selected samples that are conversations of more than one turn
    conversation_turns: int = 0  # the most turns those make together (a turn may end its conversation early)
    requests_max: int = 0  # the most requests of the selected samples: one each, a conversation's turns
    longest_conversation: int = 1  # turns of the longest conversation: the ETA's sequential bound
    in_flight: int | None = None  # requests at once the sequential bound assumes (multi-turn datasets only)
    generations: int = 1  # --generations: samples per prompt (docs/generations.md)
    samples: int = 0  # samples planned: valid prompts x generations
    settings_mix: str = ""  # what generation k sends differently (a temperature list, derived seeds, a kwargs mix)
    pilot: dict[str, Any] | None = None  # --pilot's measurements (PilotResult.as_dict), whether or not they are used

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PilotResult:
    """What ``--pilot`` measured for a dataset: how many requests it sent, and the completion lengths of those
    that reported one (a body without ``completion_tokens`` is not a length)."""

    sent: int
    lengths: tuple[int, ...]
    max_new_tokens: int  # the run's --max-tokens: a length there was cut, so the mean is a floor

    @property
    def mean(self) -> float | None:
        return sum(self.lengths) / len(self.lengths) if self.lengths else None

    def as_dict(self, used: bool) -> dict[str, Any]:
        n = self.lengths
        return {"sent": self.sent, "answered": len(n), "mean": self.mean, "min": min(n, default=None),
                "max": max(n, default=None), "at_max_tokens": sum(1 for x in n if x >= self.max_new_tokens),
                "used": used}


def _p95(values: Sequence[int]) -> int:
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def existing_turns(out_dir: Path, name: str) -> tuple[int, int, int]:
    """(records, completion tokens, regenerated turns) already in OUT/<name>/raw_responses.jsonl, read without
    changing it. The first record of an id counts."""
    path = out_dir / name / RESULTS
    if not path.exists():
        return 0, 0, 0
    count = tokens = turns = 0
    seen: set[str] = set()
    for result in iter_results(path):  # up to a torn tail or a line that is not a record, as the collector reads
        if result.key not in seen:
            seen.add(result.key)
            rec = result.record
            count += 1
            tokens += result.tokens
            turns += len(rec["turns"]) if isinstance(rec.get("turns"), list) and rec["turns"] else 1
    return count, tokens, turns


def plan_dataset(p: Prepared, *, budget: int | None, out_dir: Path, expect_mean: float | None,
                 pilot_mean: float | None, pilot_n: int, throughput: float | None,
                 in_flight: int | None = None, settings_mix: str = "",
                 pilot: PilotResult | None = None) -> DatasetPlan:
    """``mean`` (the expected completion length) is per request, so per turn of a conversation: a sample is
    expected to make ``p.turns_total / len(p.samples)`` requests on average (at most: a turn may end its
    conversation early, so multi-turn projections are upper bounds). ``pilot``: what --pilot measured (its mean
    is ``pilot_mean``), shown whether or not --expect-mean or the output on disk take precedence."""
    lengths = [len(prompt.input_ids) for prompt in p.prompts.values()]
    done, tokens_done, turns_done = existing_turns(out_dir, p.name)
    if expect_mean:
        mean, source = expect_mean, "--expect-mean"
    elif done:
        mean, source = tokens_done / turns_done, (f"existing output ({done} responses)" if turns_done == done else
                                                 f"existing output ({done} responses, {turns_done} turns)")
    elif pilot_mean is not None:
        mean, source = pilot_mean, f"pilot ({pilot_n} requests)"
    else:
        mean, source = None, "unknown (give --expect-mean or --pilot N)"
    remaining_samples = max(0, p.selected - done)  # samples: prompts x generations
    per_sample = p.turns_total / p.selected if p.samples else 1.0  # requests a sample makes, at most
    needed: int | None = None
    projected: int | None = None
    if mean:
        if budget is None:
            needed = remaining_samples
        else:
            needed = min(remaining_samples, math.ceil(max(0, budget - tokens_done) / (mean * per_sample)))
        projected = tokens_done + round(needed * mean * per_sample)
        if budget is not None:
            projected = max(tokens_done, min(projected, budget)) if needed < remaining_samples else projected
    longest = max(p.turns.values(), default=1)
    eta = None
    if projected is not None and throughput and mean:
        eta = sequential_eta(projected - tokens_done, throughput, longest if needed else 1, mean,
                             in_flight or DEFAULT_IN_FLIGHT)
    return DatasetPlan(
        name=p.name, valid=len(p.samples), invalid=len(p.invalid), over_context=len(p.over_context),
        prompt_tokens_sum=sum(lengths), prompt_tokens_mean=sum(lengths) / len(lengths) if lengths else 0.0,
        prompt_tokens_p95=_p95(lengths), expected_completion=mean, expected_source=source,
        done_already=done, tokens_already=tokens_done, budget=budget, samples_needed=needed,
        projected_tokens=projected, eta_s=eta, order=p.settings.order.describe(), conversations=p.conversations,
        conversation_turns=p.conversation_turns, requests_max=p.turns_total, longest_conversation=longest,
        in_flight=(in_flight or DEFAULT_IN_FLIGHT) if p.conversations else None, generations=p.settings.generations.n,
        samples=p.selected, settings_mix=settings_mix,
        pilot=None if pilot is None else pilot.as_dict(used=source.startswith("pilot")))


async def _pilot(urls: Sequence[str], items: Sequence[list[int]], sampling_params: dict[str, Any],
                 api_key: str | None, timeout_s: float) -> list[int]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        async def one(i: int, ids: list[int]) -> int | None:
            url = urls[i % len(urls)] + "/generate"
            async with session.post(url, json={"input_ids": ids, "sampling_params": sampling_params}) as resp:
                body = await resp.json(content_type=None)
            if resp.status != 200 or not isinstance(body, dict):
                raise RuntimeError(f"pilot request to {url} answered {resp.status}: {str(body)[:200]}")
            tokens = body.get("meta_info", {}).get("completion_tokens")
            return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
        results = await asyncio.gather(*(one(i, ids) for i, ids in enumerate(items)))
    return [n for n in results if n is not None]


def run_pilot(p: Prepared, n: int, *, urls: Sequence[str], sampling_params: dict[str, Any],
              api_key: str | None = None, timeout_s: float = 3600.0) -> PilotResult:
    """Send ``n`` prompts of a dataset, evenly spaced in its order, straight to SGLang (nothing else is touched)
    and return what they measured."""
    step = max(1, len(p.samples) // max(n, 1))
    picks = [p.prompts[s.id].input_ids.tolist() for s in p.samples[::step][:n]]
    cap = int(sampling_params.get("max_new_tokens", 0))
    if not picks:
        return PilotResult(0, (), cap)
    lengths = asyncio.run(_pilot(urls, picks, sampling_params, api_key, timeout_s))
    return PilotResult(len(picks), tuple(lengths), cap)


def plan_table(plans: list[DatasetPlan], throughput: float | None, context: Context | None = None) -> str:
    def n(v: float | int | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    def eta(s: float | None) -> str:
        if s is None:
            return "-"
        h, rem = divmod(int(s), 3600)
        return f"{h}h{rem // 60:02d}m" if h or rem >= 60 else f"{int(s)}s"

    head = ("dataset", "valid", "invalid", "over ctx", "prompt tok", "mean", "p95", "exp. completion",
            "done", "budget", "samples needed", "projected tok", "eta")
    body = [(p.name, n(p.valid), n(p.invalid), n(p.over_context), n(p.prompt_tokens_sum), n(p.prompt_tokens_mean),
             n(p.prompt_tokens_p95), n(p.expected_completion), n(p.done_already),
             "unlimited" if p.budget is None else n(p.budget), n(p.samples_needed), n(p.projected_tokens),
             eta(p.eta_s)) for p in plans]
    proj = [p.projected_tokens for p in plans]
    total_proj = sum(x for x in proj if x is not None) if all(x is not None for x in proj) else None
    etas = [p.eta_s for p in plans]
    total_eta = sum(x for x in etas if x is not None) if all(x is not None for x in etas) else None
    body.append(("total", n(sum(p.valid for p in plans)), n(sum(p.invalid for p in plans)),
                 n(sum(p.over_context for p in plans)), n(sum(p.prompt_tokens_sum for p in plans)), "", "", "",
                 n(sum(p.done_already for p in plans)), "", n(sum(p.samples_needed or 0 for p in plans)),
                 n(total_proj), eta(total_eta)))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, "  ".join("-" * w for w in widths))
    for p in plans:
        lines.append(f"{p.name}: expected completion length from {p.expected_source}; order: {p.order}")
        if p.generations > 1:
            lines.append(f"{p.name}: {p.generations} generations of each prompt: {p.samples:,} samples, sent in "
                         "rounds (every prompt's generation 0, then 1, ...)"
                         + (f"; {p.settings_mix}" if p.settings_mix else ""))
        elif p.settings_mix:
            lines.append(f"{p.name}: {p.settings_mix}")
        if p.pilot is not None:
            lines.append(_pilot_line(p.name, p.pilot, p.expected_source))
        if p.conversations:
            lines.append(f"{p.name}: {p.conversations:,} multi-turn conversations, {p.conversation_turns:,} turns at "
                         f"most (longest {p.longest_conversation}); {p.requests_max:,} requests at most; the "
                         "expected length is per turn; the eta takes a conversation's turns one after another at "
                         f"{p.in_flight} requests in flight (--in-flight)")
    lines.append("eta at " + (f"{throughput:,.0f} completion tok/s" if throughput else
                              "an unknown throughput (give --throughput TOK/S)"))
    if context is not None:
        lines.append(f"context: {context.tokens:,} tokens, from {context.source} (at attach, a smaller limit "
                     "recorded by the workers' SGLang servers wins)")
    return "\n".join(lines)


def _pilot_line(name: str, pilot: dict[str, Any], source: str) -> str:
    """One line of what --pilot measured, and whether the plan used it."""
    head = f"{name}: pilot: {pilot['sent']:,} requests sent, {pilot['answered']:,} answered"
    if not pilot["answered"]:
        return head + " with a length: nothing measured"
    cut = pilot["at_max_tokens"]
    return (f"{head}: mean {pilot['mean']:,.0f} completion tokens (min {pilot['min']:,}, max {pilot['max']:,}; "
            f"{cut:,} cut at --max-tokens" + (", so the mean is a floor" if cut else "") + ")"
            + ("" if pilot["used"] else f"; not used: the expected length comes from {source}"))
