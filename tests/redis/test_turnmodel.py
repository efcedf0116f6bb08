"""predict's per-turn length model (worker/estimate.py TurnModels), offline: each turn priced by its own lengths, later turns
weighed by the share of conversations that reach them."""
from __future__ import annotations

import random

import pytest
import redis

from budget.ledger import turn_bucket as bucket
from worker.estimate import CONTINUATION_PRIOR, LengthModel, TurnModels

MAX_NEW = 16384


def lognormal(mean: float, n: int, seed: int) -> list[int]:
    import math
    rng = random.Random(seed)
    mu = math.log(mean) - 0.8 ** 2 / 2
    return [min(MAX_NEW, max(1, round(rng.lognormvariate(mu, 0.8)))) for _ in range(n)]


def test_buckets() -> None:
    assert [bucket(t) for t in (0, 1, 2, 3, 4, 9)] == [0, 1, 2, 3, 3, 3]


def test_each_turn_is_priced_by_its_own_lengths() -> None:
    """Turns 0, 1, 2 answering 1000, 3000 and 6000 tokens on average: the model of each is near its own mean, not
    the pooled one (3333), and a new 3-turn conversation reserves about their sum."""
    per_turn = [lognormal(1000, 2000, 1), lognormal(3000, 2000, 2), lognormal(6000, 2000, 3)]
    pooled = LengthModel([x for xs in per_turn for x in xs], None, MAX_NEW)
    models = TurnModels.build(pooled, per_turn, {})
    for turn, mean in enumerate((1000, 3000, 6000)):
        assert models.model(turn).mean() == pytest.approx(mean, rel=0.1)
    assert models.conversation(3) == pytest.approx(10000, rel=0.1)
    assert models.future(1, 3) == pytest.approx(6000, rel=0.1)  # turn 1 running: only turn 2 is still to come
    assert models.future(2, 3) == 0
    # the pooled model's price for the same conversation is 3 x 3333: the bias this model removes
    assert 3 * pooled.expected(0) == pytest.approx(10000, rel=0.1)  # equal at turn 0 ...
    assert pooled.expected(0) < 0.7 * models.future(1, 3)  # ... but turn 2 alone costs 1.8x the pooled mean


def test_a_turn_without_lengths_of_its_own_is_priced_as_the_pooled_model() -> None:
    pooled = LengthModel(lognormal(2000, 1000, 4), None, MAX_NEW)
    models = TurnModels.build(pooled, [], {})
    for turn in range(5):
        assert models.model(turn).mean() == pytest.approx(pooled.mean(), rel=0.05)


def test_later_turns_are_weighed_by_the_share_that_reaches_them() -> None:
    """Half the conversations that could go on to turn 1 did, a quarter of those to turn 2."""
    pooled = LengthModel([1000] * 500, None, MAX_NEW)
    counts = {"offered:1": 4000, "reached:1": 2000, "offered:2": 2000, "reached:2": 500}
    models = TurnModels.build(pooled, [[1000] * 500] * 3, counts)
    assert models.continuation[1] == pytest.approx((2000 + CONTINUATION_PRIOR) / (4000 + CONTINUATION_PRIOR))
    expected = models.model(1).reserve(0, 0) * 0.5 + models.model(2).reserve(0, 0) * 0.5 * 0.25
    assert models.future(0, 3) == pytest.approx(expected, rel=0.01)
    # before any conversation ended, every planned turn is reserved whole (the upper bound)
    assert TurnModels.build(pooled, [[1000] * 500] * 3, {}).continuation == (1.0, 1.0, 1.0, 1.0)


def test_the_running_turn_is_priced_as_a_request_that_has_run_that_long() -> None:
    per_turn = [lognormal(1000, 3000, 5), lognormal(4000, 3000, 6)]
    models = TurnModels.build(LengthModel(per_turn[0] + per_turn[1], None, MAX_NEW), per_turn, {})
    assert models.current(1, 0) == pytest.approx(4000, rel=0.1)
    assert models.current(1, 8000) > 8000 > models.current(0, 0)
    assert models.current(1, MAX_NEW) == MAX_NEW


def test_the_model_error_is_added_per_turn() -> None:
    per_turn = [[1000] * 40, [3000] * 40]  # 80 lengths: past the young model's max_new_tokens (MIN_OBSERVED)
    pooled = LengthModel(per_turn[0] + per_turn[1], None, MAX_NEW)
    plain, careful = TurnModels.build(pooled, per_turn, {}), TurnModels.build(pooled, per_turn, {}, z=2.0)
    assert careful.conversation(2) > plain.conversation(2)


# -- what Redis keeps for it (budget/scripts.py COMMIT_TURN, END_CONVERSATION, LENGTH_SAMPLE) ------------------------
def test_turn_lengths_and_how_far_conversations_go_are_kept_and_read_back(r: "redis.Redis") -> None:
    """commit_turn pushes each turn's length to its turn's list too (the fourth turn and later share one);
    end_conversation counts, for each later turn it planned, whether the conversation could go on and whether it
    did, only when told what it planned; length_sample reads both back in one script."""
    from budget import keys
    from budget.ledger import Ledger
    ledger = Ledger(r)
    ledger.set_budget("ds", None)
    rec = {"response": "x", "finish_reason": "stop", "completion_tokens": 0}
    for turn, tokens in enumerate((10, 20, 30, 40, 50)):  # a 5-turn conversation, planned 6 turns
        assert ledger.commit_turn("ds", "a", turn, tokens, rec | {"completion_tokens": tokens}).committed
    for turn, tokens in enumerate((11, 21)):  # a 2-turn one, planned 3, ended by the budget: says nothing
        assert ledger.commit_turn("ds", "b", turn, tokens, rec | {"completion_tokens": tokens}).committed
    k = keys.DatasetKeys("ds")
    assert [[int(x) for x in r.lrange(key, 0, -1)] for key in k.turn_lengths] == [[11, 10], [21, 20], [30], [50, 40]]
    header = {"stopped_by": None}
    assert ledger.end_conversation("ds", "a", 5, header, planned=6).verdict.name == "ENDED"
    assert ledger.end_conversation("ds", "b", 2, header | {"stopped_by": "budget"}).verdict.name == "ENDED"
    sample = ledger.length_sample("ds")
    assert sample.per_turn == [[11, 10], [21, 20], [30], [50, 40]]
    # turns 1..5 planned after turn 0; it reached turns 1..4: offered 1, 2, 3 (x3: turns 3, 4, 5), reached 1, 2,
    # 3 (x2: turns 3, 4)
    assert sample.turn_counts == {"reached:1": 1, "offered:1": 1, "reached:2": 1, "offered:2": 1,
                                  "reached:3": 2, "offered:3": 3}
    models = TurnModels.build(LengthModel(sample.lengths, None, MAX_NEW), sample.per_turn, sample.turn_counts)
    assert models.continuation[3] == pytest.approx((2 + CONTINUATION_PRIOR) / (3 + CONTINUATION_PRIOR))


def test_running_turns_progress_is_kept_by_turn_and_dropped_with_the_chunk(r: "redis.Redis") -> None:
    """refresh_chunk keeps a chunk's one-turn progress in its own field and its conversations' running turns in a
    field per turn bucket: the pooled model still sees every running request once (an older worker reads every
    field), each per-turn model sees its own; finish_chunk and reclaim drop them all."""
    from budget import keys
    from budget.ledger import Ledger
    ledger = Ledger(r)
    ledger.set_budget("ds", None)
    k = keys.DatasetKeys("ds")
    for chunk in ("c1", "c2"):
        r.zadd(k.chunks, {chunk: "+inf"})
        r.hset(k.resv, chunk, 0)
    assert ledger.start_chunk("ds", "c1") == "ok" and ledger.start_chunk("ds", "c2") == "ok"
    from budget.ledger import run
    assert run(ledger.refresh_chunk_call("ds", "c1", reserved=10, progress=[5], turn_progress=[[1], [200], [], [9]]))
    assert run(ledger.refresh_chunk_call("ds", "c2", reserved=10, progress=[7]))
    sample = ledger.length_sample("ds")
    assert sorted(sample.running) == [1, 5, 7, 9, 200]
    assert sample.turn_running == [[1], [200], [], [9]]
    ledger.finish_chunk("ds", "c1")
    assert r.hkeys(k.progress) == [b"c2"]
    assert ledger.length_sample("ds").turn_running == [[], [], [], []]


def test_a_conversations_spread_adds_its_turns_spreads_in_quadrature() -> None:
    """predict's margin and taper for a new conversation are multiples of its whole spread: with turns alike,
    sqrt(turns) x one turn's; with later turns longer (and wider), more; weighed by the share that gets there."""
    import math
    same = [lognormal(3800, 3000, 7)] * 3
    models = TurnModels.build(LengthModel(same[0], None, MAX_NEW), same, {})
    one = models.model(0).sd()
    assert models.sd(1) == pytest.approx(one)
    assert models.sd(3) == pytest.approx(math.sqrt(3) * one, rel=0.01)
    wider = [lognormal(3800, 3000, 8), lognormal(7600, 3000, 9), lognormal(11400, 3000, 10)]
    assert TurnModels.build(LengthModel(wider[0], None, MAX_NEW), wider, {}).sd(3) > 2 * models.sd(3) / math.sqrt(3)
    half = TurnModels.build(LengthModel(same[0], None, MAX_NEW), same,
                            {"offered:1": 1000, "reached:1": 0, "offered:2": 1000, "reached:2": 0})
    assert half.sd(3) < models.sd(2)  # almost none go on: little more than turn 0's spread
