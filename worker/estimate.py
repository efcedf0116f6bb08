"""What a request still running will cost: the reservation that predict mode holds for it.

Requests still running are not average ones: long requests stay in flight longer (the inspection paradox),
and each request's tokens land all at once when it completes. Reserving the plain mean per running request
therefore under-reserves (the issue's simulation: about +7% over budget). Instead each running request
reserves E[L | L > progress]: its expected final length given how far it has already got, taken from the
dataset's recent completion lengths. A request that has run long is expected to run longer, so its
reservation grows while it runs.

Progress is estimated as elapsed time x the per-request decode rate this worker observes (tokens per second
of completed requests), so no streaming is needed.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Sequence

from budget.ledger import default_prior_mean

#: How many pseudo-observations the prior is worth: enough to be sensible before the first results, few
#: enough that a few dozen real lengths outweigh it.
PRIOR_POINTS = 32
PRIOR_SIGMA = 0.8
#: Below this many observations beyond a request's progress, the conditional mean is extrapolated.
MIN_TAIL = 8


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
    """E[L] and E[L | L > x] from observed completion lengths plus a small prior, capped at max_new_tokens."""

    def __init__(self, lengths: Sequence[int], prior_mean: float | None, max_new: int) -> None:
        self.max_new = max(1, max_new)
        prior = prior_mean if prior_mean else default_prior_mean(self.max_new)
        data = sorted([*lengths, *prior_sample(prior, self.max_new)])
        self.sorted = data
        self.suffix = [0] * (len(data) + 1)
        for i in range(len(data) - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + data[i]
        self.observed = len(lengths)

    def mean(self) -> float:
        return self.suffix[0] / len(self.sorted)

    def expected(self, progress: float) -> int:
        """Expected final length of a request that has generated about ``progress`` tokens so far."""
        if progress <= 0:
            return min(self.max_new, max(1, round(self.mean())))
        if progress >= self.max_new:
            return self.max_new
        i = bisect_right(self.sorted, progress)
        above = len(self.sorted) - i
        if above >= MIN_TAIL:
            value = self.suffix[i] / above
        else:
            # Beyond almost everything seen: assume the tail goes on like the last MIN_TAIL observations did.
            tail = self.sorted[-MIN_TAIL:]
            excess = sum(tail) / len(tail) - tail[0] if len(tail) > 1 else self.mean()
            value = progress + max(excess, 1.0)
        return min(self.max_new, max(math.ceil(progress) + 1, round(value)))


@dataclass
class RateTracker:
    """Per-request decode speed seen by this worker: tokens / seconds of completed requests (an EWMA)."""

    alpha: float = 0.05
    rate: float | None = None
    samples: int = field(default=0)

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        r = tokens / seconds
        self.rate = r if self.rate is None else (1 - self.alpha) * self.rate + self.alpha * r
        self.samples += 1

    def progress(self, elapsed: float) -> float:
        return 0.0 if self.rate is None else elapsed * self.rate
