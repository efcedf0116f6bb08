"""Budget modes, live budget changes, status and dry runs, end to end on real workers and the simulator."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from tests.demo_data import CODE, GLAIVE, TRACES
from tests.exactly_once import check_exact
from tests.procs import produce, produce_cmd, read_jsonl, sim_stats, wait_for
from tests.replies import texts


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["drain", "predict", "strict"])
def test_every_mode_counts_exactly(mode: str, redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                   tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "200", "--seed", "7")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="8")
    pool.start("w0")
    pool.start("w1")
    out = tmp_path / "out"
    budget = 12_000
    res = produce([str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "600", "--budget", str(budget),
                   "--budget-mode", mode, "--chunk-size", "8", "--out", str(out)], redis_url)
    assert res.returncode == 0, res.stderr
    recs = check_exact(r, out, "code_instruct")
    total = sum(x["completion_tokens"] for x in recs)
    if mode == "strict":
        assert budget - 600 < total <= budget  # never above, and closed only when one more could not fit
    else:
        assert total >= budget
    state = r.hgetall(keys.DatasetKeys("code_instruct").meta)
    assert state[b"mode"] == mode.encode() and state[b"status"] == b"closed"
    assert r.hlen(keys.DatasetKeys("code_instruct").resv) == 0  # nothing stays reserved
    assert sim_stats(sim.url)["completed"] == len(recs)


@pytest.mark.e2e
def test_reservations_expire_after_kill9_of_a_worker(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                     tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--tokens-per-second-per-request", "100", "--mean-tokens", "300", "--seed", "8")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="8")
    victim = pool.start("victim")
    out = tmp_path / "out"
    proc = subprocess.Popen([*produce_cmd(), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1000",
                             "--budget", "15k", "--budget-mode", "predict", "--chunk-size", "8", "--out", str(out),
                             "--redis-url", redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    resv = keys.DatasetKeys("glaive_fc").resv
    try:
        wait_for(lambda: sum(int(v) for v in r.hvals(resv)) > 0, 60, "requests holding reservations")
        dead_chunks = set(texts(r.hkeys(resv)))
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        # The lease lapses and produce reclaims the chunk: its reservation is gone, so the budget is free again.
        wait_for(lambda: not dead_chunks & set(texts(r.hkeys(resv))), 60, "the dead chunk's reservation")
        pool.start("replacement")
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    recs = check_exact(r, out, "glaive_fc")
    assert sum(x["completion_tokens"] for x in recs) >= 15_000


@pytest.mark.e2e
def test_lowering_then_raising_a_budget_mid_run(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--tokens-per-second-per-request", "200", "--mean-tokens", "200", "--seed", "9")
    worker = workers(sim.url, BUDGETQ_CONCURRENCY="4").start("w0")
    out = tmp_path / "out"
    proc = subprocess.Popen([*produce_cmd(), str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "800",
                             "--budget", "1M", "--chunk-size", "4", "--queue-depth", "2", "--out", str(out),
                             "--redis-url", redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    k = keys.DatasetKeys("code_instruct")
    used_key = k.used

    def hold_a_running_chunk() -> bool:
        """Freeze the worker while it runs a chunk: between the two budget calls its requests stay in flight,
        so the attached produce cannot see the closed dataset end and exit (as it should on a real close)."""
        worker.send_signal(signal.SIGSTOP)
        if r.zcount(k.chunks, "-inf", "(inf") > 0:
            return True
        worker.send_signal(signal.SIGCONT)
        return False

    try:
        wait_for(lambda: int(r.get(used_key) or 0) > 2000, 60, "some tokens used")
        wait_for(hold_a_running_chunk, 30, "the worker frozen with a chunk running")
        low = subprocess.run([*produce_cmd(), "budget", "code_instruct", "1000", "--redis-url", redis_url],
                             capture_output=True, text=True, timeout=60)
        assert low.returncode == 0, low.stderr
        assert "closed" in low.stdout
        assert r.hget(keys.DatasetKeys("code_instruct").meta, "status") == b"closed"
        closed_at = int(r.get(used_key) or 0)
        high = subprocess.run([*produce_cmd(), "budget", "code_instruct", str(closed_at + 5000), "--redis-url",
                               redis_url], capture_output=True, text=True, timeout=60)
        assert high.returncode == 0 and "open" in high.stdout
        worker.send_signal(signal.SIGCONT)
        _, stderr = proc.communicate(timeout=120)  # the attached produce tops up again and lands on the new budget
    finally:
        worker.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    recs = check_exact(r, out, "code_instruct")
    assert sum(x["completion_tokens"] for x in recs) >= closed_at + 5000
    assert len(recs) < 150


def test_dry_run_writes_nothing_and_projects(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                             tmp_path: Path) -> None:
    r.set("someone-elses-key", "x")
    res = produce([str(GLAIVE), str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1000",
                   "--budget", "code_instruct=10k", "--dry-run", "--expect-mean", "250", "--throughput", "100",
                   "--json", "--out", str(tmp_path / "out"), "--turns", "last"], redis_url)  # one request a sample
    assert res.returncode == 0, res.stderr
    assert r.dbsize() == 1
    plan = {d["name"]: d for d in json.loads(res.stdout)["datasets"]}
    code, glaive = plan["code_instruct"], plan["glaive_fc"]
    assert code["valid"] == 150 and code["samples_needed"] == 40 and code["projected_tokens"] == 10_000
    assert code["eta_s"] == pytest.approx(100.0)
    assert glaive["samples_needed"] == 120 and glaive["projected_tokens"] == 120 * 250
    assert code["prompt_tokens_p95"] >= code["prompt_tokens_mean"] > 0


def test_dry_run_pilot_sends_only_pilot_requests(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                 tmp_path: Path, sim_factory: Any) -> None:
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "300", "--length-dist", "fixed")
    res = subprocess.run([*produce_cmd(), str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1000",
                          "--budget", "3000", "--dry-run", "--pilot", "5", "--redis-url", redis_url,
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SGLANG_URL": sim.url})
    assert res.returncode == 0, res.stderr
    assert "pilot (5 requests)" in res.stdout and "agent_traces" in res.stdout
    # What the pilot measured is shown (issue 29: it was not).
    assert ("agent_traces: pilot: 5 requests sent, 5 answered: mean 300 completion tokens (min 300, max 300; 0 cut "
            "at --max-tokens)") in res.stdout, res.stdout
    assert sim_stats(sim.url)["submitted"] == 5
    assert r.dbsize() == 0
    # Shown also when --expect-mean takes precedence, and in the JSON plan.
    res = subprocess.run([*produce_cmd(), str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300",
                          "--dry-run", "--pilot", "2", "--expect-mean", "100", "--json", "--redis-url", redis_url,
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SGLANG_URL": sim.url})
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)["datasets"][0]
    assert plan["expected_completion"] == 100
    assert plan["pilot"] == {"sent": 2, "answered": 2, "mean": 300, "min": 300, "max": 300, "at_max_tokens": 2,
                             "used": False}


@pytest.mark.e2e
def test_status_shows_progress_as_json_and_table(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                 tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "100")
    workers(sim.url).start("w0")
    # --turns last: one request per sample, so finish reasons add up to samples done.
    res = produce([str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "400", "--budget", "2000",
                   "--budget-mode", "strict", "--out", str(tmp_path / "out"), "--turns", "last"], redis_url)
    assert res.returncode == 0, res.stderr
    js = subprocess.run([*produce_cmd(), "status", "--json", "--redis-url", redis_url], capture_output=True,
                        text=True, timeout=60)
    rows = {x["name"]: x for x in json.loads(js.stdout)}
    row = rows["agent_traces"]
    assert row["mode"] == "strict" and row["budget"] == 2000 and row["status"] == "closed"
    assert row["used"] == sum(x["completion_tokens"] for x in read_jsonl(tmp_path / "out" / "agent_traces" /
                                                                          "raw_responses.jsonl"))
    assert row["finish_stop"] + row["finish_length"] == row["done"] and row["reserved"] == 0
    assert row["mean_completion"] and row["not_run"] > 0
    table = subprocess.run([*produce_cmd(), "status", "--redis-url", redis_url], capture_output=True, text=True,
                           timeout=60)
    assert "agent_traces" in table.stdout and "strict" in table.stdout


@pytest.mark.e2e
@pytest.mark.parametrize("taper", ["2", "0"])
def test_predict_taper_lands_within_one_request(taper: str, redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    """A budget of about 1x what is in flight (32 slots x 200 tokens vs 3100): the close is the whole run.

    Lengths are fixed (200) and the prior's mean is right (--expect-mean), so every reservation is within a few
    percent of the truth: with the taper each start left room for itself plus 2 sd x sqrt(in flight), so at most
    the last request, started alone, goes over; the bound (max_new_tokens) can only fail on a real bug (measured:
    +100, one request). BUDGETQ_PREDICT_TAPER=0 (the rule before the taper) must still reach the budget and count
    exactly; with no spread in the lengths it lands alike here, so its bound is only what 32 slots allow. The
    spread case is bench/budget_modes.py's (docs/budget.md, "The taper")."""
    sim = sim_factory("--time-scale", "20", "--length-dist", "fixed", "--mean-tokens", "200", "--seed", "3",
                      "--no-reasoning")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="16", BUDGETQ_PREDICT_TAPER=taper, BUDGETQ_RESERVE_INTERVAL="0.1")
    pool.start("w0")
    pool.start("w1")
    out = tmp_path / "out"
    budget, max_new = 3100, 600
    res = produce([str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", str(max_new), "--budget",
                   str(budget), "--budget-mode", "predict", "--expect-mean", "200", "--chunk-size", "16",
                   "--out", str(out)], redis_url)
    assert res.returncode == 0, res.stderr
    recs = check_exact(r, out, "code_instruct")
    total = sum(x["completion_tokens"] for x in recs)
    assert total >= budget  # predict closes only at its budget
    assert total - budget <= (max_new if taper != "0" else 32 * max_new)
    assert r.hlen(keys.DatasetKeys("code_instruct").resv) == 0
