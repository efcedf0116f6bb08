"""Multi-turn conversations end to end under kill -9: produce (CLI) -> Redis -> rq worker subprocesses -> the
simulator, whose request log says from the server's side what was generated how often."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from budget.ledger import Ledger
from render.chat import load_tokenizer
from tests import sim_log
from tests.procs import produce_cmd, read_jsonl, wait_for

pytestmark = pytest.mark.e2e

TRACES = Path(__file__).resolve().parents[2] / "demo" / "data" / "agent_traces.jsonl"  # 80, 2-4 user turns
DS = "agent_traces"


def test_kill9_mid_conversation_loses_nothing_and_never_regenerates_a_committed_turn(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    log = tmp_path / "requests.jsonl"
    # ~1.5 s a turn: conversations are between turns and mid-turn when the worker dies
    sim = sim_factory("--tokens-per-second-per-request", "100", "--mean-tokens", "150", "--seed", "5",
                      "--request-log", str(log))
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="16")
    victim = pool.start("victim")
    pool.start("steady")
    out = tmp_path / "out"
    proc = subprocess.Popen([*produce_cmd(), str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "512",
                             "--chunk-size", "8", "--queue-depth", "2", "--out", str(out), "--redis-url", redis_url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    k = keys.DatasetKeys(DS)
    try:
        wait_for(lambda: r.hlen(k.convs) >= 8, 90, "conversations between turns")
        wait_for(lambda: r.zcount(k.chunks, "-inf", "(inf") >= 2, 30, "both workers running a chunk")
        os.kill(victim.pid, signal.SIGKILL)  # worker.Worker runs jobs in-process: no horse to orphan
        victim.wait()
        pool.start("replacement")
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "lost its worker" in stderr

    recs = read_jsonl(out / DS / "raw_responses.jsonl")
    ids = [x["id"] for x in recs]
    assert len(ids) == len(set(ids)) == 80, "every conversation exactly once"
    assert int(r.get(k.used) or 0) == sum(x["completion_tokens"] for x in recs), "counter drift"
    assert r.hlen(k.turns) == 0 and r.hlen(k.turnrec) == 0 and r.hlen(k.convs) == 0
    assert Ledger(r).unwritten_turn_tokens(DS) == 0
    assert sum(len(x["turns"]) > 1 for x in recs) > 40  # most went on past their first turn

    exchanges = sim_log.exchanges(log, load_tokenizer(str(tokenizer_dir)))
    regenerated = 0
    for rec in recs:
        seen = sim_log.of_sample(exchanges, DS, rec["id"])
        assert len(seen) == len(rec["turns"]), f"{rec['id']}: turns asked beyond the record's"
        for i, (answers, turn) in enumerate(zip(seen, rec["turns"], strict=True)):
            # The committed answer is the turn's last one: a committed turn is never generated again. Answers
            # before it were the killed worker's, answered but never committed.
            assert answers and answers[-1].output_ids == turn["output_ids"], f"{rec['id']} turn {i}"
            regenerated += len(answers) - 1
            if i:
                assert rec["turns"][i - 1]["content"].strip() in answers[-1].prompt
    # at most what the killed worker had answered and not yet committed (its window: 16)
    assert regenerated <= 16
