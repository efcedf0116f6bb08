"""Chaos scenarios on Redis: kill -9 and restart (AOF everysec), a restart that lost everything, and a restart
from a copy of the AOF taken earlier in the run (a stale backup)."""
from __future__ import annotations

import re
import shutil
import time
from typing import Any

import redis

from demo.appending import read_jsonl
from demo.stack import wait_until
from tests.chaos.audit import DATASET, Result, audit, log_files, sample_ids
from tests.chaos.audit import rounded as _r
from tests.chaos.run import KEYS, ChaosStack, Ctx, Watch

#: What a lost Redis connection looks like in rq's own log lines ("found an unhandled exception, quitting",
#: with the traceback; worker.Worker then waits for Redis and starts its loop again).
REDIS_DOWN_TB = (r"redis\.exceptions\.(ConnectionError|TimeoutError|BusyLoadingError)"
                 r"|ConnectionResetError|ConnectionRefusedError|BrokenPipeError")


def _done(st: ChaosStack) -> int:
    try:
        return int(st.client().hlen(KEYS.done))
    except redis.RedisError:  # down: being killed or restarted
        return 0


def redis_kill(ctx: Ctx) -> Result:
    """kill -9 redis-server three times mid-run and start it again on the same AOF after a few seconds."""
    s = ctx.scale
    res = Result("redis-kill", s.name)
    with ctx.stack("redis-kill") as st:
        out = st.workdir / "out" / DATASET / "raw_responses.jsonl"
        watch = Watch(st.redis_url, out)
        watch.start()
        prod = ctx.produce(st, "1")
        restarts: list[float] = []
        for k in range(3):
            def committed(k: int = k) -> bool:
                return _done(st) >= s.prompts * (k + 1) // 5
            wait_until(committed, 300, f"{(k + 1) * 20}% committed")
            st.kill_redis()
            time.sleep(s.redis_down_s)
            st.start_redis()
            restarts.append(time.monotonic())
        rc = prod.finish(st, 180 + s.prompts / 10, res=res)
        watch.stop()
        workers_back = [watch.first_commit_after(t) for t in restarts]
        produce_back = [watch.first_write_after(t) for t in restarts]
        w_s = [None if b is None else b - t for b, t in zip(workers_back, restarts, strict=True)]
        p_s = [None if b is None else b - t for b, t in zip(produce_back, restarts, strict=True)]
        res.figures.update(kills=3, down_s=s.redis_down_s, workers_back_s=[_r(x) for x in w_s],
                           produce_back_s=[_r(x) for x in p_s],
                           recovery_s=_r(max((x for x in w_s + p_s if x is not None), default=None)))
        res.check("produce exit 0", rc == 0, f"rc {rc}: {prod.stderr[-300:]}")
        res.check("produce rode out each outage", prod.stderr.count("Redis is back") == 3,
                  prod.stderr.count("Redis is back"))
        alive = {n: p.poll() for n, p in st.by_name.items()}
        res.check("every worker still running", all(v is None for v in alive.values()), alive)
        res.check("workers commit again within 30 s", all(x is not None and x <= 30 for x in w_s), w_s)
        res.check("produce writes again within 30 s", all(x is not None and x <= 30 for x in p_s), p_s)
        figures = audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir),
                        allowed_tracebacks=REDIS_DOWN_TB)
        # Nothing acknowledged was lost: a lost commit would have been generated again.
        res.check("nothing acknowledged lost (wasted = 0)", figures["wasted"] == 0, figures["wasted"])
    return res


def redis_empty(ctx: Ctx) -> Result:
    """Redis killed mid-run and started again with its data gone; produce must notice, a rerun rebuild."""
    s = ctx.scale
    res = Result("redis-empty", s.name)
    with ctx.stack("redis-empty") as st:
        prod = ctx.produce(st, "1")
        wait_until(lambda: _done(st) >= s.prompts // 3, 300, "a third committed")
        st.kill_redis()
        shutil.rmtree(st.redis_dir)
        st.redis_dir.mkdir()
        st.start_redis()
        t_back = time.monotonic()
        rc1 = prod.wait(120)
        detected = (prod.ended or time.monotonic()) - t_back
        _lost_state(res, prod, rc1, "lost this run's state")
        res.figures["detected_after_s"] = _r(detected)
        rerun = ctx.produce(st, "2")
        rc2 = rerun.finish(st, 180 + s.prompts / 10, res=res)
        res.check("rerun exit 0", rc2 == 0, f"rc {rc2}: {rerun.stderr[-300:]}")
        res.check("rerun recounted the file", "counted" in rerun.stderr, rerun.stderr[:300])
        res.figures["rerun_s"] = _r((rerun.ended or 0) - rerun.started)
        res.figures["recovery_s"] = res.figures["detected_after_s"]
        audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir),
              allowed_tracebacks=REDIS_DOWN_TB)
    return res


def redis_stale(ctx: Ctx) -> Result:
    """A copy of Redis' AOF directory taken at 20% of the run; at 50% Redis is killed and started again from
    that copy (a stale backup restored). produce must notice; a rerun must end exact."""
    s = ctx.scale
    res = Result("redis-stale", s.name)
    with ctx.stack("redis-stale") as st:
        prod = ctx.produce(st, "1")
        wait_until(lambda: _done(st) >= s.prompts // 5, 300, "20% committed")
        snapshot = st.workdir / "redis-copy"
        shutil.copytree(st.redis_dir, snapshot)
        res.figures["copied_at_committed"] = _done(st)
        wait_until(lambda: _done(st) >= s.prompts // 2, 300, "50% committed")
        st.kill_redis()
        shutil.rmtree(st.redis_dir)
        shutil.copytree(snapshot, st.redis_dir)
        st.start_redis()
        t_back = time.monotonic()
        res.figures["restored_committed"] = _done(st)
        rc1 = prod.wait(120)
        res.figures["detected_after_s"] = _r((prod.ended or time.monotonic()) - t_back)
        _lost_state(res, prod, rc1, "went back to an older state|lost this run's state")
        # The operator reruns a little later; meanwhile the workers go on with what the restored queue holds.
        time.sleep(2 * s.request_s)
        rerun = ctx.produce(st, "2")
        rc2 = rerun.finish(st, 180 + s.prompts / 10, res=res)
        res.check("rerun exit 0", rc2 == 0, f"rc {rc2}: {rerun.stderr[-300:]}")
        res.figures["rerun_s"] = _r((rerun.ended or 0) - rerun.started)
        res.figures["recovery_s"] = res.figures["detected_after_s"]
        res.figures["regenerated_differently"] = _mismatches(st)
        audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir),
              allowed_tracebacks=REDIS_DOWN_TB)
    return res


def redis_host_crash(ctx: Ctx) -> Result:
    """Redis' host crashes (appendfsync everysec): the writes of about the last second never reached the disk.
    Emulated: the AOF directory is copied at 30% of the run, Redis goes on for 1 s, then is killed and started
    from the copy. Commits of that second are gone from Redis (some of their results may already be on disk):
    their samples are generated again, and nothing is counted twice."""
    s = ctx.scale
    res = Result("redis-host-crash", s.name)
    with ctx.stack("redis-host-crash") as st:
        prod = ctx.produce(st, "1")
        wait_until(lambda: _done(st) >= s.prompts * 3 // 10, 300, "30% committed")
        snapshot = st.workdir / "redis-copy"
        shutil.copytree(st.redis_dir, snapshot)
        time.sleep(1.0)  # the second everysec may lose: what the copy misses
        before = _done(st)
        st.kill_redis()
        shutil.rmtree(st.redis_dir)
        shutil.copytree(snapshot, st.redis_dir)
        st.start_redis()
        res.figures.update(committed_at_crash=before, commits_lost=before - _done(st))
        rc = prod.finish(st, 180 + s.prompts / 10, res=res)
        # Results of lost commits already on disk: produce sees Redis count less than the file and stops (exit
        # 1, "went back to an older state"); the operator's rerun makes the file the truth. Otherwise it goes on.
        res.figures["produce_stopped"] = rc == 1
        if rc == 1:
            _lost_state(res, prod, rc, "went back to an older state")
            rerun = ctx.produce(st, "2")
            rc = rerun.finish(st, 180 + s.prompts / 10, res=res)
        res.check("produce (or its rerun) exit 0", rc == 0, f"rc {rc}")
        res.figures["regenerated_differently"] = _mismatches(st)
        figures = audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir),
                        allowed_tracebacks=REDIS_DOWN_TB)
        res.check("regenerated at most what Redis lost plus the requests then in flight",
                  figures["wasted"] <= res.figures["commits_lost"] + s.in_flight, figures["wasted"])
    return res


def _lost_state(res: Result, prod: Any, rc: int, message: str) -> None:
    err = prod.stderr
    res.check("produce stopped with exit 1 and a clear message", rc == 1 and re.search(message, err) is not None,
              f"rc {rc}: {err[-300:]}")
    res.check("no traceback from produce", "Traceback" not in err, err[-500:])


def _mismatches(st: ChaosStack) -> int:
    """Samples whose record on disk and whose count in Redis' done hash disagree (generated twice)."""
    path = st.workdir / "out" / DATASET / "raw_responses.jsonl"
    on_disk = {str(rec["id"]): int(rec["completion_tokens"]) for rec in read_jsonl(path)}
    raw: Any = st.client().hgetall(KEYS.done)
    done = {k.decode(): int(v) for k, v in raw.items()}
    return sum(1 for sid, n in on_disk.items() if sid in done and done[sid] != n)
