"""commit_turn on a real redis-server: each (conversation, turn) counted once under duplicates, racing workers
and a resend after a lost reply; committed turns stay in Redis (docs/multiturn.md). Nothing calls it yet."""
from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis

from budget import keys, scripts
from budget.ledger import Ledger, TurnVerdict
from budget.runstate import RunState

DS = "conv"


def turn(sample: str, i: int, tokens: int, **extra: Any) -> dict[str, Any]:
    return {"response": f"answer {i} of {sample}", "completion_tokens": tokens, "finish_reason": "stop",
            "output_ids": list(range(tokens)), **extra}


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def audit(r: "redis.Redis", ledger: Ledger) -> None:
    """The invariant: used = Σ done + Σ committed turns not yet written."""
    k = keys.DatasetKeys(DS)
    done = sum(int(v) for v in r.hvals(k.done))
    assert int(r.get(k.used) or 0) == done + ledger.unwritten_turn_tokens(DS)


def test_turns_commit_in_order_and_stay_in_redis(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    outcomes = [ledger.commit_turn(DS, "c1", i, 10 + i, turn("c1", i, 10 + i)) for i in range(3)]
    assert [o.verdict for o in outcomes] == [TurnVerdict.COMMITTED] * 3
    assert [o.used for o in outcomes] == [10, 21, 33]
    k = keys.DatasetKeys(DS)
    assert int(r.hget(k.convs, "c1") or 0) == 3
    # The field Lua builds is budget/keys.py's turn_field, and the record is kept byte for byte.
    assert r.hget(k.turns, keys.turn_field("c1", 2)) == b"12"
    assert ledger.committed_turns(DS, "c1") == [turn("c1", i, 10 + i) for i in range(3)]
    assert r.hlen(k.done) == 0 and r.xlen(k.results) == 0  # nothing is written until the conversation ends
    stats = {text(a): text(b) for a, b in r.hgetall(k.stats).items()}
    assert stats["turns"] == "3" and stats["finish_stop"] == "3"
    audit(r, ledger)


def test_a_duplicate_or_out_of_order_turn_changes_nothing(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    assert ledger.commit_turn(DS, "c1", 0, 5, turn("c1", 0, 5)).committed
    k = keys.DatasetKeys(DS)
    before = {key: r.dump(key) for key in (k.used, k.turns, k.turnrec, k.convs, k.lengths)}
    dup = ledger.commit_turn(DS, "c1", 0, 9, turn("c1", 0, 9, response="another answer"))
    assert dup.verdict is TurnVerdict.DUPLICATE and dup.used == 5
    skipped = ledger.commit_turn(DS, "c1", 2, 7, turn("c1", 2, 7))  # turn 1 is not committed
    assert skipped.verdict is TurnVerdict.OUT_OF_ORDER and skipped.used == 5
    assert ledger.commit_turn(DS, "c2", 1, 7, turn("c2", 1, 7)).verdict is TurnVerdict.OUT_OF_ORDER
    assert {key: r.dump(key) for key in before} == before
    assert r.hget(k.convs, "c2") is None
    # A conversation already written (its id in done) takes no more turns, not even its first again.
    r.hset(k.done, "c3", 4)
    r.incrby(k.used, 4)
    assert ledger.commit_turn(DS, "c3", 0, 4, turn("c3", 0, 4)).verdict is TurnVerdict.DUPLICATE
    assert int(r.get(k.used) or 0) == 9
    audit(r, ledger)


def test_sample_keys_with_any_printable_character_do_not_collide(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    # Ids with spaces, tabs, colons, digits, non-ASCII, JSON: the turn's digits come first, so fields never meet.
    for sample in ("1", "0 1", "1\t", "x:0", "x", "ü/é", "[\"a\", 1]"):
        assert ledger.commit_turn(DS, sample, 0, 3, turn(sample, 0, 3)).committed
        assert ledger.commit_turn(DS, sample, 1, 3, turn(sample, 1, 3)).committed
    k = keys.DatasetKeys(DS)
    assert r.hlen(k.turns) == 14 and r.hlen(k.convs) == 7
    for raw in r.hkeys(k.turns):
        field = text(raw)
        t, _, sample = field.partition(keys.TURN_SEP)
        assert keys.turn_field(sample, int(t)) == field


def test_racing_workers_commit_each_turn_once(r: "redis.Redis", redis_url: str) -> None:
    """Four workers run the same 40 conversations of 5 turns (a reclaimed chunk and its zombie, an RQ retry):
    each turn is committed by exactly one of them, and used counts exactly the winners' tokens."""
    Ledger(r).set_budget(DS, None)
    conversations, turns_each, workers = 40, 5, 4
    verdicts: list[TurnVerdict] = []
    lock = threading.Lock()
    go = threading.Barrier(workers)

    def worker(w: int) -> None:
        ledger = Ledger(redis.Redis.from_url(redis_url))
        go.wait()
        for c in range(conversations):
            for i in range(turns_each):
                # Tokens differ per worker, so a turn counted twice, or counted with a loser's tokens, shows.
                tokens = 10 * (w + 1) + i
                out = ledger.commit_turn(DS, f"c{c}", i, tokens, turn(f"c{c}", i, tokens, worker=w))
                with lock:
                    verdicts.append(out.verdict)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ledger = Ledger(r)
    total = conversations * turns_each
    assert verdicts.count(TurnVerdict.COMMITTED) == total
    assert verdicts.count(TurnVerdict.DUPLICATE) == total * (workers - 1)
    k = keys.DatasetKeys(DS)
    winners = 0
    for c in range(conversations):
        recs = ledger.committed_turns(DS, f"c{c}")
        assert len(recs) == turns_each
        for i, rec in enumerate(recs):
            assert int(r.hget(k.turns, keys.turn_field(f"c{c}", i)) or 0) == rec["completion_tokens"]
            winners += rec["completion_tokens"]
    assert int(r.get(k.used) or 0) == winners
    audit(r, ledger)


def test_a_resend_after_a_lost_reply_counts_once(r: "redis.Redis", redis_url: str) -> None:
    """The command reaches Redis and runs, the reply never reaches the client (its connection drops); the client
    sends it again, as redis-py's retry does: the second run is a duplicate."""
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    assert ledger.commit_turn(DS, "c1", 0, 6, turn("c1", 0, 6)).committed
    call = ledger.commit_turn_call(DS, "c1", 1, 8, turn("c1", 1, 8))
    r.script_load(scripts.COMMIT_TURN)
    conn = redis.Redis.from_url(redis_url).connection_pool.get_connection("EVALSHA")
    conn.send_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    k = keys.DatasetKeys(DS)
    field = keys.turn_field("c1", 1)
    deadline = time.monotonic() + 30  # a backstop only: we wait for the turn to land
    while not r.hexists(k.turns, field):
        assert time.monotonic() < deadline, "the first send never ran"
        time.sleep(0.01)
    conn.disconnect()  # its reply is never read
    again = ledger.run(call)
    assert again.verdict is TurnVerdict.DUPLICATE and again.used == 14
    assert int(r.get(k.used) or 0) == 14 and int(r.hget(k.convs, "c1") or 0) == 2
    audit(r, ledger)


def test_commits_batched_in_one_round_trip_are_decided_in_order(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    calls = [ledger.commit_turn_call(DS, "c1", 0, 4, turn("c1", 0, 4)),
             ledger.commit_turn_call(DS, "c1", 1, 5, turn("c1", 1, 5)),
             ledger.commit_turn_call(DS, "c1", 1, 6, turn("c1", 1, 6)),
             ledger.commit_turn_call(DS, "c2", 0, 7, turn("c2", 0, 7))]
    out = ledger.run_many(calls)
    assert [o.verdict for o in out] == [TurnVerdict.COMMITTED, TurnVerdict.COMMITTED, TurnVerdict.DUPLICATE,
                                        TurnVerdict.COMMITTED]
    assert [o.used for o in out] == [4, 9, 9, 16]
    audit(r, ledger)


def test_a_turn_settles_its_reservation_and_closes_at_the_budget_once(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, 20)
    r.zadd(keys.DatasetKeys(DS).chunks, {"ch": "+inf"})
    assert ledger.start_chunk(DS, "ch") == "ok"
    k = keys.DatasetKeys(DS)
    r.hset(k.resv, "ch", 40)
    r.hset(k.inflight, "ch", 4)
    closes = [ledger.commit_turn(DS, "c1", i, 8, turn("c1", i, 8), chunk="ch", reserved=10).closed_now
              for i in range(3)]
    assert closes == [False, False, True]
    dup = ledger.commit_turn(DS, "c1", 2, 8, turn("c1", 2, 8), chunk="ch", reserved=10)
    assert dup.verdict is TurnVerdict.DUPLICATE and not dup.closed_now
    # Every request ended, the duplicate's too: each gave back what it reserved.
    assert int(r.hget(k.resv, "ch") or 0) == 0 and int(r.hget(k.inflight, "ch") or 0) == 0
    assert ledger.state(DS).status == "closed" and ledger.state(DS).used == 24


def test_bad_turn_arguments_are_refused_before_redis(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError):
            ledger.commit_turn(DS, "c1", bad, 3, {})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ledger.commit_turn(DS, "c1", 0, -3, {})
    assert r.dbsize() == 0


def test_new_run_forgets_committed_turns(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    assert ledger.commit_turn(DS, "c1", 0, 3, turn("c1", 0, 3)).committed
    RunState(r).forget(DS)
    k = keys.DatasetKeys(DS)
    assert not any(r.exists(key) for key in (k.turns, k.turnrec, k.convs))
    assert json.loads(json.dumps(ledger.committed_turns(DS, "c1"))) == []
