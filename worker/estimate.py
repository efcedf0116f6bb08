"""What a request still running will cost: the reservation that predict mode holds for it.

Requests still running are not average ones: long requests stay in flight longer (the inspection paradox),
and each request's tokens land all at once when it completes. Reserving the plain mean per running request
therefore under-reserves (simulated on the reference workload of docs/performance.md: about +7% over budget). Instead each running request
reserves E[L | L > progress]: its expected final length given how far it has already got, taken from the
dataset's recent completion lengths. A request that has run long is expected to run longer, so its
reservation grows while it runs.

Progress is estimated as elapsed time x the per-request decode rate this worker observes (tokens per second
of completed requests), so no streaming is needed.

The model is an estimate from the few hundred lengths seen early in a run, and its error is the same for every
request in flight: the in-flight sum misses by n x that error, not by sqrt(n) x sd(L) as the lengths' own spread
does. So a reservation adds z standard errors of the estimate (``LengthModel.reserve``, z =
BUDGETQ_PREDICT_MODEL_ERROR): large while the model is young, nearly nothing once lengths accumulate
(docs/budget.md, "The model's own error").

Conversations (``TurnModels``, docs/budget.md "The per-turn length model"). A conversation's turns are not alike:
in real multi-turn data a follow-up answer is often shorter than the first, an agent's later step longer. A reservation that prices every turn at the pooled mean of all completion lengths
is biased as soon as they differ, and the bias lands where it hurts: near the
close the conversations still running are the ones in their later turns. So each turn index j (0, 1, 2, and 3 for
every turn from the fourth on) has a length model of its own, built from the recent lengths of that turn
(``bq:ds:{n}:lengths:{j}``), with the pooled model's mean as its prior: until a turn has answers of its own it is
priced as the pooled model prices it, and its own lengths outweigh the prior after a few dozen.

Not every planned turn happens: a conversation ends early when a turn is cut by max_new_tokens, no longer fits the
context, or calls other tools than the dataset's. The share of conversations that go on from turn j-1 to turn j,
among ended conversations that had a turn j planned (``bq:ds:{n}:stats`` ``reached:{j}`` / ``offered:{j}``, counted
by ``end_conversation``), weighs turn j's expected length. Pseudo-counts keep it at 1 (reserve every planned turn,
the upper bound) until conversations have ended.

The running turn is priced as a single-turn request is, E[L_j | L_j > progress] (``LengthModel``); the turns after it
at their expected length. Each per-turn model counts that turn's running requests as censored observations, as
the pooled model counts every running request: the worker restates their progress by turn bucket (the progress
hash's fields ``{chunk}\x1f{j}``), so a model is not biased short while the long turns it will see are still
running, which near a close is most of them.

Before the first lengths (issue 24). Without ``--expect-mean`` or an existing output nothing says how long a
dataset's answers are, and a made-up prior is wrong by as much as the data is unlike it: max_new_tokens / 4 capped
at 1,024 was 3.7x short of the reference workload's 3,800, and at a budget of 1-2x what is in flight the first waves
of admissions, priced by it, were the whole budget (+8% to +46% over). So an uninformed model has no prior: until it
has ``MIN_OBSERVED`` completed lengths, and twice as many as are running, it is *young* and reserves max_new_tokens
per request, which is strict's price (nothing can outgrow it, so the first waves cannot overshoot). After that it is
the Kaplan-Meier model of what was seen, running requests censored, with no pseudo-observations: the tail beyond the
longest length seen is priced at the cap, and the model's own error (large while it is small) rides in each
reservation. The first lengths are the short ones, so until it has ``FAST_REFRESH_LENGTHS`` it is rebuilt at every
restatement instead of every few seconds: it leaves the young state as soon as the lengths are in Redis, and the
short first lengths do not price the run for long. The cost is only at budgets under in flight x max_new_tokens, for
the first MIN_OBSERVED (and twice the running) lengths: fewer requests start then, as in strict. A given mean
(``--expect-mean``, an output's) is a prior of PRIOR_POINTS pseudo-observations, as before.

The worker keeps one model per dataset (``LengthModels``: the pooled model and the per-turn ones), rebuilt from
Redis every few seconds (at every restatement while it has few lengths) without ever making its event loop wait.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable, Final, Mapping, Sequence

from budget.ledger import TURN_BUCKETS, LengthSample, turn_bucket

log = logging.getLogger("budgetq.worker")

#: How many pseudo-observations the prior is worth: enough to be sensible before the first results, few
#: enough that a few dozen real lengths outweigh it.
PRIOR_POINTS = 32
PRIOR_SIGMA = 0.8
#: Completed lengths an uninformed model (no prior mean) needs before it prices requests below max_new_tokens: at
#: least MIN_OBSERVED, and YOUNG_PER_RUNNING x the requests running (censored) in its sample. The first lengths are
#: the short part of the first wave, and the running ones, whose progress says how long they are, are read short
#: early (a worker without results publishes 0): offline (tests/close_sim.py ``--learn none``), 1024 in flight of
#: the reference lengths at 1x, young until 64 lengths: 0 of 2 in the bound (+55K, +292K); until 2 x running: 2 of 2.
#: A model can turn young again if many more start than have ended: conservative, and only in a run's first waves.
MIN_OBSERVED = 64
YOUNG_PER_RUNNING = 2
#: ... and until it has this many it is rebuilt at every restatement, not every few seconds: a model built on the
#: first lengths and kept for 5 s is short (offline, issue 24's setup: 3 of 6 runs in the bound, worst +11,158, with
#: the 5 s refresh from the 64th length on; 6 of 6 with this). At most this many lengths: a cheap read.
FAST_REFRESH_LENGTHS = 2048


def prior_sample(mean: float, max_new: int, points: int = PRIOR_POINTS, sigma: float = PRIOR_SIGMA) -> list[int]:
    """Quantiles of a lognormal with the given mean, capped at max_new_tokens, as pseudo-observations."""
    mu = math.log(max(mean, 1.0)) - sigma ** 2 / 2
    out = []
    for i in range(points):
        q = (i + 0.5) / points
        z = _normal_quantile(q)
        out.append(min(max_new, max(1, round(math.exp(mu + sigma * z)))))
    return out


def _normal_quantile(q: float) -> float:
    # Acklam's rational approximation is overkill here; bisection on erf is exact enough and short.
    lo, hi = -8.0, 8.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class LengthModel:
    """E[L] and E[L | L > x] for a dataset's completion lengths, capped at max_new_tokens.

    Built with the Kaplan-Meier estimator: completed requests are observed lengths; requests still running are
    *censored* observations (their length is only known to exceed their progress). Leaving the running ones
    out would bias the model short early in a run, when the completed requests are mostly the short ones
    (exactly when the first reservations are made). A given ``prior_mean`` adds a small lognormal prior
    (PRIOR_POINTS observations) that keeps the first estimates sensible. Without one the model is ``young`` until
    it has MIN_OBSERVED lengths and YOUNG_PER_RUNNING x the running ones, and a young model reserves
    max_new_tokens (the module's "Before the first lengths"): a prior made up from max_new_tokens alone was several times short at the reference lengths.
    """

    def __init__(self, lengths: Sequence[int], prior_mean: float | None, max_new: int,
                 running: Sequence[float] = ()) -> None:
        self.max_new = max(1, max_new)
        prior = prior_sample(prior_mean, self.max_new) if prior_mean else []
        events = sorted(min(self.max_new, max(0, int(x))) for x in [*lengths, *prior])
        censored = sorted(min(float(self.max_new), max(0.0, float(x))) for x in running)
        self.observed = len(lengths)
        #: too few of its own lengths to go on: reserve() prices every request at max_new_tokens
        self.uninformed = not prior  # no prior mean: only its own lengths to go on
        self.young = self.uninformed and self.observed < max(MIN_OBSERVED, YOUNG_PER_RUNNING * len(censored))
        # Survival S(t) = P(L > t) as a step function: knots[i] with S just after knots[i] = surv[i].
        self.knots: list[float] = [0.0]
        self.surv: list[float] = [1.0]
        weights: list[float] = [0.0]  # Greenwood's d / (n (n - d)) at each knot (the model's own error, below)
        n_at_risk = len(events) + len(censored)
        ci = 0
        s_now = 1.0
        i = 0
        while i < len(events):
            t = events[i]
            while ci < len(censored) and censored[ci] < t:  # censored before t: no longer at risk at t
                n_at_risk -= 1
                ci += 1
            d = 0
            while i < len(events) and events[i] == t:
                d += 1
                i += 1
            if n_at_risk > 0:
                s_now *= 1 - d / n_at_risk
                weights.append(d / (n_at_risk * max(n_at_risk - d, 1)))
            else:
                weights.append(0.0)
            n_at_risk -= d
            self.knots.append(float(t))
            self.surv.append(s_now)
        if self.knots[-1] < self.max_new:  # every request ends by max_new_tokens
            self.knots.append(float(self.max_new))
            self.surv.append(0.0)
            weights.append(0.0)
        else:
            self.surv[-1] = 0.0
        # cumulative integral of S from 0 to each knot, and of 2t S(t) (the second moment)
        self.area = [0.0]
        second = 0.0
        for j in range(1, len(self.knots)):
            a, b = self.knots[j - 1], self.knots[j]
            self.area.append(self.area[-1] + self.surv[j - 1] * (b - a))
            second += self.surv[j - 1] * (b * b - a * a)
        self.variance = max(0.0, second - self.area[-1] ** 2)
        # The model's own error. The variance of a Kaplan-Meier mean is sum_j A_j^2 d_j / (n_j (n_j - d_j)), A_j
        # the area under S beyond knot j; the mean beyond a progress x sums the knots past x (over S(x)^2).
        # tail_var[j] = that sum over knots j, j+1, ...
        self.tail_var = [0.0] * (len(self.knots) + 1)
        for j in range(len(self.knots) - 1, -1, -1):
            beyond = self.area[-1] - self.area[j]
            self.tail_var[j] = self.tail_var[j + 1] + beyond * beyond * weights[j]

    def _survival_and_area(self, x: float) -> tuple[float, float]:
        j = bisect_right(self.knots, x) - 1
        s = self.surv[j]
        return s, self.area[j] + s * (x - self.knots[j])

    def mean(self) -> float:
        return self.area[-1]

    def sd(self) -> float:
        return math.sqrt(self.variance)

    def expected(self, progress: float) -> int:
        """Expected final length of a request that has generated about ``progress`` tokens so far."""
        if progress <= 0:
            return min(self.max_new, max(1, round(self.mean())))
        if progress >= self.max_new:
            return self.max_new
        s, area = self._survival_and_area(progress)
        if s <= 1e-9:
            # Beyond every length seen: it is a long one; expect it to run to the cap.
            return self.max_new
        value = progress + (self.area[-1] - area) / s
        return min(self.max_new, max(math.ceil(progress) + 1, round(value)))

    def error(self, progress: float = 0.0) -> float:
        """Standard error of ``expected(progress)`` as an estimate (not the spread of L itself)."""
        if progress >= self.max_new:
            return 0.0
        progress = max(progress, 0.0)
        s = self._survival_and_area(progress)[0]
        if s <= 1e-9:
            return 0.0
        return math.sqrt(self.tail_var[bisect_right(self.knots, progress)]) / s

    def reserve(self, progress: float, z: float) -> int:
        """What a request reserves: ``expected(progress)`` plus z standard errors of the model, capped; max_new_tokens
        while the model is ``young`` (strict's price: before a model has lengths, no estimate is safe)."""
        if self.young:
            return self.max_new
        base = self.expected(progress)
        if z <= 0:
            return base
        return min(self.max_new, base + math.ceil(z * self.error(progress)))


#: Pseudo-observations of "went on" behind each turn's continuation share: 1 until that many conversations ended.
CONTINUATION_PRIOR: Final = 8


@dataclass(frozen=True)
class TurnModels:
    """The length model of each turn bucket and the share of conversations that reach each turn."""

    models: tuple[LengthModel, ...]  # one per bucket
    continuation: tuple[float, ...]  # continuation[j]: P(turn j happens | turn j-1 did, turn j planned); [0] = 1
    z: float = 0.0  # reservations add z standard errors of each model (BUDGETQ_PREDICT_MODEL_ERROR)

    @classmethod
    def build(cls, pooled: LengthModel, per_turn: Sequence[Sequence[int]], counts: Mapping[str, int],
              z: float = 0.0, running: Sequence[Sequence[int]] = ()) -> "TurnModels":
        """From the pooled model (the prior), each bucket's recent lengths (missing buckets: none yet), the
        stats hash's ``reached:{j}`` / ``offered:{j}`` counts, and each bucket's running turns' progress (censored
        observations: "at least this long")."""
        prior = None if pooled.young else pooled.mean()  # a young pooled model makes every turn young too
        models = tuple(LengthModel(list(per_turn[j]) if j < len(per_turn) else [], prior, pooled.max_new,
                                   running=list(running[j]) if j < len(running) else [])
                       for j in range(TURN_BUCKETS))
        shares = [1.0]
        for j in range(1, TURN_BUCKETS):
            reached, offered = int(counts.get(f"reached:{j}", 0)), int(counts.get(f"offered:{j}", 0))
            shares.append(min(1.0, (reached + CONTINUATION_PRIOR) / (offered + CONTINUATION_PRIOR)))
        return cls(models, tuple(shares), z)

    def model(self, turn: int) -> LengthModel:
        return self.models[turn_bucket(turn)]

    def current(self, turn: int, progress: float) -> int:
        """What the running turn ``turn`` reserves, ``progress`` tokens into it."""
        return self.model(turn).reserve(progress, self.z)

    def future(self, turn: int, planned: int) -> int:
        """The expected tokens of the turns after ``turn`` of a conversation planned for ``planned`` turns: each
        later turn's expected length, weighed by the chance the conversation gets there."""
        total = 0.0
        reach = 1.0
        for j in range(turn + 1, planned):
            reach *= self.continuation[turn_bucket(j)]
            total += reach * self.model(j).reserve(0.0, self.z)
        return round(total)

    def sd(self, planned: int) -> float:
        """The spread of a new conversation's whole cost: its turns' spreads added in quadrature, each weighed by
        the chance the conversation gets there (predict's margin and taper for conversations are multiples of it,
        as a single-turn request's are of sd(L): a conversation in flight is a sum of turns, and near a close
        what it may still add is that wide)."""
        variance = 0.0
        reach = 1.0
        for j in range(planned):
            if j:
                reach *= self.continuation[turn_bucket(j)]
            variance += reach * self.model(j).sd() ** 2
        return math.sqrt(variance)

    def conversation(self, planned: int) -> int:
        """What a new conversation of ``planned`` turns reserves when it is admitted: turn 0 and the rest."""
        return self.current(0, 0.0) + self.future(0, planned)


class RateTracker:
    """Per-request decode speed seen by this worker, from its last ``window`` completions (tokens, seconds).

    ``progress(elapsed)``: how many tokens a request that has run ``elapsed`` seconds has generated. A request's
    time is a fixed overhead (HTTP, Redis, the server's scheduling) plus its tokens at the decode speed, so the
    window is fitted as seconds = overhead + tokens / speed (least squares) and progress is (elapsed - overhead)
    x speed. Where the fit says nothing (fewer than ``FIT_MIN`` completions, lengths too alike to tell overhead
    from decoding, a slope or intercept that is not positive) it falls back to the ratio of sums, Σ tokens /
    Σ seconds. The ratio alone is good when requests are long (the reference workload: 50 ms of overhead against
    2 minutes of decoding) but reads a long runner's progress 20-30% short when requests take 0.1-0.5 s and the
    overhead is 30-50 ms of each (issue 24): its reservation E[L | L > progress] was then too small exactly for the
    requests still running at the close.

    ``duration``: the mean seconds of a request, which sets how often reservations are restated
    (``LengthModels.restate_interval``).
    """

    FIT_MIN = 16

    def __init__(self, window: int = 256) -> None:
        self.window: deque[tuple[int, float]] = deque(maxlen=window)
        self.tokens = 0
        self.seconds = 0.0
        self._fit: tuple[float, float] | None = None
        self._fit_stale = True  # the window changed since _fit was computed

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def duration(self) -> float | None:
        """Mean seconds from a request's start to its answer over the window; None before the first."""
        return self.seconds / len(self.window) if self.window else None

    def seconds_for(self, tokens: int) -> float | None:
        """How long a request of ``tokens`` is expected to take here (the fit, else the ratio of sums); None before
        the first completion. What a deadline's admission asks (docs/mix.md)."""
        fitted = self.fit()
        if fitted is not None:
            overhead, per_token = fitted
            return overhead + tokens * per_token
        return tokens / self.rate if self.rate else None

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if len(self.window) == self.window.maxlen:
            old_t, old_s = self.window[0]
            self.tokens -= old_t
            self.seconds -= old_s
        self.window.append((tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds
        self._fit_stale = True

    def fit(self) -> tuple[float, float] | None:
        """(overhead seconds, seconds per token) of the window's least-squares line, or None (see the class)."""
        if self._fit_stale:
            self._fit, self._fit_stale = self._least_squares(), False
        return self._fit

    def _least_squares(self) -> tuple[float, float] | None:
        n = len(self.window)
        if n < self.FIT_MIN:
            return None
        mean_t, mean_s = self.tokens / n, self.seconds / n
        var = sum((t - mean_t) ** 2 for t, _ in self.window) / n
        if var <= (0.1 * mean_t) ** 2:  # lengths too alike: overhead and decode time cannot be told apart
            return None
        per_token = sum((t - mean_t) * (sec - mean_s) for t, sec in self.window) / n / var
        overhead = mean_s - per_token * mean_t
        if per_token <= 0 or overhead <= 0:
            return None
        return min(overhead, mean_s), per_token

    def progress(self, elapsed: float) -> float:
        fitted = self.fit()
        if fitted is not None:
            overhead, per_token = fitted
            return max(0.0, elapsed - overhead) / per_token
        rate = self.rate
        return 0.0 if rate is None else elapsed * rate


class LengthModels:
    """A worker's length model of each dataset (and the dataset's budget mode), rebuilt from Redis every
    ``refresh_s`` seconds (5 reservation intervals: the running requests' progress in the model stays fresh).

    Never blocks the loop: ``fetch`` reads a dataset's ``LengthSample`` (the dispatcher passes its batched ledger
    path: off the loop, waiting out an outage). Only a dataset's first model is awaited; after that a stale model
    is answered at once while one refresh per dataset runs in the background, and stays in use for as long as
    Redis does not answer."""

    #: Reservations are restated at least this often per request's mean duration (``restate_interval``) ...
    RESTATE_PER_REQUEST: Final = 4
    #: ... but at most every RESTATE_FLOOR_S seconds, whatever the requests: each restatement is a Redis call per chunk.
    RESTATE_FLOOR_S: Final = 0.05
    #: How many of the last restatements ``lag`` looks back over.
    STOOD_WINDOW: Final = 32

    def __init__(self, fetch: Callable[[str], Awaitable[LengthSample]], refresh_s: float = 5.0,
                 model_error: float = 0.0, reserve_interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fetch = fetch
        self.clock = clock  # for restate_interval's first seconds; tests/close_sim.py passes its simulated time
        self._first_priced: float | None = None  # when this worker priced its first request
        self.model_error = model_error  # z: reservations add z standard errors of the model (LengthModel.reserve)
        self.REFRESH_S = refresh_s
        self.reserve_interval = reserve_interval  # BUDGETQ_RESERVE_INTERVAL: the longest between restatements
        #: how long the last restatements' prices stood in Redis before the next replaced them (``restated``)
        self._stood: deque[float] = deque(maxlen=self.STOOD_WINDOW)
        self.rates = RateTracker()
        #: dataset -> (refreshed at, mode, pooled model, the sample it came from, its per-turn models once asked)
        self._models: dict[str, tuple[float, str, LengthModel, LengthSample]] = {}
        self._turns: dict[str, tuple[LengthSample, TurnModels]] = {}
        self._refreshing: dict[str, asyncio.Task[None]] = {}

    async def model(self, dataset: str) -> tuple[str, LengthModel]:
        """The dataset's budget mode and length model; only the first ever waits for Redis."""
        cached = await self._cached(dataset)
        return cached[1], cached[2]

    async def turns(self, dataset: str) -> TurnModels:
        """The dataset's per-turn models, for its conversations in predict mode: built from the same refresh as
        the pooled model, once, when first asked (a single-turn run never pays for them)."""
        _at, _mode, pooled, sample = await self._cached(dataset)
        built = self._turns.get(dataset)
        if built is None or built[0] is not sample:
            built = self._turns[dataset] = (sample, TurnModels.build(
                pooled, sample.per_turn, sample.turn_counts, self.model_error, sample.turn_running))
        return built[1]

    def refresh_after(self, model: LengthModel) -> float:
        """Seconds a model stands before it is rebuilt from Redis: ``refresh_s``, or one restatement interval while
        an uninformed model has fewer than FAST_REFRESH_LENGTHS lengths: a young one reserves max_new_tokens until it
        has enough (MIN_OBSERVED, YOUNG_PER_RUNNING), so it should see them as soon as they are in Redis, and the
        next ones correct the first, which are the short ones (the module's "Before the first lengths"). At most that
        many lengths: a cheap read."""
        if model.young or (model.uninformed and model.observed < FAST_REFRESH_LENGTHS):
            return self.restate_interval()
        return self.REFRESH_S

    async def _cached(self, dataset: str) -> tuple[float, str, LengthModel, LengthSample]:
        cached = self._models.get(dataset)
        if cached is None or time.monotonic() - cached[0] > self.refresh_after(cached[2]):
            task = self._refreshing.get(dataset)
            if task is None:
                task = self._refreshing[dataset] = asyncio.create_task(self._refresh(dataset))
                task.add_done_callback(lambda done: self._refreshed(dataset, done))
            if cached is None:
                await asyncio.shield(task)
                cached = self._models[dataset]
        return cached

    async def _refresh(self, dataset: str) -> None:
        sample = await self.fetch(dataset)
        pooled = LengthModel(sample.lengths, sample.prior_mean, sample.max_new_tokens, running=sample.running)
        self._models[dataset] = (time.monotonic(), sample.mode, pooled, sample)

    def _refreshed(self, dataset: str, done: "asyncio.Task[None]") -> None:
        self._refreshing.pop(dataset, None)
        if not done.cancelled() and done.exception() is not None and dataset in self._models:
            log.warning("length model of %s not refreshed (%s); keeping the last one", dataset, done.exception())

    def close(self) -> None:
        for task in list(self._refreshing.values()):
            task.cancel()

    def restate_interval(self) -> float:
        """Seconds between two restatements of a running chunk's reservations: BUDGETQ_RESERVE_INTERVAL, shortened
        to a quarter of a request's mean duration (not below RESTATE_FLOOR_S) when requests are shorter than a few
        intervals. A reservation is only as fresh as its last restatement, and the requests still running near a
        close are the long ones (the inspection paradox): with requests of 0.1-2 s and a 1 s interval most were
        never restated, so they held E[L] while the running ones averaged nearly twice that (issue 24)."""
        duration = self.rates.duration
        if duration is None:
            # No request has ended yet, so they last at least as long as the first has run: a quarter of that. The
            # first results come from the short requests, and the running ones must then be restated at once (a
            # budget of 1-2x what is in flight closes within the first waves); a run of long requests pays about a
            # dozen restatements more (each interval a quarter of the age: x1.25 a step, 0.05 s to 1 s in 14).
            if self._first_priced is None:  # the first requests are about to be priced
                return min(self.reserve_interval, self.RESTATE_FLOOR_S)
            duration = self.clock() - self._first_priced
        return min(self.reserve_interval, max(self.RESTATE_FLOOR_S, duration / self.RESTATE_PER_REQUEST))

    def restated(self, stood: float) -> None:
        """A chunk's new reservations reached Redis ``stood`` seconds after the ones they replace were priced."""
        self._stood.append(stood)

    def lag(self) -> float:
        """How long a price stands before the next replaces it: the restatement interval, or the longest of the last
        STOOD_WINDOW restatements if longer. On a loaded machine the timer fires late and the refresh waits its turn
        at Redis; offline (tests/close_sim.py), timers late by 50 ms on average put 7 of 8 runs over the bound."""
        return max(self.restate_interval(), max(self._stood, default=0.0))

    def ahead(self, elapsed: float, lag: float | None = None) -> float:
        """The progress a reservation is priced at: where a request that has run ``elapsed`` seconds will be when
        the next restatement replaces it (``lag`` on). E[L | L > p] only grows with p, so a request priced there
        holds enough for as long as it still runs until then; one that ends sooner gives its reservation back as
        it commits. Priced at its progress now, the reservation lags the request by up to an interval of
        decoding, and near a close the requests still running are the ones it lags (issue 24). ``lag``: ``lag()``,
        when the caller prices many requests at once (one restatement of a chunk) and took it once for all.

        It is also the progress a running request is published at (the progress hash, which every worker's model
        reads as censored lengths, "longer than this"), for the same reason: the value stands until the next
        restatement replaces it. Published at its progress now, a request is an interval behind itself whenever a
        model is built, and requests that started together (a run's first wave: every slot at once) are then all
        below the length of the latest of them to end, so Kaplan-Meier counts none of them at risk there and its
        survival falls to 0 past that length: the model collapses to the lengths seen (offline, 1024 in flight of
        the reference lengths: a mean of 3,143 instead of 4,294 the moment a first-wave request of 6,444 ended; 6 of
        85 runs over the bound, 1 of 85 published ahead; tests/close_sim.py, docs/budget.md). A request that ends
        before its next restatement is counted as at risk a little past its length until then: a bias toward long,
        the safe side for a budget."""
        return self.rates.progress(elapsed + (self.lag() if lag is None else lag))

    def reservation(self, model: LengthModel, elapsed: float) -> int:
        """What a single-turn request that has run ``elapsed`` seconds reserves now, on ``model``."""
        if self._first_priced is None:
            self._first_priced = self.clock()
        return model.reserve(self.ahead(elapsed), self.model_error)

    async def expected(self, dataset: str, elapsed: float = 0.0) -> int:
        """What a request of ``dataset`` that has run ``elapsed`` seconds reserves now (a new one: 0), priced
        at its next restatement (``ahead``)."""
        return self.reservation((await self.model(dataset))[1], elapsed)

    def deadline_ms(self, model: LengthModel) -> int:
        """What a request of ``model`` tells a deadline's admission (``duration_ms``: admitted only if it would end by
        the deadline): its expected duration, the tokens predict reserves for a new request of it at this worker's
        speed. 0, which admits until the deadline, before this worker has timed a request. Priced at a tail
        quantile instead, the data ended 3-21 pp off the mix and the end came no nearer the deadline (docs/mix.md, "Why the rule is not tightened")."""
        seconds = self.rates.seconds_for(model.reserve(self.ahead(0.0), self.model_error))
        return round(seconds * 1000) if seconds else 0

    async def sd(self, dataset: str) -> float:
        """The spread of the dataset's lengths: predict's margin and taper are multiples of it."""
        return (await self.model(dataset))[1].sd()


def predict_admits(used: int, reserved: int, expected: int, in_flight: int, budget: int, margin: float,
                   taper: float) -> bool:
    """predict's admission rule for one more request, as budget/scripts.py ADMIT decides it (the script is
    the one that runs; this mirror is for tests, benchmarks and docs/budget.md's "The taper").

    ``margin`` and ``taper`` are in tokens per sqrt(request in flight): k x sd(L) and t x sd(L). The margin
    rule alone lets a request start while any room is left (its own expectation is not counted), and the
    whole free batch of a worker refills at the close. The taper also counts the new request and the spread
    of what would then be in flight, so near the close fewer start and the batch drains. An idle dataset
    under its budget always starts one: predict never stalls below its budget."""
    if used + reserved + margin * math.sqrt(in_flight) >= budget:
        return False
    if taper > 0 and in_flight > 0:
        return used + reserved + expected + taper * math.sqrt(in_flight + 1) <= budget
    return True
