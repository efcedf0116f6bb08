"""Admission modes on a real redis-server: reservations, FULL, strict closing, settlement, expiry."""
from __future__ import annotations

import random
import time

import pytest
import redis

from budget import keys
from budget.ledger import Admit, Ledger, run
from producer.session.attach import JobSettings
from producer.session.loop import Item, enqueue_chunks, make_queue
from worker.estimate import LengthModel, RateTracker, predict_admits, prior_sample


def setup(r: "redis.Redis", mode: str, budget: int | None, max_new: int = 100, chunks: int = 1,
          size: int = 10) -> tuple[Ledger, list[str]]:
    ledger = Ledger(r)
    ledger.set_mode("ds", mode, max_new)
    ledger.set_budget("ds", budget)
    items = [[Item(f"s{c}-{i}", [1], False) for i in range(size)] for c in range(chunks)]
    ids = enqueue_chunks(r, make_queue(r), "ds", items, sampling_params={"max_new_tokens": max_new}, think=None,
                         settings=JobSettings())
    for cid in ids:
        assert ledger.start_chunk("ds", cid) == "ok"
    return ledger, ids


def test_predict_admits_while_used_plus_reserved_is_below_budget(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "predict", 100)
    assert ledger.admit("ds", "s0-0", cid, expected=60).reserved == 60
    assert ledger.admit("ds", "s0-1", cid, expected=60).verdict is Admit.START  # 60 < 100
    assert ledger.admit("ds", "s0-2", cid, expected=60).verdict is Admit.FULL  # 120 >= 100
    assert ledger.state("ds").reserved == 120 and ledger.state("ds").in_flight == 2
    # A commit settles the reservation with the real count; the dataset stays open below the budget.
    out = ledger.commit("ds", "s0-0", 10, {}, chunk=cid, reserved=60, finish_reason="stop")
    assert not out.closed_now and not out.late
    state = ledger.state("ds")
    assert (state.used, state.reserved, state.in_flight, state.status) == (10, 60, 1, "open")
    assert ledger.admit("ds", "s0-2", cid, expected=60).verdict is Admit.START  # 10 + 60 < 100
    # Growing reservations (a request that ran long) tighten admission at once.
    assert ledger.refresh_chunk("ds", cid, reserved=95)
    assert ledger.admit("ds", "s0-3", cid, expected=60).verdict is Admit.FULL
    # predict closes only when used reaches the budget.
    ledger.commit("ds", "s0-1", 50, {}, chunk=cid, reserved=35, finish_reason="length")
    assert ledger.commit("ds", "s0-2", 45, {}, chunk=cid, reserved=60, finish_reason="stop").closed_now
    assert ledger.state("ds").stats["finish_length"] == "1"


def test_strict_never_admits_past_the_budget_and_closes_when_nothing_fits(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "strict", 250, max_new=100)
    assert ledger.admit("ds", "s0-0", cid).reserved == 100
    assert ledger.admit("ds", "s0-1", cid).verdict is Admit.START  # 200 <= 250
    assert ledger.admit("ds", "s0-2", cid).verdict is Admit.FULL  # 300 > 250
    ledger.commit("ds", "s0-0", 30, {}, chunk=cid, reserved=100, finish_reason="stop")
    assert ledger.admit("ds", "s0-2", cid).verdict is Admit.START  # 30 + 200 <= 250
    ledger.commit("ds", "s0-1", 100, {}, chunk=cid, reserved=100, finish_reason="length")
    ledger.commit("ds", "s0-2", 100, {}, chunk=cid, reserved=100, finish_reason="length")
    # used 230: one more request of 100 cannot fit: closed, though 230 < 250.
    assert ledger.admit("ds", "s0-3", cid).verdict is Admit.CLOSED
    state = ledger.state("ds")
    assert state.status == "closed" and state.used == 230 <= 250


def test_strict_budget_below_max_tokens_closes_at_once(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_mode("ds", "strict", 100)
    assert ledger.set_budget("ds", 99) == "closed"
    assert ledger.set_budget("ds", 100) == "open"


def test_drain_reserves_nothing(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "drain", 10)
    for i in range(5):
        assert ledger.admit("ds", f"s0-{i}", cid, expected=1000).verdict is Admit.START
    assert ledger.state("ds").reserved == 0


def test_reservations_of_a_dead_worker_expire_with_its_lease(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "predict", 100)
    ledger.admit("ds", "s0-0", cid, expected=100)
    assert ledger.admit("ds", "s0-1", cid, expected=90).verdict is Admit.FULL
    assert ledger.refresh_chunk("ds", cid, lease_ms=50)
    time.sleep(0.1)  # the lease is Redis TIME: nothing to await
    assert ledger.reclaim("ds") == [cid]
    assert ledger.state("ds").reserved == 0  # budget never leaks to a dead worker
    # The dead chunk's request, if it still completes, is kept, counted once and reported as late.
    out = ledger.commit("ds", "s0-0", 40, {}, chunk=cid, reserved=100, finish_reason="stop")
    assert out.committed and out.late
    assert ledger.state("ds").stats["late"] == "1"
    assert ledger.state("ds").reserved == 0


def test_fail_settles_the_reservation(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "strict", 1000)
    ledger.admit("ds", "s0-0", cid)
    assert ledger.fail("ds", "s0-0", cid, {"reason": "400"}, reserved=100)
    state = ledger.state("ds")
    assert state.reserved == 0 and state.in_flight == 0


def test_finish_chunk_drops_its_reservation_row(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "predict", 1000)
    ledger.finish_chunk("ds", cid)
    assert r.hlen(keys.DatasetKeys("ds").resv) == 0 and r.zcard(keys.DatasetKeys("ds").chunks) == 0


def test_a_chunks_request_time_is_counted_once(r: "redis.Redis") -> None:
    """The cost in view (docs/mix.md): a chunk's summed request and server time go to the stats when it finishes,
    and a resend of that finish (a lost reply) adds nothing."""
    ledger, (cid,) = setup(r, "predict", 1000)
    ledger.finish_chunk("ds", cid, request_ms=12_500, server_ms=2_100)
    ledger.finish_chunk("ds", cid, request_ms=12_500, server_ms=2_100)
    stats = r.hgetall(keys.DatasetKeys("ds").stats)
    assert (stats[b"request_ms"], stats[b"server_ms"]) == (b"12500", b"2100")


def test_lowering_and_raising_the_budget(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "predict", 1000)
    ledger.commit("ds", "s0-0", 300, {}, chunk=cid, finish_reason="stop")
    assert ledger.set_budget("ds", 300) == "closed"  # lowered to what is used: closed at once
    assert ledger.set_budget("ds", 2000) == "open"  # raised: reopened
    assert ledger.set_budget("ds", 350) == "open"  # above used: open, admission tightens
    ledger.admit("ds", "s0-1", cid, expected=60)
    assert ledger.admit("ds", "s0-2", cid, expected=60).verdict is Admit.FULL


def test_length_model_conditional_expectation_grows_with_progress() -> None:
    lengths = [100] * 500 + [1000] * 500
    model = LengthModel(lengths, prior_mean=None, max_new=2000)
    assert 480 < model.expected(0) < 600
    assert model.expected(150) > 900  # past every short one: it is a long one
    assert 1900 < model.expected(1900) <= 2000
    assert model.expected(5000) == 2000  # capped at max_new_tokens
    assert LengthModel([], prior_mean=300, max_new=4000).expected(0) in range(280, 320)


def test_prior_sample_has_the_requested_mean() -> None:
    points = prior_sample(3800, 16384)
    assert abs(sum(points) / len(points) - 3800) / 3800 < 0.1


def test_rate_tracker() -> None:
    rt = RateTracker()
    assert rt.progress(10) == 0.0
    rt.observe(100, 2.0)
    assert rt.progress(1.0) == 50.0


def test_state_has_room(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "strict", 150, max_new=100)
    assert ledger.state("ds").has_room()
    ledger.admit("ds", "s0-0", cid)
    assert not ledger.state("ds").has_room()


def test_running_requests_count_as_censored_lengths() -> None:
    """Early in a run the finished requests are the short ones; the running ones say the rest are long."""
    naive = LengthModel([100] * 500, prior_mean=None, max_new=4000)
    km = LengthModel([100] * 500, prior_mean=None, max_new=4000, running=[2000] * 500)
    assert naive.expected(0) < 200
    assert km.expected(0) > 1000
    assert km.expected(2500) > 2500 and km.expected(2500) <= 4000
    # A survival curve that never drops to zero before the cap ends at the cap.
    assert LengthModel([], None, 1000, running=[999] * 100).expected(999) == 1000


def test_predict_margin_grows_with_requests_in_flight(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "predict", 1000, size=20)
    # No request in flight: no margin, so an idle dataset under its budget always admits.
    assert ledger.admit("ds", "s0-0", cid, expected=100, margin=300).verdict is Admit.START
    # One in flight: 100 reserved + 300 x sqrt(1) = 400 < 1000.
    assert ledger.admit("ds", "s0-1", cid, expected=100, margin=300).verdict is Admit.START
    # Two in flight: 200 + 300 x sqrt(2) = 624 < 1000; three: 300 + 300 x sqrt(3) = 820 < 1000;
    # four: 400 + 600 = 1000, not below the budget: full.
    assert ledger.admit("ds", "s0-2", cid, expected=100, margin=300).verdict is Admit.START
    assert ledger.admit("ds", "s0-3", cid, expected=100, margin=300).verdict is Admit.START
    assert ledger.admit("ds", "s0-4", cid, expected=100, margin=300).verdict is Admit.FULL
    assert ledger.admit("ds", "s0-4", cid, expected=100, margin=0).verdict is Admit.START


def test_length_model_sd() -> None:
    model = LengthModel([1000] * 2000, prior_mean=1000, max_new=5000)
    assert model.sd() < 200  # nearly all the same length (the prior adds a little spread)
    wide = LengthModel(prior_sample(3800, 16384, points=2000), prior_mean=3800, max_new=16384)
    assert 2000 < wide.sd() < 4500  # lognormal sigma 0.8: sd about 0.9 x mean


def test_taper_counts_the_new_request_and_the_spread_after_it(r: "redis.Redis") -> None:
    ledger, (cid,) = setup(r, "predict", 300, size=10)
    # Idle: starts, whatever the taper says (0 + 0 + 100 + 300 > 300): an idle dataset never stalls.
    assert ledger.admit("ds", "s0-0", cid, expected=100, margin=0, taper=300).verdict is Admit.START
    # One in flight: 100 + 100 + 300 x sqrt(2) > 300: the taper stops it; the margin rule alone starts it.
    assert ledger.admit("ds", "s0-1", cid, expected=100, margin=0, taper=300).verdict is Admit.FULL
    assert ledger.admit("ds", "s0-1", cid, expected=100, margin=0, taper=0).verdict is Admit.START
    # Both end: used 280, nothing in flight: one more starts, so predict still reaches its budget.
    ledger.commit("ds", "s0-0", 150, {}, chunk=cid, reserved=100, finish_reason="stop")
    ledger.commit("ds", "s0-1", 130, {}, chunk=cid, reserved=100, finish_reason="stop")
    assert ledger.admit("ds", "s0-2", cid, expected=100, margin=0, taper=300).verdict is Admit.START


def test_taper_counts_the_samples_before_it_in_one_admission_batch(r: "redis.Redis") -> None:
    """A chunk's free slots are admitted by one script run: near the close, that run must not start them all."""
    ledger, (tapered, untapered) = setup(r, "predict", 1000, chunks=2, size=10)
    verdicts = run(ledger.admit_call("ds", [f"s0-{i}" for i in range(10)], tapered, expected=100,
                                            margin=0, taper=100))
    # k-th start (k-1 before it): 100 (k-1) + 100 + 100 sqrt(k) <= 1000 holds up to k = 7 (964.6); 8: 1082.8.
    assert [v.verdict for v in verdicts] == [Admit.START] * 7 + [Admit.FULL] * 3  # the rest share the refusal
    assert ledger.state("ds").reserved == 700
    for i in range(7):
        ledger.commit("ds", f"s0-{i}", 0, {}, chunk=tapered, reserved=100, finish_reason="stop")
    verdicts = run(ledger.admit_call("ds", [f"s1-{i}" for i in range(10)], untapered, expected=100))
    assert [v.verdict for v in verdicts] == [Admit.START] * 10  # the old rule: held < budget, 900 < 1000


@pytest.mark.parametrize("seed", range(3))
def test_predict_admits_mirrors_the_admit_script(r: "redis.Redis", seed: int) -> None:
    """The pure rule (worker/estimate.py) and the script decide alike over random states."""
    rng = random.Random(seed)
    for case in range(60):
        r.flushdb()
        budget = rng.randrange(200, 5000)
        ledger, (cid,) = setup(r, "predict", budget, size=40)
        expected, margin, taper = rng.randrange(1, 400), rng.choice([0.0, 50.0, 200.0]), rng.choice([0.0, 100.0, 300.0])
        n = rng.randrange(0, 12)
        if n:
            run(ledger.admit_call("ds", [f"s0-{i}" for i in range(n)], cid, expected=1))
            ledger.refresh_chunk("ds", cid, reserved=rng.randrange(0, budget))
        used = rng.randrange(0, budget)
        r.set(keys.DatasetKeys("ds").used, used)
        state = ledger.state("ds")
        want = predict_admits(used, state.reserved, expected, state.in_flight, budget, margin, taper)
        got = ledger.admit("ds", "s0-39", cid, expected=expected, margin=margin, taper=taper).verdict
        assert got is (Admit.START if want else Admit.FULL), (case, budget, used, state.reserved, state.in_flight)
