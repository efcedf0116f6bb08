"""Offline, event-driven simulation of predict's close with short requests (issue 24): how fresh reservations are.

    python -m tests.close_sim                              # issue 24's setup, old pricing against new, 10 seeds
    python -m tests.close_sim --tps 300 --seeds 10         # requests of ~1.4 s
    python -m tests.close_sim --overhead 0 --pricing new   # one pricing only

tests/taper_sim.py steps a whole simulated second at a time, so it cannot see what issue 24 is about: requests of
0.1-2 s against reservations restated every second. This one runs in continuous time, with no clock of its own (not
CPU-sensitive): ``--workers`` workers of ``--slots / --workers`` slots each; a request of length L (lognormal,
``--mean``, ``--sigma``, capped at ``--cap``) takes ``--overhead`` + L / ``--tps`` seconds; each worker restates its
running requests' reservations on its own timer and, when one of its requests ends, admits its free slots one by
one by the rule the admit script runs (worker.estimate.predict_admits: used + reserved + margin, the taper), and
after a refusal asks again when its next request ends or 1 s later (worker/dispatch.py). The dataset closes when
used reaches the budget; what is in flight finishes and counts. The length model is the worker's
(worker.estimate.LengthModel, z = ``--z``) built from 4096 lengths of the true distribution: a model that has
learned, so what is left is how fresh the reservations are.

``--pricing old``: the code before issue 24's fix: progress = elapsed x Σ tokens / Σ seconds, reservations
restated every BUDGETQ_RESERVE_INTERVAL (``--interval``), a request priced at its progress now. ``new``: the worker's
LengthModels (a request priced where it will be when the next restatement replaces its price, the interval a
quarter of a request, progress net of the fitted overhead). ``--timer-late`` makes each restatement fire late by an
exponential delay of that mean, as a loaded machine's event loop does.

``--learn none|default|true``: the model is not given but learned as the worker learns it (issue 24's prior): each
worker rebuilds its LengthModel from the lengths completed so far (the last 4096) and the running requests' progress
as last published (censored), every ``LengthModels.refresh_after`` (5 intervals, or one while the model is young),
starting from no lengths at all. ``none``: no prior mean (the code now: a young model reserves max_new_tokens until
it has MIN_OBSERVED lengths); ``default``: the prior the worker used before, max_new_tokens / 4 capped at 1,024
(budget/ledger.py default_prior_mean, 32 pseudo-observations); ``true``: ``--expect-mean`` (the true mean).
"""
from __future__ import annotations

import argparse
import heapq
import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from budget.ledger import LengthSample, default_prior_mean
from worker.estimate import LengthModel, LengthModels, RateTracker, predict_admits


async def _no_fetch(dataset: str) -> LengthSample:
    raise AssertionError(dataset)  # the simulation never asks Redis: the model is given


@dataclass
class _Worker:
    models: LengthModels
    free: int
    flights: dict[int, list[float]] = field(default_factory=dict)  # id -> [started, reserved, published progress]
    retry_at: float = math.inf  # after a refusal: when it asks again if no request of its own ends first
    priced_at: float = 0.0  # when its standing prices were computed (LengthModels.restated)
    model: LengthModel | None = None  # with ``learn``: this worker's own model, and when it was built
    built_at: float = -math.inf

    def interval(self, pricing: str) -> float:
        return self.models.restate_interval() if pricing == "new" else self.models.reserve_interval

    def price(self, model: LengthModel, elapsed: float, pricing: str, z: float) -> int:
        if pricing == "new":
            return self.models.reservation(model, elapsed)
        rate = self.models.rates.rate
        return model.reserve(0.0 if rate is None else elapsed * rate, z)


def run(seed: int, budget: int = 600_000, slots: int = 192, workers: int = 3, mean: float = 413.0,  # noqa: C901
        sigma: float = 0.8, cap: int = 2048, tps: float = 3000.0, overhead: float = 0.04, interval: float = 1.0,
        taper: float = 2.0, margin: float = 1.0, z: float = 1.0, pricing: str = "new",
        timer_late: float = 0.0, learn: str = "", censor: str = "ahead") -> tuple[int, float]:
    """One run: (final - budget, seconds from 90% of the budget to the close). ``timer_late``: each restatement
    fires that many seconds late on average (exponential), as on a loaded machine. ``learn``: the model is learned
    from the run's own lengths with this prior (none, default, true: the module's docstring), not given.
    ``censor``: where a restatement publishes a running request's progress for the learned model (the module's
    docstring): ``ahead`` (the worker) or ``now`` (before)."""
    rng = np.random.default_rng(seed)
    late = np.random.default_rng(seed + 10_000)
    mu = math.log(mean) - sigma ** 2 / 2
    draw = lambda: int(min(cap, max(1, round(rng.lognormal(mu, sigma)))))  # noqa: E731
    given = LengthModel([draw() for _ in range(4096)], mean, cap)
    prior = {"": None, "none": None, "default": default_prior_mean(cap), "true": mean}[learn]
    seen: list[int] = []  # completed lengths, in order (the lengths list)
    clock = [0.0]  # the simulated time, which the worker's LengthModels read as their clock
    ws = [_Worker(LengthModels(_no_fetch, model_error=z, reserve_interval=interval, clock=lambda: clock[0]),
                  slots // workers) for _ in range(workers)]
    for w in ws:
        w.models.rates = RateTracker()
    events: list[tuple[float, int, int, int]] = []  # (time, kind 0 end / 1 restate / 2 retry, worker, request)
    lengths: dict[int, int] = {}
    used, closed, t90, t_close, next_id = 0, False, None, 0.0, 0

    def reserved() -> int:
        return sum(round(f[1]) for w in ws for f in w.flights.values())

    def in_flight() -> int:
        return sum(len(w.flights) for w in ws)

    def model_of(w: _Worker, now: float) -> LengthModel:
        if not learn:
            return given
        if w.model is None or now - w.built_at > w.models.refresh_after(w.model):
            running = [f[2] for v in ws for f in v.flights.values()]
            w.model, w.built_at = LengthModel(seen[-4096:], prior, cap, running=running), now
        return w.model

    def admit(wi: int, now: float) -> None:
        nonlocal next_id
        w = ws[wi]
        while w.free > 0 and not closed:
            model = model_of(w, now)
            sd = model.sd()
            price = w.price(model, 0.0, pricing, z)
            if not predict_admits(used, reserved(), price, in_flight(), budget, margin * sd, taper * sd):
                if in_flight():
                    w.retry_at = now + 1.0
                    heapq.heappush(events, (w.retry_at, 2, wi, -1))
                return
            length = draw()
            lengths[next_id] = length
            w.flights[next_id] = [now, float(price), 0.0]
            w.free -= 1
            heapq.heappush(events, (now + overhead + length / tps, 0, wi, next_id))
            next_id += 1

    for wi, w in enumerate(ws):
        heapq.heappush(events, (rng.uniform(0, w.interval(pricing)), 1, wi, -1))  # each worker's own timer phase
        admit(wi, 0.0)
    while events:
        now, kind, wi, rid = heapq.heappop(events)
        clock[0] = now
        w = ws[wi]
        if kind == 1:
            if closed and not in_flight():
                continue
            if w.flights:
                w.models.restated(now - w.priced_at)
            w.priced_at = now
            model = model_of(w, now)
            for f in w.flights.values():
                f[1] = w.price(model, now - f[0], pricing, z)
                f[2] = (w.models.ahead(now - f[0]) if pricing == "new" and censor == "ahead"
                        else w.models.rates.progress(now - f[0]))
            delay = late.exponential(timer_late) if timer_late > 0 else 0.0
            heapq.heappush(events, (now + w.interval(pricing) + delay, 1, wi, -1))
            continue
        if kind == 2:
            if now >= w.retry_at and not closed:
                w.retry_at = math.inf
                admit(wi, now)
            continue
        started = w.flights.pop(rid)[0]
        length = lengths.pop(rid)
        w.models.rates.observe(length, now - started)
        seen.append(length)
        used += length
        w.free += 1
        if t90 is None and used >= 0.9 * budget:
            t90 = now
        if not closed and used >= budget:
            closed, t_close = True, now
        if closed:
            if not in_flight():
                break
            continue
        admit(wi, now)
    return used - budget, t_close - (t90 if t90 is not None else t_close)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=600_000)
    ap.add_argument("--slots", type=int, default=192)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--mean", type=float, default=413.0, help="lognormal mean (413: median 300 at sigma 0.8)")
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--cap", type=int, default=2048)
    ap.add_argument("--tps", type=float, default=3000.0, help="decode tok/s per request")
    ap.add_argument("--overhead", type=float, default=0.04, help="seconds of each request that are not decoding")
    ap.add_argument("--interval", type=float, default=1.0, help="BUDGETQ_RESERVE_INTERVAL")
    ap.add_argument("--taper", type=float, default=2.0)
    ap.add_argument("--z", type=float, default=1.0)
    ap.add_argument("--timer-late", type=float, default=0.0,
                    help="mean seconds each restatement fires late (exponential): a loaded machine's event loop")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--pricing", default="old,new")
    ap.add_argument("--censor", default="ahead", help="comma list of ahead (the worker: a running request is "
                    "published at its progress at the next restatement) and now (before: its progress now)")
    ap.add_argument("--learn", default="", help="comma list of none, default, true: learn the model from the run "
                    "with that prior (the module's docstring) instead of giving it")
    args = ap.parse_args()
    bound = max(0.005 * args.budget, args.cap)
    print("| pricing | prior | censored at | in [0, bound] | median over | worst over | bound | median 90% -> close |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for pricing, learn, censor in [(p, ln, c) for p in args.pricing.split(",") for ln in args.learn.split(",")
                                   for c in args.censor.split(",")]:
        res = [run(s, args.budget, args.slots, args.workers, args.mean, args.sigma, args.cap, args.tps,
                   args.overhead, args.interval, args.taper, 1.0, args.z, pricing, args.timer_late, learn,
                   censor) for s in range(args.seeds)]
        over = sorted(o for o, _ in res)
        worst = over[-1] if over[-1] > bound or over[0] >= 0 else over[0]
        print(f"| {pricing} | {learn or 'given'} | {censor} | {sum(0 <= o <= bound for o in over)}/{len(over)} | "
              f"{statistics.median(over):+,.0f} | {worst:+,} | {bound:,.0f} | "
              f"{statistics.median(t for _, t in res):.2f} s |")


if __name__ == "__main__":
    main()
