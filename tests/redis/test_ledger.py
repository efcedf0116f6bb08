"""The budget scripts on a real redis-server: exactly-once under races, close, discard, leases, reconcile."""
from __future__ import annotations

import json
import threading
import time
import zlib

import redis
from rq import Queue
from rq.job import Job
from rq.registry import CanceledJobRegistry
from rq.serializers import JSONSerializer

from budget import keys
from budget.ledger import Admit, Ledger
from producer.session.attach import JobSettings
from producer.session.loop import Item, enqueue_chunks, make_queue
from tests import replies


def enqueue(r: "redis.Redis", name: str, n_chunks: int, size: int = 2) -> list[str]:
    chunks = [[Item(f"{name}-{c}-{i}", [1, 2, 3], False) for i in range(size)] for c in range(n_chunks)]
    return enqueue_chunks(r, make_queue(r), name, chunks, sampling_params={"max_new_tokens": 8}, think=None,
                          settings=JobSettings())


def test_commit_counts_once_under_racing_threads(r: "redis.Redis", redis_url: str) -> None:
    Ledger(r).set_budget("ds", None)
    outcomes: list[bool] = []
    lock = threading.Lock()

    def commit_all() -> None:
        ledger = Ledger(redis.Redis.from_url(redis_url))
        for i in range(200):
            ok = ledger.commit("ds", f"s{i}", 7, {"id": f"s{i}"}).committed
            with lock:
                outcomes.append(ok)

    threads = [threading.Thread(target=commit_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count(True) == 200 and outcomes.count(False) == 600
    k = keys.DatasetKeys("ds")
    assert int(r.get(k.used) or 0) == 200 * 7
    assert r.xlen(k.results) == 200


def test_commit_closes_at_budget_once(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    assert ledger.set_budget("ds", 20) == "open"
    closes = [ledger.commit("ds", f"s{i}", 8, {}).closed_now for i in range(5)]
    assert closes == [False, False, True, False, False]  # 8, 16, 24 >= 20 closes; later in-flight ones count
    state = ledger.state("ds")
    assert state.status == "closed" and state.used == 40


def test_admit_refuses_closed_revoked_and_foreign_samples(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget("ds", 10)
    a, b = enqueue(r, "ds", 2)
    assert ledger.start_chunk("ds", a) == "ok"
    assert ledger.admit("ds", "ds-0-0", a).verdict is Admit.START
    assert ledger.admit("ds", "ds-1-0", a).verdict is Admit.SKIP  # held by chunk b
    ledger.commit("ds", "ds-0-0", 3, {})
    assert ledger.admit("ds", "ds-0-0", a).verdict is Admit.SKIP  # already committed
    ledger.commit("ds", "ds-0-1", 30, {})
    assert ledger.admit("ds", "ds-0-1", a).verdict is Admit.CLOSED
    assert ledger.start_chunk("ds", b) == "closed"


def test_discard_removes_only_that_datasets_jobs_and_shows_them_canceled(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget("a", 5)
    ledger.set_budget("b", None)
    ids_a = enqueue(r, "a", 3)
    ids_b = enqueue(r, "b", 2)
    assert ledger.discard("a", "budget reached") == 0  # still open: nothing to discard
    ledger.commit("a", "x", 9, {})
    assert ledger.discard("a", "budget reached") == 3
    assert ledger.discard("a", "budget reached") == 0  # safe to repeat
    assert replies.texts(r.lrange(keys.RQ_QUEUE, 0, -1)) == ids_b
    job = Job.fetch(ids_a[0], connection=r, serializer=JSONSerializer)
    assert job.get_status() == "canceled" and "budget reached" in (job.description or "")
    registry = CanceledJobRegistry(keys.QUEUE_NAME, connection=r, serializer=JSONSerializer)
    assert sorted(registry.get_job_ids()) == sorted(ids_a)


def test_discard_of_ten_thousand_chunks(r: "redis.Redis") -> None:
    """Correctness at size (the timing target lives in bench/, not here)."""
    ledger = Ledger(r)
    ledger.set_budget("big", 1)
    ledger.set_budget("other", None)
    enqueue(r, "big", 10_000, size=1)
    others = enqueue(r, "other", 5, size=1)
    ledger.commit("big", "x", 1, {})
    assert ledger.discard("big", "budget reached") == 10_000
    assert r.llen(keys.RQ_QUEUE) == 5
    assert replies.texts(r.lrange(keys.RQ_QUEUE, 0, -1)) == others
    assert r.zcard(keys.RQ_CANCELED) == 10_000
    assert ledger.state("big").discards_to_mark == 0


def _evalsha_calls(r: "redis.Redis") -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_discard_marks_jobs_canceled_in_small_calls(r: "redis.Redis") -> None:
    """The queue is emptied in one script; marking the jobs canceled is split so Redis is never held long."""
    ledger = Ledger(r)
    ledger.set_budget("a", 0)
    enqueue(r, "a", 5)
    ledger.discard("a", "warm up")  # loads the scripts (a first EVALSHA fails with NOSCRIPT, then retries)
    ids = enqueue(r, "a", 5)
    before = _evalsha_calls(r)
    assert ledger.discard("a", "budget reached", mark_batch=2) == 5
    assert _evalsha_calls(r) - before == 1 + 3  # discard, then marks of 2, 2 and 1
    for cid in ids:
        job = Job.fetch(cid, connection=r, serializer=JSONSerializer)
        assert job.get_status() == "canceled" and (job.description or "").endswith("[discarded: budget reached]")
        assert 0 < r.ttl(keys.rq_job_key(cid)) <= 7 * 24 * 3600


def test_an_interrupted_discard_is_finished_by_the_next_one(r: "redis.Redis") -> None:
    """A discarder that dies between taking chunks out of the queue and marking them leaves the ids listed;
    the next discard (the producer runs one whenever ``discards_to_mark`` is set) marks them."""
    ledger = Ledger(r)
    ledger.set_budget("a", 0)
    ids = enqueue(r, "a", 3)
    k = keys.DatasetKeys("a")
    assert ledger._discard(keys=[k.meta, k.chunks, keys.RQ_QUEUE, k.discarded]) == 3  # the first step only
    assert r.llen(keys.RQ_QUEUE) == 0
    assert ledger.state("a").discards_to_mark == 3
    assert Job.fetch(ids[0], connection=r, serializer=JSONSerializer).get_status() == "queued"
    assert ledger.discard("a", "budget reached") == 0  # nothing left in the queue; the marking is finished
    assert ledger.state("a").discards_to_mark == 0
    registry = CanceledJobRegistry(keys.QUEUE_NAME, connection=r, serializer=JSONSerializer)
    assert sorted(registry.get_job_ids()) == sorted(ids)


def test_lease_expiry_is_reclaimed_and_the_zombie_is_fenced(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget("ds", None)
    (cid,) = enqueue(r, "ds", 1)
    assert ledger.start_chunk("ds", cid, lease_ms=50) == "ok"
    assert ledger.reclaim("ds") == []
    time.sleep(0.1)  # let the 50 ms lease lapse: the lease is Redis TIME, there is no event to wait on
    assert ledger.reclaim("ds") == [cid]
    assert ledger.refresh_chunk("ds", cid) is False  # the old worker learns it lost the chunk
    assert ledger.admit("ds", "ds-0-0", cid).verdict is Admit.REVOKED
    assert ledger.commit("ds", "ds-0-1", 4, {}).committed  # an in-flight response still counts once


def test_reclaim_queued_never_takes_a_chunk_started_after_the_read(r: "redis.Redis") -> None:
    """The race the reclaim script closes: the producer saw a chunk queued (+inf), a worker then started it
    (its score became a lease) and its job finished (a chunk job ends once its samples have started). Taking
    it back now would drop a running chunk and enqueue its samples again; the script takes only what is still
    +inf when it runs."""
    from rq.job import JobStatus
    ledger = Ledger(r)
    ledger.set_budget("ds", None)
    running, ended, waiting, gone, popped = enqueue(r, "ds", 5)
    k = keys.DatasetKeys("ds")
    seen = set(replies.texts(r.zrangebyscore(k.chunks, "+inf", "+inf")))  # what a client reads first
    assert seen == {running, ended, waiting, gone, popped}
    assert ledger.start_chunk("ds", running) == "ok"  # ... then a worker starts one, and its job finishes
    jobs = {cid: Job.fetch(cid, connection=r, serializer=JSONSerializer) for cid in (running, ended, popped)}
    jobs[running].set_status(JobStatus.FINISHED)
    jobs[ended].set_status(JobStatus.FINISHED)  # its worker ended the job without starting the chunk
    jobs[popped].set_status(JobStatus.STARTED)  # a worker popped it and has not started the chunk yet
    Job.fetch(gone, connection=r, serializer=JSONSerializer).delete(remove_from_queue=False)
    lease = r.zscore(k.chunks, running)
    assert lease is not None and lease != float("inf")

    stale, waiting_start = ledger.reclaim_queued("ds", overdue=[running])
    assert sorted(stale) == sorted([ended, gone]) and waiting_start == [popped]
    assert r.zscore(k.chunks, running) == lease, "a started chunk keeps its lease even when named overdue"
    assert ledger.live_chunks("ds") == {running, waiting, popped}
    assert ledger.refresh_chunk("ds", running) and ledger.admit("ds", "ds-0-0", running).verdict is Admit.START

    stale, waiting_start = ledger.reclaim_queued("ds", overdue=[popped])  # popped three leases ago: taken back
    assert stale == [popped] and waiting_start == []
    assert ledger.live_chunks("ds") == {running, waiting}
    assert ledger.start_chunk("ds", popped) == "revoked"  # its late worker does nothing with it


def test_reclaim_queued_takes_back_a_job_popped_by_a_worker_that_never_ran_it(r: "redis.Redis") -> None:
    """RQ 3 dequeues by moving the job id to its intermediate list and marks it started only later: a worker
    stopped or killed in between leaves the job "queued" but in no queue, and RQ's own cleanup fails it only at
    its next maintenance (up to 10 minutes). The reclaim times such a chunk like a popped one and takes it back
    after the caller's grace, while a chunk whose job is still in the queue is never touched."""
    ledger = Ledger(r)
    ledger.set_budget("ds", None)
    lost, waiting = enqueue(r, "ds", 2)
    assert r.lmove(keys.RQ_QUEUE, keys.RQ_INTERMEDIATE, "LEFT", "RIGHT") == lost.encode()  # RQ's dequeue
    assert Job.fetch(lost, connection=r, serializer=JSONSerializer).get_status() == "queued"

    stale, popped = ledger.reclaim_queued("ds")
    assert stale == [] and popped == [lost], "popped but not started: timed by the caller, not yet taken"
    stale, popped = ledger.reclaim_queued("ds", overdue=[lost, waiting])
    assert stale == [lost] and popped == [], "overdue: taken back; the job still in the queue is not"
    assert ledger.live_chunks("ds") == {waiting}
    assert ledger.start_chunk("ds", lost) == "revoked"  # should its worker come back, it does nothing with it


def test_reconcile_and_uncommit(r: "redis.Redis") -> None:
    ledger = Ledger(r)
    ledger.set_budget("ds", 100)
    ledger.commit("ds", "a", 10, {})
    assert ledger.reconcile("ds", [("a", 10), ("b", 20), ("c", 80)]) == (2, 100)
    state = ledger.state("ds")
    assert state.used == 110 and state.status == "closed"
    assert ledger.uncommit("ds", ["c", "zz"]) == (1, 80)
    state = ledger.state("ds")
    assert state.used == 30 and state.status == "open"


def test_enqueue_batch_is_atomic_with_bookkeeping(r: "redis.Redis") -> None:
    ids = enqueue(r, "ds", 3)
    k = keys.DatasetKeys("ds")
    assert r.zcard(k.chunks) == 3 and r.hlen(k.pending) == 6 and r.llen(keys.RQ_QUEUE) == 3
    job = Queue(keys.QUEUE_NAME, connection=r, serializer=JSONSerializer).fetch_job(ids[0])
    assert job is not None and job.func_name == "worker.rqworker.run_chunk"
    assert job.timeout == JobSettings().job_timeout and job.failure_ttl == JobSettings().failure_ttl
    raw = zlib.decompress(replies.raw(r.hget(keys.rq_job_key(ids[0]), "data")))  # RQ zlib-compresses job data
    assert json.loads(raw)[2][0]["samples"][0]["input_ids"] == [1, 2, 3]  # JSON on the wire, never pickle


def test_reconcile_makes_the_file_the_truth_for_ids_it_holds(r: "redis.Redis") -> None:
    """Redis restored from an older copy re-ran a sample that is on disk with another length: the file wins."""
    ledger = Ledger(r)
    ledger.set_budget("ds", None)
    ledger.commit("ds", "a", 100, {})  # the regenerated response's count, in the restored Redis
    ledger.commit("ds", "b", 7, {})
    assert ledger.reconcile("ds", [("a", 40), ("b", 7), ("c", 5)]) == (1, -55)
    assert ledger.done_ids("ds") == {"a": 40, "b": 7, "c": 5}
    assert ledger.state("ds").used == 52
