"""Enqueueing on a real redis-server: the job data workers read, the batches, and a produce killed between them.

The producer writes chunk job data itself (orjson straight from the rendered arrays, zlib level 1) instead of
RQ's stdlib json + zlib level 6. Workers read it with rq's ``JSONSerializer`` (stdlib ``json.loads``), so these
tests read it the same way; tests/e2e/test_e2e.py runs real ``rq worker -w worker.Worker`` processes on it.
``produce --detach`` sends a dataset in batches of ``BATCH_CHUNKS`` chunks, one MULTI/EXEC each: MONITOR shows
the transactions as Redis executes them.

Connections that wait on Redis for long (MONITOR, a blocking command) are made with ``socket_timeout=None``:
redis-py 8 gives every connection a 5 s read timeout by default, and produce sends nothing for longer than that
while it loads the tokenizer and renders the prompts on a loaded machine.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import zlib
from array import array
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.job import Job
from rq.serializers import JSONSerializer

from budget import keys
from budget.record import VERSION, ThinkPayload
from producer.session.loop import (
    BATCH_CHUNKS,
    ZLIB_LEVEL,
    ChunkJob,
    ChunkSerializer,
    Item,
    JobSettings,
    enqueue_chunks,
    make_queue,
    pop_chunk,
)
from tests.demo_data import CODE
from tests.procs import produce, produce_cmd, read_jsonl
from tests.rq_jobs import job_payloads, rq_reader

SETTINGS = JobSettings()


def test_job_data_is_standard_json_that_rq_reads(r: "redis.Redis") -> None:
    """Arrays (as prepare keeps them) and lists give the same JSON; every field reads back through RQ."""
    ids = array("i", [0, 7, 151_643, 2**31 - 1])
    chunks = [[Item("a", ids, True), Item("b", [1, 2, 3], False)], [Item("c", array("i", [5]), False)]]
    params = {"max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95}
    think: ThinkPayload = {"start": "<think>", "end": "</think>"}
    cids = enqueue_chunks(r, make_queue(r), "ds", chunks, sampling_params=params, think=think, settings=SETTINGS)
    assert cids == ["bq-ds-0000001", "bq-ds-0000002"]
    raw = r.hget(keys.rq_job_key(cids[0]), "data")
    assert isinstance(raw, bytes) and raw[:2] == b"\x78\x01"  # zlib header, FLEVEL 0: the fastest level
    text = zlib.decompress(raw)
    func, instance, args, kwargs = json.loads(text, parse_constant=pytest.fail)  # strict standard JSON
    assert (func, instance, kwargs) == ("worker.rqworker.run_chunk", None, {})
    assert args == [{"v": VERSION, "dataset": "ds", "chunk": cids[0], "sampling_params": params, "think": think,
                     "reasoning_parser": "none", "samples": [{"id": "a", "input_ids": [0, 7, 151_643, 2**31 - 1], "opens_think": True},
                                 {"id": "b", "input_ids": [1, 2, 3], "opens_think": False}]}]
    job = rq_reader(r).fetch_job(cids[1])
    assert job is not None and type(job) is Job
    assert job.func_name == "worker.rqworker.run_chunk"
    assert job.args[0]["samples"] == [{"id": "c", "input_ids": [5], "opens_think": False}]
    assert job.meta == {"dataset": "ds", "samples": 1, "first": "c", "last": "c"}
    assert job.description == "ds: 1 samples (c .. c)"
    assert (job.timeout, job.result_ttl, job.failure_ttl) == (SETTINGS.job_timeout, SETTINGS.result_ttl,
                                                             SETTINGS.failure_ttl)
    assert job.get_status() == "queued" and job.origin == keys.QUEUE_NAME


def test_chunks_at_front_go_before_the_queued_ones_in_their_order(r: "redis.Redis") -> None:
    """Samples given back come before every queued chunk in the run's order (docs/generations.md, rounds): enqueued
    ``at_front``, they are the next chunks a worker takes, first chunk first."""
    queue = make_queue(r)
    params = {"max_new_tokens": 8}
    later = enqueue_chunks(r, queue, "ds", [[Item("c", [1], False)], [Item("d", [1], False)]],
                           sampling_params=params, think=None, settings=SETTINGS)
    back = enqueue_chunks(r, queue, "ds", [[Item("a", [1], False)], [Item("b", [1], False)]],
                          sampling_params=params, think=None, settings=SETTINGS, at_front=True)
    assert queue.get_job_ids() == back + later


def test_a_chunk_is_all_given_back_samples_or_all_new_ones() -> None:
    """The producer's refill keeps the given-back front of the to-do list in chunks of its own, which go to the
    queue's front; the new samples after it go to the back as before."""
    todo = deque(["a", "b", "c", "d", "e"])
    assert pop_chunk(todo, 3, 2) == ["a", "b"]
    assert pop_chunk(todo, 1, 2) == ["c"]
    assert pop_chunk(todo, 0, 4) == ["d", "e"]
    assert not todo


def test_chunk_job_hash_is_rqs_own_but_for_the_zlib_level(r: "redis.Redis") -> None:
    """Every field of the job hash is what RQ's Job.to_dict writes; only the data's compression level differs."""
    payload = {"samples": [{"id": "a", "input_ids": list(range(500)), "opens_think": False}]}
    made = {}
    for cls, serializer in ((Job, JSONSerializer), (ChunkJob, ChunkSerializer)):
        job = cls.create("worker.rqworker.run_chunk", args=(payload,), connection=r, id="bq-x-0000001",
                         timeout=60, result_ttl=70, failure_ttl=80, description="d", meta={"m": 1},
                         origin=keys.QUEUE_NAME, serializer=serializer)
        job.created_at = job.enqueued_at = datetime(2026, 1, 1, tzinfo=timezone.utc)
        made[cls] = job.to_dict()
    ours, theirs = made[ChunkJob], made[Job]
    assert ours.keys() == theirs.keys()
    assert {k: v for k, v in ours.items() if k not in ("data", "meta")} == \
        {k: v for k, v in theirs.items() if k not in ("data", "meta")}
    assert json.loads(ours["meta"]) == json.loads(theirs["meta"])
    assert json.loads(zlib.decompress(ours["data"])) == json.loads(zlib.decompress(theirs["data"]))
    assert ours["data"] == zlib.compress(zlib.decompress(ours["data"]), ZLIB_LEVEL)


class Monitor:
    """Redis MONITOR in a thread: every command Redis executes, grouped into each client's MULTI/EXEC blocks.

    It only records; the reader may lag behind Redis by many batches under load (MONITOR streams every command, job
    data included), so nothing is decided from it while produce runs: `PauseAfterFirstBatch` does that in Redis."""

    STOP = "bq-test-monitor-stop"

    def __init__(self, url: str) -> None:
        self.url = url
        self.batches: list[list[str]] = []  # the commands of each transaction that enqueued chunks
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Monitor":
        self.thread.start()
        assert self.ready.wait(30), "MONITOR did not start"
        if self.error is not None:
            raise AssertionError(f"MONITOR did not start: {self.error!r}") from self.error
        return self

    def __exit__(self, *exc: Any) -> None:
        client = redis.Redis.from_url(self.url)
        client.echo(self.STOP)  # MONITOR shows it last: every command before it has been seen
        client.close()
        self.thread.join(120)  # a reader that is far behind catches up; it never waits for Redis past the STOP
        if self.error is not None:
            raise AssertionError(f"the MONITOR reader failed: {self.error!r}") from self.error
        assert not self.thread.is_alive(), "the MONITOR reader never saw the end marker"

    def _run(self) -> None:
        try:
            self._read()
        except BaseException as e:  # noqa: BLE001 - handed to __exit__, which fails the test with it
            self.error = e
            self.ready.set()

    def _read(self) -> None:
        open_tx: dict[str, list[str]] = {}
        with redis.Redis.from_url(self.url, socket_timeout=None).monitor() as m:
            self.ready.set()
            for entry in m.listen():
                cmd, client = entry["command"], f"{entry.get('client_address')}:{entry.get('client_port')}"
                if cmd == f"ECHO {self.STOP}":
                    return
                if cmd == "MULTI":
                    open_tx[client] = []
                elif cmd == "EXEC":
                    tx = open_tx.pop(client, [])
                    if any(c.startswith(f"RPUSH {keys.RQ_QUEUE} ") for c in tx):
                        self.batches.append(tx)
                elif client in open_tx:
                    open_tx[client].append(cmd)


def batch_shape(tx: list[str], dataset: str) -> tuple[list[str], list[str]]:
    """(chunk ids pushed, sample ids given a holder) by one transaction; checks it carries all of each chunk."""
    k = keys.DatasetKeys(dataset)
    pushed = [c.split()[2] for c in tx if c.startswith(f"RPUSH {keys.RQ_QUEUE} ")]
    (zadd,) = [c for c in tx if c.startswith(f"ZADD {k.chunks} ")]
    assert zadd.split()[3::2] == pushed and set(zadd.split()[2::2]) == {"inf"}  # queued (score inf) in the live set in the same transaction
    (hset,) = [c for c in tx if c.startswith(f"HSET {k.pending} ")]
    holders = hset.split()[2:]
    assert set(holders[1::2]) == set(pushed)
    for cid in pushed:  # the job hash itself: status, then RQ's whole mapping
        assert sum(c.startswith(f"HSET {keys.rq_job_key(cid)} ") for c in tx) == 2
    return pushed, holders[0::2]


@pytest.mark.e2e
def test_detach_sends_a_dataset_in_atomic_batches(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                  tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    """150 one-sample chunks: 3 MULTI/EXEC of 64, 64 and 22 chunks, each with its bookkeeping; then real workers
    run every chunk and an attached produce collects each sample exactly once."""
    args = [str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "64", "--chunk-size", "1",
            "--out", str(tmp_path / "out")]
    with Monitor(redis_url) as mon:
        res = produce([*args, "--detach"], redis_url)
    assert res.returncode == 0, res.stderr
    shapes = [batch_shape(tx, "code_instruct") for tx in mon.batches]
    assert [len(pushed) for pushed, _ in shapes] == [BATCH_CHUNKS, BATCH_CHUNKS, 150 - 2 * BATCH_CHUNKS]
    samples = [sid for _, held in shapes for sid in held]
    assert len(samples) == len(set(samples)) == 150
    assert r.llen(keys.RQ_QUEUE) == 150

    sim = sim_factory("--zero-latency", "--length-dist", "fixed", "--mean-tokens", "16")
    workers(sim.url, BUDGETQ_CONCURRENCY="16").start("w0")
    again = produce(args, redis_url)
    assert again.returncode == 0, again.stderr
    recs = read_jsonl(tmp_path / "out" / "code_instruct" / "raw_responses.jsonl")
    assert sorted(x["id"] for x in recs) == sorted(samples)
    assert int(r.get(keys.DatasetKeys("code_instruct").used) or 0) == sum(x["completion_tokens"] for x in recs)


@pytest.fixture
def many_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "many.jsonl"
    with open(path, "w") as fh:
        for i in range(2_000):
            fh.write(json.dumps({"id": f"m{i}", "messages": [{"role": "user", "content": f"Say {i} in words."}]})
                     + "\n")
    return path


class PauseAfterFirstBatch:
    """Redis pauses writes right after the EXEC of the first transaction that creates the RQ queue, before it runs
    a command of any other client: decided inside Redis, so however late this process is scheduled, produce gets
    no write in after its first batch.

    One connection sends ``BLMOVE queue queue RIGHT RIGHT 0`` and ``CLIENT PAUSE ... WRITE`` in one write. BLMOVE
    waits while the queue does not exist (a flushed database) and Redis serves it once the EXEC that created it has
    run (a transaction is one unit: a blocked client is never served in its middle); moving a list's tail onto its
    own tail leaves the list as it was. Redis runs the CLIENT PAUSE waiting in that connection's input when it
    unblocks it, before it polls its clients again (beforeSleep), and produce can send nothing more before then:
    it waits for that EXEC's reply. A pause sent by the test when it sees the EXEC, through MONITOR or otherwise,
    can come after produce has sent every batch."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=None)
        self.client_id = int(self.client.client_id())  # the pool holds this one connection: the thread reuses it
        self.paused = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.blmove(keys.RQ_QUEUE, keys.RQ_QUEUE, 0, "RIGHT", "RIGHT")
                pipe.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
                moved, ok = pipe.execute()
            assert moved is not None and ok, (moved, ok)
            self.paused.set()
        except redis.ConnectionError:
            pass  # cancel(): the connection was killed before the queue existed
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e

    def cancel(self, admin: "redis.Redis") -> None:
        """Drop the waiting connection (and the CLIENT PAUSE behind its BLMOVE) if the queue never appeared."""
        if self.thread.is_alive():
            admin.client_kill_filter(_id=str(self.client_id))
        self.thread.join(30)
        assert not self.thread.is_alive(), "the BLMOVE connection did not end"
        self.client.close()


def test_produce_killed_between_batches_leaves_whole_batches_and_the_rerun_adds_the_rest(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, many_prompts: Path) -> None:
    """Writes are paused inside Redis the moment the first batch's EXEC has run, and produce is killed -9 while
    blocked on its next write: Redis holds that whole batch and nothing of the next. The rerun enqueues exactly the
    samples that are not held by a queued chunk."""
    total = 2_000
    args = [f"many={many_prompts}", "--tokenizer", str(tokenizer_dir), "--max-tokens", "64", "--chunk-size", "1",
            "--out", str(tmp_path / "out"), "--detach", "--redis-url", redis_url]
    pause = PauseAfterFirstBatch(redis_url)
    proc = subprocess.Popen([*produce_cmd(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # The pause, or produce ending without a batch (then its stderr says why, at once, instead of a timeout).
        deadline = time.monotonic() + 240
        while not pause.paused.wait(0.1) and proc.poll() is None and time.monotonic() < deadline:
            pass
        ended = proc.poll()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        pause.cancel(r)
        r.execute_command("CLIENT", "UNPAUSE")
    assert pause.error is None, repr(pause.error)
    assert pause.paused.is_set(), f"produce never enqueued a batch (exit {ended}): {err}"
    assert ended is None and proc.returncode == -signal.SIGKILL, (ended, err)  # killed mid-run, not after it
    k = keys.DatasetKeys("many")
    assert r.llen(keys.RQ_QUEUE) == BATCH_CHUNKS  # the first batch whole, nothing of the second
    held = [s["id"] for p in job_payloads(r) for s in p["samples"]]
    assert len(held) == len(set(held)) == BATCH_CHUNKS == r.hlen(k.pending) == r.zcard(k.chunks)

    res = subprocess.run([*produce_cmd(), *args], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    held = [s["id"] for p in job_payloads(r) for s in p["samples"]]
    assert sorted(held) == sorted(f"m{i}" for i in range(total))  # every sample once: none lost, none twice
    assert r.zcard(k.chunks) == r.hlen(k.pending) == total
