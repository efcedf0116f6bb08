"""The deadline in Redis (docs/mix.md): admit closes the dataset at the first request that could not end by it, a
budget change that reopens it clears the mark, and a rerun after it passed sends nothing."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis
from click.testing import CliRunner

from budget import keys
from budget.ledger import Admit, Ledger, TurnAdmit
from producer.cli import main
from tests.demo_data import CODE
from tests.procs import run_keys


def _chunk(r: "redis.Redis", name: str, chunk: str, samples: list[str]) -> None:
    k = keys.DatasetKeys(name)
    r.zadd(k.chunks, {chunk: float("inf")})
    r.hset(k.pending, mapping=dict.fromkeys(samples, chunk))


def test_a_request_that_could_not_end_by_the_deadline_closes_the_dataset(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_mode("ds", "drain", 100)
    ledger.set_budget("ds", None)
    _chunk(r, "ds", "c1", ["a", "b"])
    ledger.set_deadline("ds", round((time.time() + 60) * 1000))
    assert ledger.admit("ds", "a", "c1", duration_ms=1_000).verdict is Admit.START  # ends well before
    assert ledger.admit("ds", "b", "c1", duration_ms=120_000).verdict is Admit.CLOSED  # would end after it
    meta = r.hgetall(keys.DatasetKeys("ds").meta)
    assert meta[b"status"] == b"closed" and meta[b"closed_by"] == b"deadline"
    ledger.set_deadline("ds", round((time.time() + 600) * 1000))  # a new deadline, and the attach's set_budget
    assert ledger.set_budget("ds", None) == "open" and not r.hexists(keys.DatasetKeys("ds").meta, "closed_by")
    assert ledger.admit("ds", "b", "c1", duration_ms=120_000).verdict is Admit.START
    ledger.set_deadline("ds", None)
    _chunk(r, "ds", "c2", ["z"])
    assert ledger.admit("ds", "z", "c2", duration_ms=10**9).verdict is Admit.START  # no deadline: no limit


def test_a_later_turn_that_could_not_end_by_the_deadline_stops_the_conversation(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_mode("ds", "drain", 100)
    ledger.set_budget("ds", None)
    _chunk(r, "ds", "c1", ["a", "b"])
    r.hset(keys.DatasetKeys("ds").convs, mapping={"a": 1, "b": 1})  # both have their turn 0 committed
    ledger.set_deadline("ds", round((time.time() + 60) * 1000))
    assert ledger.admit_turn("ds", "a", 1, "c1", duration_ms=1_000).verdict is TurnAdmit.START
    assert ledger.admit_turn("ds", "b", 1, "c1", duration_ms=120_000).verdict is TurnAdmit.STOP
    assert r.hget(keys.DatasetKeys("ds").meta, "closed_by") == b"deadline"


def test_a_rerun_after_the_deadline_passed_sends_nothing(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                        tokenizer_dir: Path) -> None:
    args = [str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "100", "--turns", "last",
            "--out", str(tmp_path / "out"), "--budget", "5k"]
    first = CliRunner().invoke(main, [*args, "--for", "2h", "--detach", "--redis-url", redis_url])
    assert first.exit_code == 0, first.output
    meta = keys.DatasetKeys("code_instruct").meta
    assert abs(int(r.hget(meta, "deadline") or 0) / 1000 - (time.time() + 7_200)) < 120
    r.hset(meta, "deadline", round((time.time() - 5) * 1000))  # as if the two hours had gone by
    before = run_keys(r)
    again = CliRunner().invoke(main, [*args, "--redis-url", redis_url])
    assert again.exit_code == 0, again.output
    assert "deadline" in again.output and "passed for code_instruct: nothing was sent" in again.output
    assert run_keys(r) == before
    renewed: Any = CliRunner().invoke(main, [*args, "--for", "1h", "--detach", "--redis-url", redis_url])
    assert renewed.exit_code == 0, renewed.output
    assert int(r.hget(meta, "deadline") or 0) / 1000 > time.time() + 3_000
