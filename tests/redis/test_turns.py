"""The conversation scripts on a real redis-server (docs/multiturn.md): commit_turn counts each (conversation,
turn) once under duplicates, racing workers and a resend after a lost reply; admit_turn's decisions per budget
mode and under a cut budget; end_conversation writes a conversation once, and the collector makes it one record;
reconcile_turns and reopen. The invariant used = Σ done + Σ turns is checked at every step. Nothing calls them
in a run yet."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys, record, scripts
from budget.ledger import EndOutcome, EndVerdict, Ledger, TurnAdmission, TurnAdmit, TurnVerdict, run, run_many
from budget.runstate import RunState
from producer.results import RESULTS, ResultsFile, collect
from tests.replies import entries

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
        t, _, sample = field.partition(keys.SEP)
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
    again = run(call)
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
    out = run_many(r, calls)
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


# -- admit_turn, end_conversation, reconcile_turns, reopen, cut ----------------------------------------------

def hold(r: "redis.Redis", ledger: Ledger, chunk: str, *samples: str) -> None:
    """A running chunk (leased, as a worker's start_chunk leaves it) holding ``samples``."""
    k = keys.DatasetKeys(DS)
    r.zadd(k.chunks, {chunk: "+inf"})
    assert ledger.start_chunk(DS, chunk) == "ok"
    for sample in samples:
        r.hset(k.pending, sample, chunk)


def snapshot(r: "redis.Redis") -> dict[str, Any]:
    k = keys.DatasetKeys(DS)
    return {key: r.dump(key) for key in k.all() if key != k.chunks}  # chunk scores are lease deadlines


def test_admit_turn_in_drain_goes_on_while_closed_and_skips_what_is_not_its(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, 10)
    ledger.set_mode(DS, "drain", 100)
    hold(r, ledger, "ch", "c1", "c2")
    assert ledger.commit_turn(DS, "c1", 0, 12, turn("c1", 0, 12), chunk="ch").closed_now
    assert ledger.state(DS).status == "closed"
    # Closed stops new conversations (admit), not started ones.
    assert ledger.admit(DS, "c2", "ch").verdict.name == "CLOSED"
    assert ledger.admit_turn(DS, "c1", 1, "ch") == TurnAdmission(TurnAdmit.START, 0)
    audit(r, ledger)
    before = snapshot(r)
    assert ledger.admit_turn(DS, "c1", 2, "ch").verdict is TurnAdmit.SKIP  # turn 1 is not committed
    assert ledger.admit_turn(DS, "c2", 1, "ch").verdict is TurnAdmit.SKIP  # never started
    r.hset(keys.DatasetKeys(DS).pending, "c1", "other")
    assert ledger.admit_turn(DS, "c1", 1, "ch").verdict is TurnAdmit.SKIP  # held by another chunk now
    r.hset(keys.DatasetKeys(DS).pending, "c1", "ch")
    assert ledger.admit_turn(DS, "c1", 1, "gone").verdict is TurnAdmit.REVOKED
    k = keys.DatasetKeys(DS)
    assert {key: v for key, v in snapshot(r).items() if key != k.pending} == \
        {key: v for key, v in before.items() if key != k.pending}
    with pytest.raises(ValueError):
        ledger.admit_turn(DS, "c1", 0, "ch")


def test_admit_turn_books_the_reservation_commit_turn_settles(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, 1000)
    ledger.set_mode(DS, "predict", 100)
    hold(r, ledger, "ch", "c1")
    k = keys.DatasetKeys(DS)
    first = ledger.admit(DS, "c1", "ch", expected=30)
    assert first.reserved == 30
    assert ledger.commit_turn(DS, "c1", 0, 20, turn("c1", 0, 20), chunk="ch", reserved=first.reserved).committed
    assert int(r.hget(k.resv, "ch") or 0) == 0 and int(r.hget(k.inflight, "ch") or 0) == 0
    second = ledger.admit_turn(DS, "c1", 1, "ch", reservation=25)
    assert second == TurnAdmission(TurnAdmit.START, 25)
    assert int(r.hget(k.resv, "ch") or 0) == 25 and int(r.hget(k.inflight, "ch") or 0) == 1
    assert ledger.commit_turn(DS, "c1", 1, 22, turn("c1", 1, 22), chunk="ch", reserved=second.reserved).committed
    assert int(r.hget(k.resv, "ch") or 0) == 0 and int(r.hget(k.inflight, "ch") or 0) == 0
    # predict finishes started conversations while closed, too.
    ledger.close(DS)
    assert ledger.state(DS).status == "closed" and r.hget(k.meta, "cut") is None
    assert ledger.admit_turn(DS, "c1", 2, "ch", reservation=25) == TurnAdmission(TurnAdmit.START, 25)
    assert ledger.commit_turn(DS, "c1", 2, 3, turn("c1", 2, 3), chunk="ch", reserved=25).committed
    assert int(r.hget(k.resv, "ch") or 0) == 0 and int(r.hget(k.inflight, "ch") or 0) == 0
    audit(r, ledger)


def test_strict_waits_while_reserved_and_stops_when_a_turn_cannot_fit_alone(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, 100)
    ledger.set_mode(DS, "strict", 30)
    hold(r, ledger, "ch", "c1", "c2")
    k = keys.DatasetKeys(DS)
    for sample in ("c1", "c2"):
        a = ledger.admit(DS, sample, "ch")
        assert a.reserved == 30
        assert ledger.commit_turn(DS, sample, 0, 20, turn(sample, 0, 20), chunk="ch", reserved=30).committed
    # used 40: c1's turn 1 fits (40 + 30 <= 100) and reserves 30.
    assert ledger.admit_turn(DS, "c1", 1, "ch") == TurnAdmission(TurnAdmit.START, 30)
    # c2's would need 40 + 30 reserved + 30 = 100: fits; a third in flight would not.
    assert ledger.admit_turn(DS, "c2", 1, "ch") == TurnAdmission(TurnAdmit.START, 30)
    hold(r, ledger, "ch2", "c3")
    r.hset(k.convs, "c3", 1)  # as if c3 had a committed turn of 0 tokens
    r.hset(k.turns, keys.turn_field("c3", 0), 0)
    r.hset(k.turnrec, keys.turn_field("c3", 0), json.dumps(turn("c3", 0, 0)))
    before = snapshot(r)
    assert ledger.admit_turn(DS, "c3", 1, "ch2") == TurnAdmission(TurnAdmit.FULL, 0)  # wait: may fit later
    assert snapshot(r) == before
    assert ledger.commit_turn(DS, "c1", 1, 30, turn("c1", 1, 30), chunk="ch", reserved=30).committed
    assert ledger.commit_turn(DS, "c2", 1, 25, turn("c2", 1, 25), chunk="ch", reserved=30).committed
    # used 95: 95 + 30 > 100, so no turn can fit even alone: stop with budget, and the dataset is spent.
    assert ledger.admit_turn(DS, "c3", 1, "ch2") == TurnAdmission(TurnAdmit.STOP, 0)
    assert ledger.state(DS).status == "closed"
    assert int(r.hget(k.resv, "ch") or 0) == 0 and int(r.hget(k.resv, "ch2") or 0) == 0
    audit(r, ledger)


def test_a_budget_cut_below_used_stops_every_started_conversation(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, 1000)
    hold(r, ledger, "ch", "c1")
    k = keys.DatasetKeys(DS)
    assert ledger.commit_turn(DS, "c1", 0, 50, turn("c1", 0, 50), chunk="ch").committed
    assert ledger.admit_turn(DS, "c1", 1, "ch").verdict is TurnAdmit.START
    ledger.set_budget(DS, 60)  # lowered, but above used: no cut, only tighter
    assert r.hget(k.meta, "cut") is None
    ledger.set_budget(DS, 40)  # lowered to <= used: cut
    assert r.hget(k.meta, "cut") == b"1" and ledger.state(DS).status == "closed"
    ledger.set_budget(DS, 40)  # the same budget again (a rerun's attach) keeps the cut
    assert r.hget(k.meta, "cut") == b"1"
    for mode in ("drain", "predict", "strict"):
        ledger.set_mode(DS, mode, 10)
        assert ledger.admit_turn(DS, "c1", 1, "ch") == TurnAdmission(TurnAdmit.STOP, 0)
    ledger.set_budget(DS, 45)  # raised but still <= used: still cut
    assert r.hget(k.meta, "cut") == b"1"
    ledger.set_budget(DS, 500)  # raised above used: cleared
    assert r.hget(k.meta, "cut") is None
    assert ledger.admit_turn(DS, "c1", 1, "ch").verdict is TurnAdmit.START
    ledger.set_budget(DS, 10)
    ledger.set_budget(DS, None)  # unlimited clears it too
    assert r.hget(k.meta, "cut") is None
    # A first budget at or below used is not a cut (nothing was lowered): e.g. a dataset set up over a Redis
    # that reconcile filled from the file.
    r.delete(k.meta)
    ledger.set_budget(DS, 20)
    assert r.hget(k.meta, "cut") is None
    audit(r, ledger)


def three_turns(r: "redis.Redis", ledger: Ledger, sample: str = "c1", chunk: str = "ch") -> int:
    total = 0
    for i, n in enumerate((7, 11, 13)):
        assert ledger.commit_turn(DS, sample, i, n, turn(sample, i, n), chunk=chunk).committed
        total += n
        audit(r, ledger)
    return total


HEADER = {"record_version": 2, "id": "c1", "dataset": DS, "messages": None, "incomplete": False,
          "stopped_by": None, "reasoning_parser": None, "sampling_params": {"temperature": 0.7}}


def test_end_conversation_writes_one_entry_once(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    hold(r, ledger, "ch", "c1")
    total = three_turns(r, ledger)
    k = keys.DatasetKeys(DS)
    used = int(r.get(k.used) or 0)
    assert ledger.end_conversation(DS, "c1", 2, HEADER).verdict is EndVerdict.MISMATCH  # 3 are committed
    assert r.xlen(k.results) == 0
    out = ledger.end_conversation(DS, "c1", 3, HEADER)
    assert out == EndOutcome(EndVerdict.ENDED, total)
    assert int(r.get(k.used) or 0) == used and int(r.hget(k.done, "c1") or 0) == total
    assert r.hlen(k.turns) == 0 and r.hlen(k.turnrec) == 0 and not r.hexists(k.convs, "c1")
    assert not r.hexists(k.pending, "c1")
    ((_eid, fields),) = entries(r.xrange(k.results))
    assert sorted(fields) == [b"id", b"r", b"t0", b"t1", b"t2"]
    assert json.loads(fields[b"r"]) == HEADER
    assert [json.loads(fields[f"t{i}".encode()]) for i in range(3)] == [turn("c1", i, n)
                                                                      for i, n in enumerate((7, 11, 13))]
    audit(r, ledger)
    before = snapshot(r)
    assert ledger.end_conversation(DS, "c1", 3, HEADER) == EndOutcome(EndVerdict.DUPLICATE, total)
    assert ledger.commit_turn(DS, "c1", 3, 5, turn("c1", 3, 5)).verdict is TurnVerdict.DUPLICATE
    assert snapshot(r) == before
    with pytest.raises(ValueError):
        ledger.end_conversation(DS, "c1", 0, HEADER)
    with pytest.raises(ValueError):
        ledger.end_conversation(DS, "c1", 3, {**HEADER, "turns": []})


def test_racing_end_conversation_writes_once(r: "redis.Redis", redis_url: str) -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    conversations, racers = 30, 4
    for c in range(conversations):
        for i in range(3):
            assert ledger.commit_turn(DS, f"c{c}", i, 5 + i, turn(f"c{c}", i, 5 + i)).committed
    audit(r, ledger)
    verdicts: list[EndVerdict] = []
    lock = threading.Lock()
    go = threading.Barrier(racers)

    def racer() -> None:
        mine = Ledger(redis.Redis.from_url(redis_url))
        go.wait()
        calls = [mine.end_conversation_call(DS, f"c{c}", 3, {**HEADER, "id": f"c{c}"}) for c in range(conversations)]
        out = run_many(mine.r, calls)
        with lock:
            verdicts.extend(o.verdict for o in out)

    threads = [threading.Thread(target=racer) for _ in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert verdicts.count(EndVerdict.ENDED) == conversations
    assert verdicts.count(EndVerdict.DUPLICATE) == conversations * (racers - 1)
    k = keys.DatasetKeys(DS)
    assert r.xlen(k.results) == conversations and r.hlen(k.done) == conversations
    assert int(r.get(k.used) or 0) == conversations * 18
    audit(r, ledger)


def test_end_conversation_resent_after_a_lost_reply_changes_nothing(r: "redis.Redis", redis_url: str) -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    total = three_turns(r, ledger)
    call = ledger.end_conversation_call(DS, "c1", 3, HEADER)
    r.script_load(scripts.END_CONVERSATION)
    conn = redis.Redis.from_url(redis_url).connection_pool.get_connection("EVALSHA")
    conn.send_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    k = keys.DatasetKeys(DS)
    deadline = time.monotonic() + 30  # a backstop only: we wait for the entry to land
    while not r.hexists(k.done, "c1"):
        assert time.monotonic() < deadline, "the first send never ran"
        time.sleep(0.01)
    conn.disconnect()
    assert run(call) == EndOutcome(EndVerdict.DUPLICATE, total)
    assert r.xlen(k.results) == 1
    audit(r, ledger)


def test_the_collector_writes_a_conversation_as_one_record_v2(r: "redis.Redis", tmp_path: Path) -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    total = three_turns(r, ledger)
    # A single-turn response in the same stream, as today.
    single = {"record_version": 2, "id": "s1", "dataset": DS, "messages": None, "turns": [turn("s1", 0, 4)],
              "completion_tokens": 4, "incomplete": False, "stopped_by": None, "reasoning_parser": None,
              "sampling_params": {}}
    assert ledger.commit(DS, "s1", 4, single).committed
    audit(r, ledger)
    assert ledger.end_conversation(DS, "c1", 3, HEADER).ended
    audit(r, ledger)
    out = ResultsFile(tmp_path / DS / RESULTS)
    prompts = {"c1": [{"role": "user", "content": "hi"}], "s1": [{"role": "user", "content": "yo"}]}
    written = collect(RunState(r), DS, out, prompts.__getitem__)
    out.close()
    assert [w["id"] for w in written] == ["s1", "c1"]
    lines = [json.loads(line) for line in (tmp_path / DS / RESULTS).read_text(encoding="utf-8").splitlines()]
    conv = next(rec for rec in lines if rec["id"] == "c1")
    assert conv["record_version"] == 2
    # Each turn as committed, in record v2's turn field order (fields it lacks are written as null).
    assert conv["turns"] == [{**dict.fromkeys(record.TURN_FIELDS), **turn("c1", i, n)}
                             for i, n in enumerate((7, 11, 13))]
    assert conv["completion_tokens"] == total and conv["messages"] == prompts["c1"]
    assert conv["sampling_params"] == {"temperature": 0.7}
    # record v2's field order, with ``generation`` right after the id it completes (0: --generations 1)
    assert list(conv)[:6] == ["record_version", "id", "generation", *list(record.RECORD_FIELDS)[2:5]]
    assert conv["generation"] == 0
    assert next(rec for rec in lines if rec["id"] == "s1")["completion_tokens"] == 4
    k = keys.DatasetKeys(DS)
    assert r.xlen(k.results) == 0
    assert int(r.get(k.used) or 0) == sum(rec["completion_tokens"] for rec in lines)
    audit(r, ledger)


def test_reconcile_turns_drops_turns_of_conversations_on_disk(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, 100)
    total = three_turns(r, ledger)
    assert ledger.commit_turn(DS, "c2", 0, 9, turn("c2", 0, 9)).committed  # running, not on disk
    # Redis restored from before c1 was written: the file holds its record; reconcile counts it first.
    assert ledger.reconcile(DS, [("c1", total)]) == (1, total)
    k = keys.DatasetKeys(DS)
    assert int(r.get(k.used) or 0) == 2 * total + 9  # counted twice until reconcile_turns
    assert ledger.reconcile_turns(DS, ["c1", "c2", "nope"]) == (1, total)
    assert int(r.get(k.used) or 0) == total + 9 and not r.hexists(k.convs, "c1")
    assert ledger.committed_turns(DS, "c2") == [turn("c2", 0, 9)]
    audit(r, ledger)
    before = snapshot(r)
    assert ledger.reconcile_turns(DS, ["c1", "c2"]) == (0, 0)  # run again: nothing more
    assert snapshot(r) == before


def test_reopen_makes_a_failed_conversations_turns_committed_again(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    hold(r, ledger, "ch", "c1")
    total = three_turns(r, ledger)
    assert ledger.end_conversation(DS, "c1", 3, {**HEADER, "stopped_by": "failed", "incomplete": True}).ended
    k = keys.DatasetKeys(DS)
    used = int(r.get(k.used) or 0)
    on_disk = [turn("c1", i, n) for i, n in enumerate((7, 11, 13))]
    assert ledger.reopen(DS, "c1", on_disk[:2]) == -1  # not the record done counted
    assert ledger.reopen(DS, "c1", on_disk) == 1
    assert not r.hexists(k.done, "c1") and int(r.hget(k.convs, "c1") or 0) == 3
    assert ledger.committed_turns(DS, "c1") == on_disk and int(r.get(k.used) or 0) == used
    audit(r, ledger)
    before = snapshot(r)
    assert ledger.reopen(DS, "c1", on_disk) == 0  # a resend: nothing changes
    assert snapshot(r) == before
    # It resumes at the failed turn, and ends again with its new turn.
    r.hset(k.pending, "c1", "ch")
    assert ledger.admit_turn(DS, "c1", 3, "ch").verdict is TurnAdmit.START
    assert ledger.commit_turn(DS, "c1", 3, 6, turn("c1", 3, 6), chunk="ch").committed
    assert ledger.end_conversation(DS, "c1", 4, HEADER) == EndOutcome(EndVerdict.ENDED, total + 6)
    audit(r, ledger)


def test_a_reopened_conversations_record_supersedes_its_failed_one_on_disk(r: "redis.Redis", tmp_path: Path) -> None:
    """A conversation written stopped_by failed, reopened by a rerun and ended again: the collector appends the
    new record (readers keep an id's last), the file's count is the new one, and a resend of either record after
    a crash between the fsync and the XDEL is not written again."""
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    hold(r, ledger, "ch", "c1")
    total = three_turns(r, ledger)
    failed = {**HEADER, "stopped_by": "failed", "incomplete": True, "failed_reason": "HTTP 500"}
    assert ledger.end_conversation(DS, "c1", 3, failed).ended
    path = tmp_path / DS / RESULTS
    store = RunState(r)
    k = keys.DatasetKeys(DS)
    out = ResultsFile(path)
    stream_copy = entries(r.xrange(k.results))  # what a crash before the XDEL would leave in the stream
    assert [w["stopped_by"] for w in collect(store, DS, out, lambda sid: [])] == ["failed"]
    out.close()
    out = ResultsFile(path)
    assert out.tokens == {"c1": total} and "c1" in out.superseded
    for _eid, fields in stream_copy:  # the resend of the failed record
        r.xadd(k.results, dict(fields.items()))  # built as the dict[FieldT, EncodableT] xadd takes
    assert collect(store, DS, out, lambda sid: []) == []
    on_disk = json.loads(path.read_text(encoding="utf-8").splitlines()[0])["turns"]
    assert ledger.reopen(DS, "c1", on_disk) == 1
    r.hset(k.pending, "c1", "ch")
    assert ledger.commit_turn(DS, "c1", 3, 6, turn("c1", 3, 6), chunk="ch").committed
    assert ledger.end_conversation(DS, "c1", 4, HEADER).ended
    audit(r, ledger)
    assert [len(w["turns"]) for w in collect(store, DS, out, lambda sid: [])] == [4]
    out.close()
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [(rec["id"], rec["stopped_by"], len(rec["turns"])) for rec in lines] == [("c1", "failed", 3), ("c1", None, 4)]
    again = ResultsFile(path)
    assert again.tokens == {"c1": total + 6} and not again.superseded
    assert int(r.get(k.used) or 0) == sum(again.tokens.values())
    # Once superseded by a record that did not fail, the id takes no more lines.
    assert again.append([{**lines[1], "completion_tokens": 1}]) == []
    again.close()
