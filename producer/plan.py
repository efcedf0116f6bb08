"""``produce --dry-run``: know before launching what a run will cost and how long it will take.

The seed's run was on course to 26.6M tokens against a 10M target because nobody estimated first. A plan
reads, validates and renders everything (the same code path as a real run), writes nothing to Redis, and
projects per dataset: samples needed to reach the budget at the expected completion length, tokens, and the
time at a given throughput. The expected length comes from ``--expect-mean``, from an existing
``raw_responses.jsonl`` (a resumed run), or from ``--pilot N`` real requests sent straight to SGLang.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from producer.modeldir import Context
from producer.output import RESULTS
from producer.prepare import Prepared


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
    order: str = "file"  # the order prompts are sent in (producer/order.py): which ones a budget keeps

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _p95(values: Sequence[int]) -> int:
    if not values:
        return 0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def existing_output(out_dir: Path, name: str) -> tuple[int, int]:
    """(responses, completion tokens) already in OUT/<name>/raw_responses.jsonl, read without changing it."""
    path = out_dir / name / RESULTS
    if not path.exists():
        return 0, 0
    count = tokens = 0
    seen: set[str] = set()
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            try:
                rec = json.loads(raw)
                sid, n = str(rec["id"]), int(rec["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                break
            if sid not in seen:
                seen.add(sid)
                count += 1
                tokens += n
    return count, tokens


def plan_dataset(p: Prepared, *, budget: int | None, out_dir: Path, expect_mean: float | None,
                 pilot_mean: float | None, pilot_n: int, throughput: float | None) -> DatasetPlan:
    lengths = [len(a) for a in p.input_ids.values()]
    done, tokens_done = existing_output(out_dir, p.name)
    if expect_mean:
        mean, source = expect_mean, "--expect-mean"
    elif done:
        mean, source = tokens_done / done, f"existing output ({done} responses)"
    elif pilot_mean is not None:
        mean, source = pilot_mean, f"pilot ({pilot_n} requests)"
    else:
        mean, source = None, "unknown (give --expect-mean or --pilot N)"
    remaining_samples = max(0, len(p.samples) - done)
    needed: int | None = None
    projected: int | None = None
    if mean:
        if budget is None:
            needed = remaining_samples
        else:
            needed = min(remaining_samples, math.ceil(max(0, budget - tokens_done) / mean))
        projected = tokens_done + round(needed * mean)
        if budget is not None:
            projected = max(tokens_done, min(projected, budget)) if needed < remaining_samples else projected
    eta = (projected - tokens_done) / throughput if projected is not None and throughput else None
    return DatasetPlan(
        name=p.name, valid=len(p.samples), invalid=len(p.invalid), over_context=len(p.over_context),
        prompt_tokens_sum=sum(lengths), prompt_tokens_mean=sum(lengths) / len(lengths) if lengths else 0.0,
        prompt_tokens_p95=_p95(lengths), expected_completion=mean, expected_source=source,
        done_already=done, tokens_already=tokens_done, budget=budget, samples_needed=needed,
        projected_tokens=projected, eta_s=eta, order=p.order.describe())


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


def pilot_mean(p: Prepared, n: int, *, urls: Sequence[str], sampling_params: dict[str, Any],
               api_key: str | None = None, timeout_s: float = 3600.0) -> float | None:
    """Send the first ``n`` prompts of a dataset straight to SGLang (nothing else is touched) and return the
    mean completion length. Evenly spaced samples would be fairer; the first n keep it reproducible."""
    step = max(1, len(p.samples) // max(n, 1))
    picks = [p.input_ids[s.id].tolist() for s in p.samples[::step][:n]]
    if not picks:
        return None
    lengths = asyncio.run(_pilot(urls, picks, sampling_params, api_key, timeout_s))
    return sum(lengths) / len(lengths) if lengths else None


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
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, "  ".join("-" * w for w in widths))
    for p in plans:
        lines.append(f"{p.name}: expected completion length from {p.expected_source}; order: {p.order}")
    lines.append("eta at " + (f"{throughput:,.0f} completion tok/s" if throughput else
                              "an unknown throughput (give --throughput TOK/S)"))
    if context is not None:
        lines.append(f"context: {context.tokens:,} tokens, from {context.source} (at attach, a smaller limit "
                     "recorded by the workers' SGLang servers wins)")
    return "\n".join(lines)
