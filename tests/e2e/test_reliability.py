"""Faults on real parts (short forms; bench/chaos.py runs the long ones): Redis killed and restarted, Redis
restarted empty, SGLang outages and malformed answers, an evicting Redis, the API key kept secret."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import redis

from budget import keys
from demo.stack import RedisServer, worker_env
from tests.demo_data import CODE, GLAIVE, TRACES
from tests.exactly_once import check_exact
from tests.procs import Workers, produce, produce_cmd, read_jsonl, sim_stats, wait_for
from tests.replies import raw

pytestmark = pytest.mark.e2e


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server this test may kill and restart (AOF everysec, as production should run)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


def set_faults(sim_url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(sim_url + "/sim/faults", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def test_sigterm_while_redis_is_frozen_ends_the_worker(own_redis: RedisServer, tmp_path: Path,
                                                       sim_factory: Any) -> None:
    """An idle worker stopped while Redis answers nothing: rq raises StopRequested from the idle worker's signal
    handler without marking a stop, and its teardown (register_death) times out on the frozen server. That Redis
    error must end the worker; it used to read as a lost Redis, and the worker waited for Redis to come back
    and started its work loop again, so a SIGTERM did not stop it (the chaos suite's black hole met it: the
    harness had to SIGKILL the workers)."""
    sim = sim_factory()
    pool = Workers(own_redis.url, sim.url, tmp_path)
    r = redis.Redis.from_url(own_redis.url)
    try:
        proc = pool.start("w0")
        wait_for(lambda: r.hget("rq:worker:w0", "state") == b"idle", 60, "the worker waiting for a chunk")
        own_redis.send_signal(signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, pool.log("w0")
        assert "waiting for Redis to come back" not in pool.log("w0")
    finally:
        own_redis.send_signal(signal.SIGCONT)
        pool.stop_all()
        r.close()


#: A worker.Worker built while Redis is up, whose work() starts only once the test has killed Redis (a line on
#: stdin), so that its loop meets the lost Redis and waits for it (Worker._wait_for_redis). ``rq``: rq's own signal
#: handlers installed first, as they are when Redis is lost mid-run (rq installs them once its loop has started).
WAITING_WORKER = """
import sys
import redis
from worker.rqworker import Worker
w = Worker(["budgetq"], connection=redis.Redis.from_url(sys.argv[1]), name="w-wait")
if sys.argv[2] == "rq":
    w._install_signal_handlers()
print("built", flush=True)
sys.stdin.readline()
w.work()
print("work returned", flush=True)
"""


@pytest.mark.parametrize("handlers", ["rq", "budgetq"])
def test_sigterm_while_waiting_for_redis_ends_the_worker(own_redis: RedisServer, tmp_path: Path, sim_factory: Any,
                                                         handlers: str) -> None:
    """A worker waiting for a lost Redis to come back is stopped: the SIGTERM ends the wait and the worker (exit 0,
    no traceback). rq's idle handler raises StopRequested out of the wait's sleep, and budgetq's own handler ended
    the wait into a DEL of the worker's key on the Redis still down: both used to leave work() as a traceback."""
    sim = sim_factory()
    log = tmp_path / "w-wait.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", WAITING_WORKER, own_redis.url, handlers], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True, env=worker_env(own_redis.url, sim.url))
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == "built\n", log.read_text()
        own_redis.kill()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        wait_for(lambda: "waiting for Redis to come back" in log.read_text() or proc.poll() is not None, 60,
                 "the worker waiting for Redis")
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert proc.stdout.read().endswith("work returned\n")  # (rq logs its own stop to stdout)
        assert "Traceback" not in log.read_text(), log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_redis_kill9_and_restart_mid_run(own_redis: RedisServer, tokenizer_dir: Path, tmp_path: Path,
                                         sim_factory: Any) -> None:
    sim = sim_factory("--tokens-per-second-per-request", "200", "--mean-tokens", "200", "--seed", "11")
    pool = Workers(own_redis.url, sim.url, tmp_path, {"BUDGETQ_CONCURRENCY": "16"})
    r = redis.Redis.from_url(own_redis.url)
    out = tmp_path / "out"
    try:
        pool.start("w0")
        pool.start("w1")
        proc = subprocess.Popen([*produce_cmd(), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens",
                                 "1000", "--chunk-size", "8", "--out", str(out), "--redis-url", own_redis.url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        results = out / "glaive_fc" / "raw_responses.jsonl"
        wait_for(lambda: len(read_jsonl(results)) >= 20, 60, "first results")
        own_redis.kill()  # kill -9: AOF everysec keeps what was acknowledged a second before
        own_redis.start()  # same port, same directory: it replays the AOF
        _, stderr = proc.communicate(timeout=150)  # workers and produce carry on by themselves
        assert proc.returncode == 0, stderr
        assert all(p.poll() is None for p in pool.procs), "a worker quit on the Redis restart"
        recs = check_exact(r, out, "glaive_fc")
        assert sorted(x["id"] for x in recs) == sorted({str(x["id"]) for x in read_jsonl(GLAIVE)})
    finally:
        pool.stop_all()


def test_redis_restarted_empty_is_detected_and_a_rerun_rebuilds(tmp_path: Path, tokenizer_dir: Path,
                                                                 sim_factory: Any) -> None:
    server = RedisServer(tmp_path / "redis")
    server.start()
    sim = sim_factory("--tokens-per-second-per-request", "200", "--mean-tokens", "200", "--seed", "12")
    pool = Workers(server.url, sim.url, tmp_path, {"BUDGETQ_CONCURRENCY": "16"})
    out = tmp_path / "out"
    args = [*produce_cmd(), str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1000", "--chunk-size",
            "8", "--out", str(out), "--redis-url", server.url]
    try:
        pool.start("w0")
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: len(read_jsonl(out / "code_instruct" / "raw_responses.jsonl")) >= 20, 60, "results")
        server.kill()
        for p in (tmp_path / "redis").iterdir():  # its data is gone: an empty Redis comes back
            if p.is_dir():
                for f in p.iterdir():
                    f.unlink()
                p.rmdir()
            else:
                p.unlink()
        server.start()
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1
        assert "lost this run's state" in stderr and "Traceback" not in stderr
        again = subprocess.run(args, capture_output=True, text=True, timeout=180)
        assert again.returncode == 0, again.stderr
        assert "counted" in again.stderr  # the file's responses were recounted
        r = redis.Redis.from_url(server.url)
        recs = check_exact(r, out, "code_instruct")
        assert len(recs) == 150
    finally:
        pool.stop_all()
        server.kill()


def test_sglang_outage_is_waited_out_with_backoff(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                  tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--tokens-per-second-per-request", "100", "--mean-tokens", "100", "--seed", "13")
    workers(sim.url, BUDGETQ_CONCURRENCY="16").start("w0")
    out = tmp_path / "out"
    proc = subprocess.Popen([*produce_cmd(), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens",
                             "1000", "--chunk-size", "8", "--out", str(out), "--redis-url", redis_url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Steady load is an event, not a time: three whole seconds in a row with requests arriving. (Waiting for
        # the simulator's uptime instead measured the rate before the outage over the workers' start-up on a
        # loaded machine.)
        seen: dict[str, int] = {}

        def steady() -> bool:
            stats = sim_stats(sim.url)
            now = int(stats["uptime"])
            per = {int(sec): int(n) for sec, n in stats["requests_by_second"]}
            seen["start"] = now
            return all(per.get(sec, 0) > 5 for sec in range(now - 3, now))

        wait_for(steady, 60, "three seconds of steady load")
        start = seen["start"]
        set_faults(sim.url, {"outage_for": 6})
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    recs = check_exact(r, out, "glaive_fc")
    assert len(recs) == 120  # the outage failed nothing: requests waited it out
    assert not (out / "glaive_fc" / "failed.jsonl").exists()
    stats = sim_stats(sim.url)
    assert stats["outage_rejected"] + stats["outage_cut"] > 0
    # Backoff and the half-open circuit: during the outage the request rate fell under 20% of the rate just
    # before it (16 requests in flight retrying would otherwise hammer the server).
    per_second = {int(sec): int(n) for sec, n in stats["requests_by_second"]}
    before = sum(per_second.get(sec, 0) for sec in range(start - 3, start)) / 3
    during = sum(per_second.get(sec, 0) for sec in range(start + 1, start + 6)) / 5
    assert before > 5 and during < 0.2 * before, (before, during, start, sorted(per_second.items()))


def test_malformed_answers_are_never_counted(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                             tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "100", "--seed", "14", "--malformed-rate", "0.3")
    workers(sim.url, BUDGETQ_BACKOFF_CAP="0.2").start("w0")
    out = tmp_path / "out"
    # --turns last: one answer per record, so each record's completion_tokens is within --max-tokens
    res = produce([str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300", "--out", str(out),
                   "--turns", "last"], redis_url)
    assert res.returncode == 0, res.stderr
    recs = check_exact(r, out, "agent_traces")
    failed = read_jsonl(out / "agent_traces" / "failed.jsonl")
    assert len(recs) + len(failed) == 80
    for x in recs:  # every written record is a valid one
        assert isinstance(x["completion_tokens"], int) and 0 <= x["completion_tokens"] <= 300
        assert x["turns"][0]["finish_reason"] in ("stop", "length")
    assert all("malformed" in f["reason"] or "Payload" in f["reason"] or "502" in f["reason"] for f in failed)
    assert sim_stats(sim.url)["malformed"]


def test_evicting_redis_is_refused(redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path) -> None:
    r.config_set("maxmemory-policy", "allkeys-lru")
    try:
        args = [str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "100", "--detach",
                "--out", str(tmp_path / "out")]
        res = produce(args, redis_url)
        assert res.returncode == 1 and "maxmemory-policy allkeys-lru" in res.stderr
        assert r.dbsize() == 0
        assert produce([*args, "--allow-eviction"], redis_url).returncode == 0
    finally:
        r.config_set("maxmemory-policy", "noeviction")


def test_api_key_is_sent_but_never_stored_or_logged(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                    tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    secret = "sk-budgetq-test-7f3a9c"
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "50", "--api-key", secret)
    pool = workers(sim.url, SGLANG_API_KEY=secret)
    pool.start("w0")
    out = tmp_path / "out"
    res = produce([str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "100", "--max-samples", "10",
                   "--out", str(out)], redis_url)
    assert res.returncode == 0, res.stderr
    assert len(check_exact(r, out, "agent_traces")) == 10  # the key was accepted by the server
    value_of: dict[bytes, Callable[[bytes], object]] = {
        b"string": r.get, b"hash": r.hgetall, b"list": lambda k: r.lrange(k, 0, -1), b"set": r.smembers,
        b"zset": lambda k: r.zrange(k, 0, -1), b"stream": r.xrange}
    for key in r.scan_iter(count=1000):  # nothing in Redis holds the key, in any value
        blob = repr(value_of[raw(r.type(key))](raw(key)))
        assert secret not in blob, key
    assert secret not in res.stdout + res.stderr
    assert secret not in pool.log("w0", partial=True)
    assert os.environ.get("SGLANG_API_KEY") != secret


@pytest.mark.timeout(420)
def test_a_sample_whose_worker_dies_three_times_is_failed(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                          tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    """The failure table's "a chunk's worker dies 3 times": a poison sample (the simulator never answers its
    rid, every attempt) whose worker is killed -9 each time it runs it. The producer reclaims the chunk by
    lease each time and counts the deaths per sample (producer/session/loop.py MAX_RECLAIMS); the third fails it, into
    failed.jsonl. The first death comes while other samples are in flight on that worker: they go back to the
    queue once and complete. The second and third come once everything else is done, so only the poison
    sample is unfinished in its chunk and only it reaches three deaths."""
    from budget.record import request_id
    from producer.session.loop import MAX_RECLAIMS
    selected = [str(x["id"]) for x in read_jsonl(GLAIVE)][:24]
    poison = selected[2]
    sim = sim_factory("--tokens-per-second-per-request", "200", "--mean-tokens", "200", "--seed", "13",
                      "--hang-rid-prefix", request_id("glaive_fc", poison, 0)[:28])
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="4")
    out = tmp_path / "out"
    proc = subprocess.Popen([*produce_cmd(), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1000",
                             "--max-samples", "24", "--chunk-size", "4", "--queue-depth", "2", "--out", str(out),
                             "--order", "file",  # the file's first 24: `selected` and the poison among them
                             "--redis-url", redis_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = keys.DatasetKeys("glaive_fc").done

    def poison_running(runs: int) -> bool:
        stats = sim_stats(sim.url)
        return bool(stats["hangs"] == runs and stats["hanging"] == 1)

    try:
        for death in range(1, MAX_RECLAIMS + 1):
            worker = pool.start(f"w{death}")
            wait_for(functools.partial(poison_running, death), 120, f"the poison sample's run {death} on w{death}")
            if death > 1:  # only the poison sample left unfinished on this worker
                wait_for(lambda: r.hlen(done) == len(selected) - 1 and sim_stats(sim.url)["running"] == 0, 120,
                         "every other sample committed")
            worker.kill()  # kill -9, while it waits on the poison sample
            worker.wait(10)
        _, stderr = proc.communicate(timeout=150)  # the third reclaim fails it; nothing is left to run
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert stderr.count("lost its worker; its unfinished samples go back") >= MAX_RECLAIMS, stderr
    failed = read_jsonl(out / "glaive_fc" / "failed.jsonl")
    assert [(f["id"], f["reason"]) for f in failed] == [(poison, f"its chunk lost its worker {MAX_RECLAIMS} times")]
    recs = check_exact(r, out, "glaive_fc")
    assert sorted(x["id"] for x in recs) == sorted(set(selected) - {poison})  # the rest, each exactly once
    assert sim_stats(sim.url)["hangs"] == MAX_RECLAIMS
    assert r.hlen(keys.DatasetKeys("glaive_fc").failed) == 1
