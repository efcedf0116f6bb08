"""Offline simulation of predict's control loop at the close: why the taper, and which t (docs/budget.md).

    python -m tests.taper_sim                      # ~1 minute: budgets 10x, 2x, 1x; margin rule vs tapers
    python -m tests.taper_sim --tapers 0,1,2,3 --seeds 10
    python -m tests.taper_sim --models exact,km --model-errors 0,1 --tapers 2   # + the worker's own model

No Redis, no simulator, no clock: a slot-level model of the loop, so the figures are not CPU-sensitive. Every
simulated second each running request decodes ``--tps`` tokens; a request that reaches its length commits; the
reservations of the running ones are restated as E[L | L > progress] (from 4096 draws of the true lengths: the
model is exact, so what is left is the rule's own error); then the free slots are admitted in one batch, in
order, by the rule the admit script runs (worker.estimate.predict_admits). The dataset closes when used reaches
the budget; requests in flight finish and count.

``--models km`` replaces the exact model with the one the worker runs (worker.estimate.LengthModel): the prior
from ``--mean`` (as ``--expect-mean`` gives it) plus the completion lengths observed so far (the last 4096),
with the running requests' progress as censored observations, rebuilt every ``--refresh`` simulated seconds
(the worker rebuilds it every 5 reservation intervals: 10 simulated s in bench/budget_modes.py); admission
uses its E[L] and sd(L), and each running request reserves its E[L | L > progress]. That is the model's own
error early in a run, which the exact model leaves out; ``--model-errors`` adds z of the model's standard
errors to each reservation (BUDGETQ_PREDICT_MODEL_ERROR, worker.estimate.LengthModel.reserve).
"""
from __future__ import annotations

import argparse
import math
import statistics

import numpy as np

from worker.estimate import LengthModel, predict_admits


def run(budget: int, taper: float, seed: int, margin: float = 1.0, slots: int = 256, mean: float = 3800,
        sigma: float = 0.8, cap: int = 16384, tps: float = 30.0, model: str = "exact",
        refresh: float = 10.0, z: float = 0.0) -> tuple[int, float]:
    """One run: (final - budget, simulated seconds from 90% of the budget to the close)."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma ** 2 / 2
    ref = np.sort(np.minimum(cap, np.maximum(1, np.round(rng.lognormal(mu, sigma, 4096)))))
    expected, sd = round(float(ref.mean())), float(ref.std())
    suffix = np.concatenate([np.cumsum(ref[::-1])[::-1], [0.0]])
    observed: list[int] = []
    km: LengthModel | None = None
    built = -math.inf

    def reserve(progress: np.ndarray) -> float:
        if km is not None:
            return float(sum(km.reserve(float(x), z) for x in progress))
        i = np.searchsorted(ref, progress, side="right")
        left = len(ref) - i
        cond = np.where(left > 0, suffix[np.minimum(i, len(ref))] / np.maximum(left, 1), cap)
        return float(np.maximum(cond, progress + 1).sum())

    used, t = 0, 0.0
    lengths, starts = np.zeros(0), np.zeros(0)
    closed, t90, t_close = False, None, 0.0
    while True:
        done = (t - starts) * tps >= lengths
        for length in lengths[done]:
            used += int(length)
            observed.append(int(length))
            if not closed and used >= budget:
                closed, t_close = True, t
        if t90 is None and used >= 0.9 * budget:
            t90 = t
        lengths, starts = lengths[~done], starts[~done]
        if closed and not len(lengths):
            return used - budget, t_close - (t90 or t_close)
        if not closed and model == "km" and t - built >= refresh:
            km = LengthModel(observed[-4096:], mean, cap, running=list((t - starts) * tps))
            expected, sd, built = km.reserve(0, z), km.sd(), t
        if not closed:
            held = reserve((t - starts) * tps) if len(lengths) else 0.0
            n, new = len(lengths), []
            while n < slots and predict_admits(used, round(held), expected, n, budget, margin * sd, taper * sd):
                held += expected
                n += 1
                new.append(min(cap, max(1, round(float(rng.lognormal(mu, sigma))))))
            lengths = np.append(lengths, new)
            starts = np.append(starts, [t] * len(new))
        t += 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factors", default="10,2,1", help="budgets of factor x slots x mean")
    ap.add_argument("--tapers", default="0,1,2,3", help="BUDGETQ_PREDICT_TAPER values (0 = the margin rule alone)")
    ap.add_argument("--margin", type=float, default=1.0, help="BUDGETQ_PREDICT_MARGIN")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--mean", type=float, default=3800)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--models", default="exact",
                    help="comma list: exact (the true distribution) and/or km (the worker's LengthModel as it learns)")
    ap.add_argument("--refresh", type=float, default=10.0, help="km: simulated seconds between model rebuilds")
    ap.add_argument("--model-errors", default="0", help="km: comma list of BUDGETQ_PREDICT_MODEL_ERROR values "
                    "(z standard errors of the model added to each reservation; 0 = the plain estimate)")
    ap.add_argument("--first-seed", type=int, default=0)
    args = ap.parse_args()
    print("| budget | taper | model | in [0, bound] | median over | max over | bound | median 90% -> close (simulated) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    cases = [(m, float(z)) for m in args.models.split(",")
             for z in (args.model_errors.split(",") if m == "km" else ["0"])]
    for factor in (float(f) for f in args.factors.split(",")):
        budget = round(factor * args.slots * args.mean)
        bound = max(0.005 * budget, args.max_tokens)
        for taper in (float(x) for x in args.tapers.split(",")):
            for model, z in cases:
                res = [run(budget, taper, seed, args.margin, args.slots, args.mean, cap=args.max_tokens,
                           model=model, refresh=args.refresh, z=z)
                       for seed in range(args.first_seed, args.first_seed + args.seeds)]
                over = sorted(r[0] for r in res)
                label = model if model == "exact" else f"km, z = {z:g}"
                print(f"| {budget:,} ({factor:g}x) | {taper:g} | {label} | {sum(0 <= o <= bound for o in over)}/"
                      f"{len(over)} | {statistics.median(over):+,.0f} | {over[-1]:+,} | {bound:,.0f} | "
                      f"{statistics.median(r[1] for r in res):.0f} s |", flush=True)

if __name__ == "__main__":
    main()
