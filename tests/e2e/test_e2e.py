"""End to end on real parts: produce (CLI subprocess) -> Redis -> rq worker subprocesses -> sglang-sim over HTTP."""
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
from tests.replies import raw, texts

pytestmark = pytest.mark.e2e


def test_budget_hit_and_unbudgeted_complete(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                            tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "300", "--seed", "1")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="8")
    for i in range(3):
        pool.start(f"w{i}")
    out = tmp_path / "out"
    budget = 15_000
    # --turns last: one request and one turn per record (multi-turn runs: tests/redis/test_turns_producer.py).
    res = produce([str(GLAIVE), str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1024",
                   "--budget", f"code_instruct={budget}", "--chunk-size", "8", "--queue-depth", "4",
                   "--out", str(out), "--turns", "last"], redis_url)
    assert res.returncode == 0, res.stderr
    assert "budget reached" in res.stdout and "complete" in res.stdout

    code = check_exact(r, out, "code_instruct")
    total = sum(x["completion_tokens"] for x in code)
    assert total >= budget
    # File order is commit order. Everything committed after the crossing commit was already in flight when
    # the dataset closed: at most 3 workers x 8 requests.
    running = 0
    crossing = next(i for i, x in enumerate(code) if (running := running + x["completion_tokens"]) >= budget)
    assert len(code) - crossing - 1 <= 3 * 8
    assert len(code) < 150, "the budget should have stopped the dataset early"

    glaive = check_exact(r, out, "glaive_fc")
    assert sorted(x["id"] for x in glaive) == sorted({str(x["id"]) for x in read_jsonl(GLAIVE)})
    assert all(x["record_version"] == 2 and len(x["turns"]) == 1 for x in glaive + code)
    assert all(x["turns"][0]["finish_reason"] in ("stop", "length") for x in glaive + code)
    for x in glaive + code:  # the server's ids are kept: EOS last on a stop, the budget counts them all
        turn = x["turns"][0]
        assert len(turn["output_ids"]) == turn["completion_tokens"] == x["completion_tokens"]
        assert (turn["finish_reason"] == "stop") == (turn["output_ids"][-1] == 2)  # the simulator's EOS id
        assert x["incomplete"] == (turn["finish_reason"] == "length")
    assert all(x["messages"] and x["sampling_params"]["max_new_tokens"] == 1024 for x in glaive)

    # Every response the simulator produced is in a file (no faults: nothing was retried or aborted).
    stats = sim_stats(sim.url)
    assert stats["completed"] == len(code) + len(glaive)
    assert stats["aborted"] == 0
    # Each chunk's RQ job carries its final progress in meta, as rq-dashboard shows it.
    metas = [json.loads(r.hget(key, "meta") or b"{}") for key in r.scan_iter("rq:job:bq-glaive_fc-*")]
    assert metas and all(m.get("state") == "done" for m in metas)
    assert sum(m["committed"] for m in metas) == r.hlen(keys.DatasetKeys("glaive_fc").done)
    # Nothing of the closed dataset is left in the queue or live.
    assert not [j for j in r.lrange(keys.RQ_QUEUE, 0, -1) if b"code_instruct" in j]
    assert r.zcard(keys.DatasetKeys("code_instruct").chunks) == 0

    # Running produce again on the finished run enqueues and sends nothing, and changes no file.
    before = {p: p.read_bytes() for p in out.rglob("raw_responses.jsonl")}
    again = produce([str(GLAIVE), str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1024",
                     "--out", str(out), "--turns", "last"], redis_url)
    assert again.returncode == 0, again.stderr
    assert sim_stats(sim.url)["submitted"] == stats["submitted"]
    assert r.llen(keys.RQ_QUEUE) == 0
    assert {p: p.read_bytes() for p in out.rglob("raw_responses.jsonl")} == before


def test_reasoning_split_from_open_think_prompt(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    # The template ends the prompt with "<think>\n": the output holds only "reasoning</think>answer".
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "120", "--max-running", "64")
    workers(sim.url).start("w0")
    out = tmp_path / "out"
    # --turns last: a truncated one-turn record is what this checks (a multi-turn one stops with "length").
    res = produce([str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "200", "--out", str(out),
                   "--max-samples", "30", "--turns", "last"], redis_url)
    assert res.returncode == 0, res.stderr
    recs = check_exact(r, out, "agent_traces")
    assert len(recs) == 30
    for rec in recs:
        x = rec["turns"][0]
        if x["finish_reason"] == "stop":
            assert x["reasoning"] and x["content"] and not x["reasoning_truncated"]
            assert x["response"].startswith(x["reasoning"].split()[0])
        elif "</think>" not in x["response"]:
            assert x["reasoning_truncated"] and x["reasoning"] and x["content"] == ""
            assert rec["incomplete"] and rec["stopped_by"] == "length"
        assert rec["messages"][-1]["role"] != "assistant"  # the old answer was dropped


def test_kill9_worker_mid_run_exactly_once(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                           tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    # Slow enough that chunks are mid-flight when the worker dies: ~3 s per request.
    sim = sim_factory("--tokens-per-second-per-request", "100", "--mean-tokens", "300", "--seed", "3")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="16")
    victim = pool.start("victim")
    pool.start("steady")
    out = tmp_path / "out"
    proc = subprocess.Popen([*produce_cmd(), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens",
                             "2048", "--chunk-size", "16", "--queue-depth", "2", "--out", str(out),
                             "--redis-url", redis_url, "--turns", "last"],  # one request per record, counted below
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = out / "glaive_fc" / "raw_responses.jsonl"
    try:
        wait_for(lambda: len(read_jsonl(results)) >= 10, 60, "first results")
        wait_for(lambda: r.zcount(keys.DatasetKeys("glaive_fc").chunks, "-inf", "(inf") >= 2, 30,
                 "both workers running a chunk")
        os.kill(victim.pid, signal.SIGKILL)  # no horse: worker.Worker runs jobs in-process
        victim.wait()
        pool.start("replacement")
        stdout, stderr = proc.communicate(timeout=120)  # the run finishes within 2 minutes of the kill
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "lost its worker" in stderr
    recs = check_exact(r, out, "glaive_fc")
    assert sorted(x["id"] for x in recs) == sorted({str(x["id"]) for x in read_jsonl(GLAIVE)})
    stats = sim_stats(sim.url)
    # Only the killed worker's in-flight requests were redone (the simulator aborted them on disconnect).
    assert stats["completed"] == len(recs)
    assert 0 < stats["aborted"] <= 16


def test_produce_kill9_and_rerun_resumes(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                         tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--tokens-per-second-per-request", "200", "--mean-tokens", "200", "--seed", "4")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="16")
    pool.start("w0")
    pool.start("w1")
    out = tmp_path / "out"
    args = [str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1024", "--chunk-size", "10",
            "--queue-depth", "2", "--budget", "20k", "--out", str(out), "--redis-url", redis_url]
    proc = subprocess.Popen([*produce_cmd(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = out / "code_instruct" / "raw_responses.jsonl"
    wait_for(lambda: len(read_jsonl(results)) >= 15, 60, "first results")
    proc.kill()
    proc.wait()
    # Simulate a crash mid-write too: a torn last line is cut before anything is appended.
    with open(results, "ab") as fh:
        fh.write(b'{"id": "torn", "completion_tok')
    res = subprocess.run([*produce_cmd(), *args], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert "torn last line" in res.stderr
    recs = check_exact(r, out, "code_instruct")
    assert sum(x["completion_tokens"] for x in recs) >= 20_000
    assert sim_stats(sim.url)["completed"] == len(recs)


def test_resume_counts_existing_file_on_a_fresh_redis(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                      tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    """The seed's case: a run that already made 6.4M of 10M resumes and makes only what is missing."""
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "200", "--seed", "5")
    workers(sim.url, BUDGETQ_CONCURRENCY="8").start("w0")
    out = tmp_path / "out"
    base = [str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1024", "--chunk-size", "8",
            "--out", str(out)]
    first = produce([*base, "--max-samples", "40"], redis_url)
    assert first.returncode == 0, first.stderr
    made = read_jsonl(out / "code_instruct" / "raw_responses.jsonl")
    assert len(made) == 40
    r.flushall()  # Redis lost everything; the output file is the truth
    before = sim_stats(sim.url)["completed"]
    second = produce([*base, "--max-samples", "60"], redis_url)
    assert second.returncode == 0, second.stderr
    assert "counted 40 responses" in second.stderr
    recs = check_exact(r, out, "code_instruct")
    assert len(recs) == 60
    assert sim_stats(sim.url)["completed"] - before == 20


def test_final_400_is_recorded_failed_and_retried_on_rerun(redis_url: str, r: "redis.Redis",
                                                           tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
                                                           workers: Any) -> None:
    # The server's context is smaller than ours: long prompts get SGLang's 400, which is never retried.
    small = sim_factory("--time-scale", "50", "--mean-tokens", "50", "--context-length", "400")
    first_worker = workers(small.url).start("w0")
    # A server whose limit produce does not know (an older worker, a server reporting context_length null):
    # otherwise produce skips those prompts at attach (tests/redis/test_modeldir.py) and none is sent to be refused.
    wait_for(lambda: r.hlen(keys.SERVER_INFO) > 0, 60, "the worker recorded its server")
    r.delete(keys.SERVER_INFO)  # it records again in an hour
    out = tmp_path / "out"
    # --turns last: whole conversations as prompts, long enough for the server's 400 (turn 0 alone mostly fits).
    args = [str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "200", "--max-samples", "40",
            "--out", str(out), "--turns", "last"]
    res = produce(args, redis_url)
    assert res.returncode == 0, res.stderr  # failed samples do not change the exit code
    failed = read_jsonl(out / "glaive_fc" / "failed.jsonl")
    recs = check_exact(r, out, "glaive_fc")
    assert failed and len(failed) + len(recs) == 40
    # A 400 is final: sent once, never retried.
    assert all("context length" in f["reason"] and f["status"] == 400 and f["attempts"] == 1 for f in failed)
    assert f"failed {failed[0]['id']}" in res.stdout

    first_worker.terminate()
    first_worker.wait(30)
    big = sim_factory("--time-scale", "50", "--mean-tokens", "50")
    workers(big.url).start("w1")
    again = produce(args, redis_url)
    assert again.returncode == 0, again.stderr
    assert not (out / "glaive_fc" / "failed.jsonl").exists()
    assert len(check_exact(r, out, "glaive_fc")) == 40
    assert sim_stats(big.url)["completed"] == len(failed)


def _sigint_as_a_terminal_sends_it() -> None:
    """Ctrl-C's disposition in the child: the default (KeyboardInterrupt). A suite started in the background of a
    shell without job control (`make test &`, nohup, a script's `cmd &`) inherits SIGINT ignored, and so would the
    produce under test: it would then rightly ignore the SIGINT (Python keeps an inherited SIG_IGN), which is what
    two whole-suite runs launched that way saw, not a lost Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_one_collector_per_dataset_and_ctrl_c_detaches(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                       tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [*produce_cmd(), str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "100", "--out",
            str(out), "--redis-url", redis_url]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,  # no workers
                             preexec_fn=_sigint_as_a_terminal_sends_it)
    try:
        wait_for(lambda: r.exists(keys.DatasetKeys("agent_traces").collector) == 1, 60, "first produce attached")
        second = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert "another produce is attached" in second.stderr and "Traceback" not in second.stderr
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130 and "detached" in err
    assert r.exists(keys.DatasetKeys("agent_traces").collector) == 0  # released: a rerun attaches at once
    assert r.llen(keys.RQ_QUEUE) > 0  # the queued work stays for the workers


def test_sigterm_finishes_running_requests_gives_back_the_rest_then_exits(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    # Requests of 6 s: the SIGTERM must reach the worker before chunk 1's requests end, or a freed slot lets
    # chunk 2 start a ninth (seen once at 1.5 s requests on a loaded machine).
    sim = sim_factory("--tokens-per-second-per-request", "25", "--mean-tokens", "150", "--length-dist", "fixed")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="8")
    worker = pool.start("w0")
    # --turns last: each sample is one request of 6 s, so 8 finish in the worker's 8 slots (a conversation would
    # be given back between its turns by the warm stop).
    args = [str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "400", "--chunk-size", "8",
            "--max-samples", "24", "--out", str(tmp_path / "out"), "--turns", "last"]
    res = produce([*args, "--detach"], redis_url)
    assert res.returncode == 0, res.stderr
    k = keys.DatasetKeys("agent_traces")
    # Chunk 1 fills the worker's 8 slots; chunk 2 is taken and waits for a slot.
    wait_for(lambda: r.zcount(k.chunks, "-inf", "(inf") == 2, 30, "two chunks taken by the worker")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    # The 8 running requests finished and were committed (nothing aborted, nothing redone); the waiting
    # chunk gave its samples back; the third chunk is still queued.
    assert r.hlen(k.done) == 8
    assert sim_stats(sim.url)["aborted"] == 0
    assert r.zcount(k.chunks, "-inf", "(inf") == 0 and r.llen(keys.RQ_QUEUE) == 1
    pool.start("w1")
    again = produce(args, redis_url)
    assert again.returncode == 0, again.stderr
    assert len(check_exact(r, tmp_path / "out", "agent_traces")) == 24
    assert sim_stats(sim.url)["completed"] == 24


def test_sigterm_right_after_start_stops_the_worker_cleanly(r: "redis.Redis", sim_factory: Any,
                                                            workers: Any) -> None:
    # rq installs its signal handlers only after the worker registered itself: a SIGTERM in between (a deploy
    # that starts and stops workers at once) used to end the process by the signal, its registration left
    # behind. From the line that says the budgetq worker is built, any SIGTERM is a warm stop.
    sim = sim_factory()
    pool = workers(sim.url)
    for i in range(5):
        name = f"early{i}"
        proc = pool.start(name)
        def announced(name: str = name, proc: subprocess.Popen[bytes] = proc) -> bool:
            return "budgetq worker:" in pool.log(name) or proc.poll() is not None
        wait_for(announced, 60, "the worker announced itself", interval=0.001)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, pool.log(name)
        assert "Traceback" not in pool.log(name, partial=True)
        assert not r.sismember("rq:workers", f"rq:worker:{name}")


def test_seed_without_deterministic_inference_is_warned_and_recorded(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "50")
    workers(sim.url).start("w0")
    wait_for(lambda: r.hlen(keys.SERVER_INFO) > 0, 60, "the worker recorded its server")
    out = tmp_path / "out"
    res = produce([str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "64", "--max-samples", "8",
                   "--seed", "3", "--out", str(out)], redis_url)
    assert res.returncode == 0, res.stderr
    assert "--seed 3 is sent as sampling_seed, but 1 of the 1 SGLang servers" in res.stderr
    manifest = json.loads((out / "agent_traces" / "manifest.json").read_text())
    assert manifest["sampling_params"]["sampling_seed"] == 3
    assert manifest["sampling_seed_honoured"] is False  # the simulator reports it off, as SGLang does by default
    recs = read_jsonl(out / "agent_traces" / "raw_responses.jsonl")
    assert all(x["sampling_params"]["sampling_seed"] == 3 for x in recs)


def test_skip_special_tokens_is_sent_stored_and_a_change_is_refused(redis_url: str, r: "redis.Redis",
                                                                    tokenizer_dir: Path, tmp_path: Path) -> None:
    import zlib
    out = tmp_path / "out"
    base = [str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "64", "--max-samples", "4", "--out",
            str(out)]
    res = produce([*base, "--no-skip-special-tokens", "--detach"], redis_url)  # no worker: the chunks stay queued
    assert res.returncode == 0, res.stderr
    payloads = [json.loads(zlib.decompress(raw(r.hget(f"rq:job:{job}", "data"))))[2][0]
                for job in texts(r.lrange(keys.RQ_QUEUE, 0, -1))]
    assert payloads and all(p["sampling_params"]["skip_special_tokens"] is False for p in payloads)
    settings = json.loads((out / "agent_traces" / "run.json").read_text())
    assert settings["sampling_params"]["skip_special_tokens"] is False
    changed = produce([*base, "--detach"], redis_url)  # the default (true for qwen3-thinking) is another setting
    assert changed.returncode == 2
    assert "skip_special_tokens: stored False, now True" in changed.stderr
