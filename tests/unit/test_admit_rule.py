"""predict's admission rule pinned: budget/scripts.py ADMIT, run on a real redis-server, answers as its Python
mirror worker/estimate.py ``predict_admits`` does, for fixed ledger states on a property grid (issue 24, step 3).

The state is written straight into the dataset's keys (used, every chunk's reservation and requests in flight),
so a case is any state the ledger can be in, other chunks' included; then one admit call decides a batch of the
chunk's samples in order. The mirror of a batch is ``predict_admits`` applied sample after sample, each seeing the
ones before it as reserved and in flight, up to the first refusal (the samples after it share it).

ADMIT receives margin and taper rounded to 0.1 token (budget/ledger.py ``admit_call``), so the mirror is given the
rounded values: that is the rule the script runs. No timing anywhere.
"""
from __future__ import annotations

import math
from typing import Iterator

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from budget import keys
from budget.ledger import Admit, Ledger, run
from producer.session.attach import JobSettings
from producer.session.loop import Item, enqueue_chunks, make_queue
from worker.estimate import predict_admits

BATCH = 8  # samples in the chunk under test: a worker's free slots admitted by one script run


@pytest.fixture
def ledger_chunk(r: "redis.Redis") -> Iterator[tuple[Ledger, str]]:
    """A predict dataset with one started chunk of BATCH pending samples (the budget is set per case)."""
    r.flushdb()
    ledger = Ledger(r)
    ledger.set_mode("ds", "predict", 2048)
    ledger.set_budget("ds", 10**9)
    (cid,) = enqueue_chunks(r, make_queue(r), "ds", [[Item(f"s{i}", [1], False) for i in range(BATCH)]],
                            sampling_params={"max_new_tokens": 2048}, think=None, settings=JobSettings())
    assert ledger.start_chunk("ds", cid) == "ok"
    yield ledger, cid


def mirror(used: int, reserved: int, expected: int, in_flight: int, budget: int, margin: float, taper: float,
           n: int) -> list[bool]:
    """``predict_admits`` over a batch of n, as ADMIT decides it: each start adds to reserved and in flight."""
    out: list[bool] = []
    for k in range(n):
        ok = predict_admits(used, reserved + k * expected, expected, in_flight + k, budget, margin, taper)
        out.append(ok)
        if not ok:
            break
    return out + [False] * (n - len(out))


def decide(ledger: Ledger, cid: str, used: int, own: tuple[int, int], others: list[tuple[int, int]], budget: int,
           expected: int, margin: float, taper: float, n: int) -> list[bool]:
    """Write the state (this chunk's and other chunks' (reserved, in flight)), run ADMIT on n samples."""
    r = ledger.r
    k = keys.DatasetKeys("ds")
    r.set(k.used, 0)
    ledger.set_budget("ds", budget)  # with used 0: the dataset stays open
    r.set(k.used, used)
    r.delete(k.resv, k.inflight)
    r.hset(k.resv, cid, own[0])
    r.hset(k.inflight, cid, own[1])
    for i, (res, fl) in enumerate(others):
        r.hset(k.resv, f"other-{i}", res)
        r.hset(k.inflight, f"other-{i}", fl)
    verdicts = run(ledger.admit_call("ds", [f"s{i}" for i in range(n)], cid, expected=expected, margin=margin,
                                     taper=taper))
    assert all(v.verdict in (Admit.START, Admit.FULL) for v in verdicts), verdicts
    return [v.verdict is Admit.START for v in verdicts]


tenths = st.integers(0, 40_000).map(lambda x: x / 10)  # what admit_call sends: 0.1-token resolution
flights = st.tuples(st.integers(0, 200_000), st.integers(0, 300))


@st.composite
def states(draw: st.DrawFn) -> tuple[int, tuple[int, int], list[tuple[int, int]], int, int, float, float, int]:
    used = draw(st.integers(0, 2_000_000))
    own = draw(flights)
    others = draw(st.lists(flights, max_size=3))
    expected = draw(st.integers(1, 16_384))
    margin = draw(st.one_of(st.just(0.0), tenths))
    taper = draw(st.one_of(st.just(0.0), tenths))
    n = draw(st.integers(1, BATCH))
    reserved = own[0] + sum(x for x, _ in others)
    in_flight = own[1] + sum(x for _, x in others)
    # The budget near where the decision turns (either rule's boundary, for some k of the batch, to the token)
    # or anywhere: boundaries are where a mirror and its script would part.
    k = draw(st.integers(0, n - 1))
    edge_margin = used + reserved + k * expected + margin * math.sqrt(in_flight + k)
    edge_taper = used + reserved + (k + 1) * expected + taper * math.sqrt(in_flight + k + 1)
    budget = draw(st.one_of(
        st.integers(1, 3_000_000),
        st.sampled_from([math.floor(edge_margin), math.ceil(edge_margin), math.floor(edge_taper), math.ceil(edge_taper)])
        .flatmap(lambda b: st.integers(max(1, b - 2), b + 2))))
    return used, own, others, budget, expected, margin, taper, n


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(states())
# an idle dataset under its budget starts one whatever the taper; the next waits for the taper's room
@example((0, (0, 0), [], 1000, 900, 0.0, 500.0, 2))
# exactly on the margin rule's boundary (>= refuses) and on the taper's (<= admits)
@example((500, (100, 4), [], 700, 10, 50.0, 0.0, 1))
@example((400, (100, 3), [], 700, 100, 0.0, 50.0, 2))
def test_admit_script_answers_as_predict_admits(ledger_chunk: tuple[Ledger, str], state: tuple) -> None:
    ledger, cid = ledger_chunk
    used, own, others, budget, expected, margin, taper, n = state
    reserved = own[0] + sum(x for x, _ in others)
    in_flight = own[1] + sum(x for _, x in others)
    want = mirror(used, reserved, expected, in_flight, budget, margin, taper, n)
    got = decide(ledger, cid, used, own, others, budget, expected, margin, taper, n)
    assert got == want, (used, reserved, in_flight, budget, expected, margin, taper)


def test_the_examples_sit_where_the_rule_turns() -> None:
    """The pinned examples above mean what their comments say (the mirror alone)."""
    assert mirror(0, 0, 900, 0, 1000, 0.0, 500.0, 2) == [True, False]
    assert not predict_admits(500, 100, 10, 4, 700, 50.0, 0.0)  # 500 + 100 + 50 x 2 = 700 >= 700
    # 400 + 100 + 100 + 50 x sqrt(4) = 700 <= 700 starts; the next, 800 + 50 x sqrt(5) > 700, does not
    assert mirror(400, 100, 100, 3, 700, 0.0, 50.0, 2) == [True, False]
