"""The length model's own error (worker/estimate.py LengthModel.error and reserve): what predict adds to each
reservation so that the model's early misses, shared by every request in flight, do not overshoot small budgets."""
from __future__ import annotations

import math

import numpy as np

from tests.taper_sim import run
from worker.estimate import LengthModel

MU, SIGMA, CAP = math.log(3800) - 0.32, 0.8, 16384


def _lengths(rng: np.random.Generator, n: int) -> list[int]:
    return [int(x) for x in np.minimum(CAP, np.maximum(1, np.round(rng.lognormal(MU, SIGMA, n))))]


def test_the_error_shrinks_as_lengths_are_observed() -> None:
    rng = np.random.default_rng(1)
    errors = [LengthModel(_lengths(rng, n), 3800, CAP).error(0) for n in (0, 64, 256, 4096)]
    assert errors == sorted(errors, reverse=True)
    assert errors[0] > 400  # the prior alone: 32 points' worth (sd 3.1K / sqrt(32) is 550)
    assert errors[-1] < 80  # 4096 lengths: sd / 64 is 49


def test_reserve_is_expected_plus_z_errors_capped() -> None:
    model = LengthModel(_lengths(np.random.default_rng(2), 200), 3800, CAP)
    for progress in (0.0, 2000.0, 9000.0, 16000.0, 20000.0):
        assert model.reserve(progress, 0) == model.expected(progress)
        one, two = model.reserve(progress, 1), model.reserve(progress, 2)
        assert model.expected(progress) <= one <= two <= CAP
    assert model.reserve(0, 1) >= model.expected(0) + model.error(0)
    assert model.reserve(20000.0, 3) == CAP


def test_the_error_covers_the_early_mean_about_as_a_standard_error_should() -> None:
    """Early in a run (a first wave of 256, the survivors censored at their progress) the model's mean misses
    the true one by about its error: within 2 errors in about 95% of runs, well within 3 in nearly all."""
    rng = np.random.default_rng(3)
    truth = float(np.mean(_lengths(rng, 400_000)))
    within2 = within3 = 0
    for _ in range(200):
        wave = np.array(_lengths(rng, 256))
        progress = 120 * 30.0  # 120 s at 30 tok/s
        model = LengthModel([int(x) for x in wave[wave <= progress]], 3800, CAP,
                            running=[progress] * int((wave > progress).sum()))
        miss = abs(model.mean() - truth)
        within2 += miss <= 2 * model.error(0)
        within3 += miss <= 3 * model.error(0)
    assert within2 >= 180 and within3 >= 196


def test_the_model_error_margin_lands_a_2x_budget_the_plain_model_overshoots() -> None:
    """The offline control loop (tests/taper_sim.py) with the worker's own model, a budget of 2x what is in
    flight: this seed overshoots by more than max_new_tokens without the error margin and lands with it."""
    budget = 2 * 256 * 3800
    plain, _ = run(budget, taper=2.0, seed=13, model="km", z=0.0)
    margin, _ = run(budget, taper=2.0, seed=13, model="km", z=1.0)
    assert plain > CAP
    assert 0 <= margin <= CAP


def test_a_cohort_censored_behind_its_latest_length_collapses_the_model() -> None:
    """Requests that started together (a first wave): when the one of length x ends, the ones still running are
    at x too. Censored an interval behind (their progress as published a restatement ago), none is at risk at x,
    Kaplan-Meier's survival falls to 0 past x and the model is the lengths seen; censored where they will be at
    the next restatement (worker/estimate.py LengthModels.ahead), the tail stays (priced at the cap beyond what
    was seen: on the safe side of the true mean)."""
    rng = np.random.default_rng(4)
    truth = float(np.mean(_lengths(rng, 400_000)))
    wave = np.sort(np.array(_lengths(rng, 1024)))
    x = float(wave[int(0.85 * len(wave))])  # the latest to end: 15% of the wave still runs
    ended = [int(v) for v in wave[wave <= x]]
    survivors = int((wave > x).sum())
    behind = LengthModel(ended, None, CAP, running=[x - 60] * survivors)
    ahead = LengthModel(ended, None, CAP, running=[x + 60] * survivors)
    assert behind.mean() < 0.9 * truth
    assert ahead.mean() > truth
    assert behind.expected(x - 60) < x + 100 < ahead.expected(x - 60)


def test_a_deadline_prices_a_request_at_its_expected_duration() -> None:
    from worker.estimate import LengthModels

    model = LengthModel(list(range(1, 1001)), None, max_new=4096)  # 1..1000 tokens, evenly: mean 500.5
    models = LengthModels(fetch=None)  # type: ignore[arg-type]  # deadline_ms reads no dataset
    assert models.deadline_ms(model) == 0  # no request timed yet: nothing to price it by
    for n in range(100):  # 10 ms a token, no overhead
        models.rates.observe(n + 1, (n + 1) / 100)
    assert abs(models.deadline_ms(model) - model.reserve(models.ahead(0.0), models.model_error) * 10) <= 1
    assert 5_000 <= models.deadline_ms(model) <= 6_000  # about its mean, 500 tokens: 5 s
    assert models.deadline_ms(LengthModel(list(range(1, 6)), None, max_new=4096)) == 40_960  # young: max_new_tokens
