"""How fresh predict's reservations are (issue 24): the per-request overhead taken out of progress
(RateTracker's fit), the restatement interval shortened for short requests, and a running request priced where
it will be at its next restatement (LengthModels.ahead). Pure functions of the observed (tokens, seconds): no clock."""
from __future__ import annotations

import math

import numpy as np
import pytest

from budget.ledger import LengthSample
from worker.estimate import LengthModel, LengthModels, RateTracker


def _tracker(overhead: float, speed: float, n: int = 256, seed: int = 1) -> tuple[RateTracker, list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in np.minimum(2048, np.maximum(1, np.round(rng.lognormal(math.log(300), 0.8, n))))]
    rt = RateTracker()
    for length in lengths:
        rt.observe(length, overhead + length / speed)
    return rt, lengths


def _models(reserve_interval: float = 1.0) -> LengthModels:
    async def fetch(dataset: str) -> LengthSample:  # never called: these tests only read the rate side
        raise AssertionError(dataset)
    return LengthModels(fetch, model_error=1.0, reserve_interval=reserve_interval)


def test_progress_is_net_of_the_per_request_overhead() -> None:
    """Requests of 0.1-0.7 s with 40 ms of overhead each: the fit reads a long runner's progress to the token;
    the ratio of sums (what progress was) reads it about a fifth short."""
    rt, _ = _tracker(0.04, 3000.0)
    fitted = rt.fit()
    assert fitted is not None
    assert fitted[0] == pytest.approx(0.04, rel=1e-6) and 1 / fitted[1] == pytest.approx(3000.0, rel=1e-6)
    elapsed = 0.04 + 1500 / 3000  # a request 1,500 tokens in
    assert rt.progress(elapsed) == pytest.approx(1500, rel=1e-6)
    assert rt.rate is not None and elapsed * rt.rate < 0.85 * 1500
    assert rt.progress(0.03) == 0.0  # still inside its overhead: nothing generated yet


def test_progress_falls_back_to_the_ratio_of_sums_where_the_fit_says_nothing() -> None:
    few = RateTracker()
    for length in (100, 900, 300):
        few.observe(length, 0.05 + length / 1000)
    assert few.fit() is None and few.progress(1.0) == pytest.approx(1300 / (0.15 + 1.3))
    alike = RateTracker()  # every request the same length: overhead and decoding cannot be told apart
    for _ in range(64):
        alike.observe(500, 1.0)
    assert alike.fit() is None and alike.progress(2.0) == pytest.approx(1000.0)
    no_overhead, _ = _tracker(0.0, 2000.0)  # an intercept of 0 (or below): the ratio is already right
    assert no_overhead.progress(0.5) == pytest.approx(1000.0)


def test_the_fit_follows_the_window() -> None:
    rt, _ = _tracker(0.04, 3000.0)
    before = rt.progress(1.0)
    for length in range(100, 100 + 256 * 7, 7):  # the window turns over to a slower server
        rt.observe(length, 0.04 + length / 1000)
    assert rt.progress(1.0) == pytest.approx(960, rel=1e-6) != before


def test_restate_interval_is_a_quarter_of_a_request_within_floor_and_setting() -> None:
    models = _models(reserve_interval=1.0)
    models._first_priced = 0.0  # as if the first request had been priced (the dispatcher prices before admitting)
    models.rates.observe(400, 0.4)
    assert models.restate_interval() == pytest.approx(0.1)
    models.rates = RateTracker()
    models.rates.observe(40, 0.08)
    assert models.restate_interval() == LengthModels.RESTATE_FLOOR_S  # never more often than the floor
    models.rates = RateTracker()
    models.rates.observe(3800, 120.0)
    assert models.restate_interval() == 1.0  # long requests: the setting, as before
    assert _models(reserve_interval=0.02).restate_interval() == 0.02  # a shorter setting is kept


def test_before_any_result_the_interval_grows_with_the_first_request_s_age() -> None:
    """No request has ended: they last at least as long as the first has run, so restate every quarter of that (the
    first results are the short ones, and the running ones must then be restated at once)."""
    now = [100.0]
    async def fetch(dataset: str) -> LengthSample:
        raise AssertionError(dataset)
    models = LengthModels(fetch, reserve_interval=1.0, clock=lambda: now[0])
    assert models.restate_interval() == LengthModels.RESTATE_FLOOR_S  # about to price the first requests
    model = LengthModel([], 400, 2048)
    models.reservation(model, 0.0)
    now[0] = 100.1
    assert models.restate_interval() == LengthModels.RESTATE_FLOOR_S
    now[0] = 102.0
    assert models.restate_interval() == pytest.approx(0.5)
    now[0] = 160.0
    assert models.restate_interval() == 1.0  # long requests: the setting, after a few restatements more
    models.rates.observe(300, 0.2)
    assert models.restate_interval() == LengthModels.RESTATE_FLOOR_S  # the first result sets it


def test_a_request_is_priced_at_its_next_restatement() -> None:
    model = LengthModel([int(x) for x in np.random.default_rng(3).lognormal(math.log(300), 0.8, 2000)], 400, 2048)
    models = _models()
    assert models.reservation(model, 0.0) == model.reserve(0.0, 1.0)  # no rate yet: E[L] as before
    rt, _ = _tracker(0.04, 3000.0)
    models.rates = rt
    step = models.restate_interval()
    assert 0.05 <= step < 0.1  # 4 restatements per request of ~0.14 s
    for elapsed in (0.0, 0.1, 0.3, 0.6):
        now, then = rt.progress(elapsed), rt.progress(elapsed + step)
        assert models.ahead(elapsed) == pytest.approx(then)
        assert models.reservation(model, elapsed) == model.reserve(then, 1.0) >= model.reserve(now, 1.0)
    # a new request: priced as one that survives to its first restatement, more than E[L] but not the cap
    assert model.reserve(0.0, 1.0) < models.reservation(model, 0.0) < 2048


def test_a_price_is_held_for_as_long_as_prices_have_stood() -> None:
    """Timers fire late on a loaded machine and refreshes wait at Redis: the lookahead is the longest that the
    last restatements' prices stood, when that is longer than the interval, and only while it is in the window."""
    models = _models()
    models.rates, _ = _tracker(0.04, 3000.0)
    step = models.restate_interval()
    assert models.lag() == step
    models.restated(step / 2)
    assert models.lag() == step  # sooner than the interval: the interval
    models.restated(0.3)
    assert models.lag() == 0.3
    assert models.ahead(0.1) == pytest.approx(models.rates.progress(0.4))
    for _ in range(LengthModels.STOOD_WINDOW):
        models.restated(step)
    assert models.lag() == step  # the late one has left the window
