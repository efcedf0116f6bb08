"""Ledger calls in one round trip (budget/ledger.py run_many, worker/batch.py) on a real redis-server."""
from __future__ import annotations

import asyncio

import pytest
import redis

from budget import keys
from budget.ledger import Admit, CommitOutcome, Ledger, run_many
from worker.batch import Batcher, BatcherClosed


def test_run_many_gives_each_call_its_own_reply(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget("ds", 20)
    calls = [ledger.commit_call("ds", f"s{i}", 8, {"id": f"s{i}"}) for i in range(3)]
    calls.append(ledger.commit_call("ds", "s0", 8, {"id": "s0"}))  # a resend in the same batch
    outcomes = run_many(r, calls)
    assert [o.committed for o in outcomes] == [True, True, True, False]
    assert [o.closed_now for o in outcomes] == [False, False, True, False]
    assert int(r.get(keys.DatasetKeys("ds").used) or 0) == 24


def test_run_many_a_refused_call_does_not_stop_the_others(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget("ds", None)
    r.set(keys.DatasetKeys("bad").used, "not a number")  # INCRBY on it fails inside the script
    replies = run_many(r, [ledger.commit_call("ds", "a", 5, {}), ledger.commit_call("bad", "b", 5, {}),
                           ledger.commit_call("ds", "c", 5, {})])
    assert isinstance(replies[0], CommitOutcome) and replies[0].committed
    assert isinstance(replies[1], redis.ResponseError)
    assert isinstance(replies[2], CommitOutcome) and replies[2].used == 10


def test_run_many_reloads_scripts_redis_forgot(r: "redis.Redis") -> None:
    """After a Redis restart (or SCRIPT FLUSH) every EVALSHA gets NOSCRIPT: the scripts are loaded and the
    calls sent again, each running exactly once."""
    ledger = Ledger(r)
    ledger.set_budget("ds", None)
    r.hset(keys.DatasetKeys("ds").pending, "f", "c1")  # chunk c1 holds sample f, so its failure is recorded
    r.script_flush()  # our own session server (tests/conftest.py)
    outcomes = run_many(r, [ledger.commit_call("ds", f"s{i}", 3, {}) for i in range(4)]
                        + [ledger.fail_call("ds", "f", "c1", {"reason": "x"})])
    assert [o.committed for o in outcomes[:4]] == [True] * 4
    assert outcomes[4] is True
    k = keys.DatasetKeys("ds")
    assert int(r.get(k.used) or 0) == 12 and r.xlen(k.results) == 4 and r.hlen(k.failed) == 1


def test_batcher_sends_calls_of_one_loop_iteration_together(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget("ds", 1000)

    async def main() -> tuple[list[CommitOutcome], Batcher]:
        batcher = Batcher(r)
        outcomes = await asyncio.gather(*(batcher.call(ledger.commit_call("ds", f"s{i}", 10, {}))
                                          for i in range(50)))
        await batcher.aclose()
        return list(outcomes), batcher

    outcomes, batcher = asyncio.run(main())
    assert all(o.committed for o in outcomes)
    assert sorted(o.used for o in outcomes) == list(range(10, 501, 10))
    assert (batcher.batches, batcher.calls) == (1, 50)


def test_batcher_caps_a_batch(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget("ds", None)

    async def main() -> Batcher:
        batcher = Batcher(r, max_batch=8)
        await asyncio.gather(*(batcher.call(ledger.commit_call("ds", f"s{i}", 1, {})) for i in range(20)))
        await batcher.aclose()
        return batcher

    batcher = asyncio.run(main())
    assert (batcher.batches, batcher.calls) == (3, 20)
    assert int(r.get(keys.DatasetKeys("ds").used) or 0) == 20


def test_batcher_hands_a_connection_error_to_every_caller(redis_url: str) -> None:
    """The dispatcher retries on REDIS_DOWN (worker/batch.py ``until_answered``); it must see the error, not hang."""
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing listens on port 1
    ledger = Ledger(dead)

    async def main() -> list[object]:
        batcher = Batcher(dead)
        try:
            return list(await asyncio.gather(
                *(batcher.call(ledger.admit_call("ds", [f"s{i}"], "c")) for i in range(3)), return_exceptions=True))
        finally:
            await batcher.aclose()
    
    results = asyncio.run(main())
    assert len(results) == 3 and all(isinstance(e, redis.ConnectionError) for e in results)


def test_batcher_sends_calls_made_while_a_batch_is_in_flight_next(r: "redis.Redis") -> None:
    """While one batch is on its way to Redis the loop goes on; what it asks meanwhile goes in the next batch,
    and every call is answered exactly once."""
    ledger = Ledger(r)
    ledger.set_budget("ds", None)

    async def main() -> tuple[Batcher, list[CommitOutcome]]:
        batcher = Batcher(r)
        first = [batcher.call(ledger.commit_call("ds", f"a{i}", 1, {})) for i in range(10)]
        await asyncio.sleep(0)  # the first batch leaves: the ledger thread has it
        assert batcher.batches == 1
        second = [batcher.call(ledger.commit_call("ds", f"b{i}", 1, {})) for i in range(10)]
        outcomes = await asyncio.gather(*first, *second)
        await batcher.aclose()
        return batcher, list(outcomes)

    batcher, outcomes = asyncio.run(main())
    assert all(o.committed for o in outcomes) and len(outcomes) == 20
    assert (batcher.batches, batcher.calls) == (2, 20)
    assert int(r.get(keys.DatasetKeys("ds").used) or 0) == 20


def test_admissions_in_one_call_match_one_by_one(r: "redis.Redis") -> None:
    """A strict budget with room for exactly two requests: of five samples admitted in one call, the first two
    start and the rest are refused, as when admitted one at a time; a committed sample is skipped without
    stopping the ones after it."""
    from producer.session.attach import JobSettings
    from producer.session.loop import Item, enqueue_chunks, make_queue
    ledger = Ledger(r)
    for name in ("one", "many"):
        ledger.set_budget(name, 20)
        ledger.set_mode(name, "strict", 10)
        [cid] = enqueue_chunks(r, make_queue(r), name, [[Item(f"s{i}", [1], False) for i in range(6)]],
                               sampling_params={"max_new_tokens": 10}, think=None, settings=JobSettings())
        assert ledger.start_chunk(name, cid) == "ok"
        ledger.commit(name, "s1", 0, {})  # s1 is done: skipped, not refused
        ids = [f"s{i}" for i in range(6)]
        if name == "one":
            verdicts = [ledger.admit(name, sid, cid) for sid in ids]
        else:
            [verdicts] = run_many(r, [ledger.admit_call(name, ids, cid)])
        assert [v.verdict for v in verdicts] == [Admit.START, Admit.SKIP, Admit.START, Admit.FULL, Admit.FULL,
                                                 Admit.FULL], name
        assert [v.reserved for v in verdicts] == [10, 0, 10, 0, 0, 0]
        assert ledger.state(name).reserved == 20
        assert ledger.state(name).in_flight == 2


def test_admit_call_takes_a_list(r: "redis.Redis") -> None:
    with pytest.raises(TypeError):
        Ledger(r).admit_call("ds", "s0", "c")


def test_commits_of_one_dataset_go_as_one_script_run(r: "redis.Redis") -> None:
    """Commits sharing a dataset merge into one EVALSHA (Call.merge); each caller still gets its own outcome,
    in order, and the datasets stay apart."""
    ledger = Ledger(r)
    ledger.set_budget("a", 25)
    ledger.set_budget("b", None)
    calls = [ledger.commit_call(name, f"s{i}", 10, {"id": f"s{i}"}) for i in range(4) for name in ("a", "b")]
    calls.append(ledger.commit_call("a", "s0", 10, {"id": "s0"}))  # a resend, merged with its original
    before = _evalsha_calls(r)
    outcomes = run_many(r, calls)
    assert _evalsha_calls(r) - before == 2  # one per dataset
    a, b = outcomes[0:8:2] + outcomes[8:], outcomes[1:8:2]
    assert [(o.committed, o.used, o.closed_now) for o in a] == [
        (True, 10, False), (True, 20, False), (True, 30, True), (True, 40, False), (False, 40, False)]
    assert [(o.committed, o.used) for o in b] == [(True, 10), (True, 20), (True, 30), (True, 40)]
    assert r.xlen(keys.DatasetKeys("a").results) == 4 and r.xlen(keys.DatasetKeys("b").results) == 4


def _evalsha_calls(r: "redis.Redis") -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.mark.parametrize("n", [1, 3])
def test_run_many_of_a_single_or_few_calls(r: "redis.Redis", n: int) -> None:
    ledger = Ledger(r)
    ledger.set_budget("ds", None)
    assert len(run_many(r, [ledger.commit_call("ds", f"s{i}", 1, {}) for i in range(n)])) == n
    assert run_many(r, []) == []


def test_closing_sends_what_is_queued_and_later_calls_fail_clearly(r: "redis.Redis") -> None:
    """A worker shutting down may still have a fire-and-forget call queued behind a batch in flight (a job's
    progress meta). Closing sends it and waits; a call after the close fails with BatcherClosed. Before, the
    thread was stopped under the in-flight batch, and its reply's callback raised "cannot schedule new futures
    after shutdown" in the worker's log, leaving the queued call's future unresolved."""
    ledger = Ledger(r)
    ledger.set_budget("ds", None)

    async def main() -> tuple[list[asyncio.Future[CommitOutcome]], asyncio.Future[CommitOutcome]]:
        batcher = Batcher(r)
        first = batcher.call(ledger.commit_call("ds", "a", 1, {}))
        await asyncio.sleep(0)  # the first batch leaves: the ledger thread has it
        assert batcher.batches == 1
        queued = batcher.call(ledger.commit_call("ds", "b", 1, {}))  # not awaited, as Dispatcher._write_meta does
        await batcher.aclose()
        late = batcher.call(ledger.commit_call("ds", "c", 1, {}))
        return [first, queued], late

    sent, late = asyncio.run(main())
    assert all(f.done() and f.result().committed for f in sent)
    assert isinstance(late.exception(), BatcherClosed)
    assert int(r.get(keys.DatasetKeys("ds").used) or 0) == 2
