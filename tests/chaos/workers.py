"""Chaos scenarios on the workers and on produce: kill -9, a restart under the same name, duplicated jobs,
SIGTERM of every worker, two produce at once, produce killed while it enqueues."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from typing import Any

from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from demo.stack import wait_until
from producer.session.loop import BATCH_CHUNKS
from tests.chaos.audit import DATASET, Result, audit, log_files, sample_ids
from tests.chaos.audit import rounded as _r
from tests.chaos.run import KEYS, QUEUE, ChaosStack, Ctx, Produce, Watch


def worker_kill(ctx: Ctx) -> Result:
    """kill -9 one whole worker every few seconds (round robin), starting a replacement at once."""
    s = ctx.scale
    res = Result("worker-kill", s.name)
    with ctx.stack("worker-kill") as st:
        r = st.client()
        watch = Watch(st.redis_url)
        watch.start()
        prod = ctx.produce(st, "1")
        wait_until(lambda: r.hlen(KEYS.done) >= s.prompts // 20, 120, "5% committed")
        names = list(st.by_name)
        kills, t_last = 0, 0.0
        while r.hlen(KEYS.done) < 0.7 * s.prompts and prod.proc.poll() is None:
            slot = kills % len(names)
            victim = st.by_name[names[slot]]
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            t_last = time.monotonic()
            kills += 1
            names[slot] = f"w{slot}-k{kills}"  # rq refuses the dead worker's name for a while (see worker-restart)
            st.add_worker(names[slot])
            time.sleep(s.kill_every)
        rc = prod.finish(st, 180 + s.prompts / 10, res=res)
        watch.stop()
        t_all = watch.reached(s.prompts)
        recovery = (t_all - t_last) if t_all and t_last else None
        figures = audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir))
        reclaimed = prod.stderr.count("lost its worker")
        res.figures.update(kills=kills, reclaimed_chunks=reclaimed, recovery_s=_r(recovery),
                           wasted_bound=kills * s.concurrency)
        res.check("produce exit 0", rc == 0, f"rc {rc}: {prod.stderr[-300:]}")
        res.check("kills happened", kills >= 2, kills)
        res.check("all committed within 120 s of the last kill", recovery is not None and recovery <= 120,
                  f"{_r(recovery)} s")
        res.check("wasted <= kills x concurrency", figures["wasted"] <= kills * s.concurrency,
                  f"{figures['wasted']} > {kills} x {s.concurrency}")
    return res


def worker_restart(ctx: Ctx) -> Result:
    """kill -9 a worker and restart it at once under the same name; run a chunk twice (a copy of its payload
    under a new job id while it is live) and requeue every finished chunk at the end."""
    s = ctx.scale
    res = Result("worker-restart", s.name)
    with ctx.stack("worker-restart") as st:
        r = st.client()
        q = Queue(QUEUE, connection=r, serializer=JSONSerializer)
        prod = ctx.produce(st, "1")
        wait_until(lambda: r.hlen(KEYS.done) >= s.prompts // 10, 120, "10% committed")
        # 1. The same name at once: rq refuses it while the dead worker's registration lives (worker_ttl).
        name = "w0"
        victim = st.by_name[name]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        again = st.add_worker(name)
        try:
            rc_same: int | None = again.wait(30)
        except subprocess.TimeoutExpired:
            rc_same = None  # still running: rq accepted the name
        log = (st.workdir / f"{name}.log").read_text(errors="replace")
        refused = "There exists an active worker named" in log
        res.figures["same_name_restart"] = "refused by rq" if refused else f"accepted (rc {rc_same})"
        # How long the dead worker's registration keeps its name taken (rq: worker_ttl + 60 s from birth,
        # refreshed by heartbeats). demo.stack.Stack names workers NAME-<pid>.
        res.figures["name_blocked_for_s"] = r.ttl(f"rq:worker:{name}-{os.getpid()}")
        res.check("same-name restart: rq refuses it with a clear message and exits", refused and rc_same == 1,
                  f"rc {rc_same}")
        st.add_worker("w0-new")  # what a supervisor must do: a fresh name (rq's default name is a uuid)
        # 2. A live chunk enqueued again under a new job id: the same samples run in two jobs at once.
        found: Any = (r.zrangebyscore(KEYS.chunks, "-inf", "(inf"),
                      r.zrangebyscore(KEYS.chunks, "+inf", "+inf"))
        running, queued = ([c.decode() for c in ids] for ids in found)
        copies = 0
        for cid in running[:1] + queued[:1]:
            job = Job.fetch(cid, connection=r, serializer=JSONSerializer)
            q.enqueue("worker.rqworker.run_chunk", job.args[0], job_id=f"{cid}-copy", at_front=True)
            copies += 1
        res.figures["chunks_enqueued_twice"] = copies
        rc = prod.finish(st, 180 + s.prompts / 10, res=res)
        res.check("produce exit 0", rc == 0, f"rc {rc}: {prod.stderr[-300:]}")
        # 3. Every finished chunk requeued after the end: nothing may run, nothing may change.
        before_stats = st.sim_stats()
        before_file = (st.workdir / "out" / DATASET / "raw_responses.jsonl").read_bytes()
        used_before = r.get(KEYS.used)
        finished = list(q.finished_job_registry.get_job_ids())
        for jid in finished:
            q.enqueue_job(Job.fetch(jid, connection=r, serializer=JSONSerializer))
        wait_until(lambda: r.llen("rq:queue:" + QUEUE) == 0, 60, "requeued chunks taken")
        time.sleep(2)
        res.figures["finished_chunks_requeued"] = len(finished)
        res.check("requeued finished chunks send nothing",
                  st.sim_stats()["submitted"] == before_stats["submitted"], "requests were sent")
        res.check("requeued finished chunks change nothing",
                  r.get(KEYS.used) == used_before
                  and (st.workdir / "out" / DATASET / "raw_responses.jsonl").read_bytes() == before_file, "")
        figures = audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir),
                        allowed_tracebacks=r"ValueError: There exists an active worker named")
        # One kill: at most one worker's window is redone; a copied chunk may run its samples twice.
        bound = s.concurrency + copies * s.chunk
        res.figures["wasted_bound"] = bound
        res.check("wasted <= one window + the copied chunks", figures["wasted"] <= bound,
                  f"{figures['wasted']} > {bound}")
    return res


def sigterm_all(ctx: Ctx) -> Result:
    """SIGTERM every worker mid-run: each finishes its running requests, gives the rest back, exits."""
    s = ctx.scale
    res = Result("sigterm", s.name)
    with ctx.stack("sigterm") as st:
        r = st.client()
        prod = ctx.produce(st, "1")
        wait_until(lambda: r.hlen(KEYS.done) >= s.prompts // 3, 180, "a third committed")
        procs = list(st.by_name.items())
        t0 = time.monotonic()
        for _, p in procs:
            p.send_signal(signal.SIGTERM)
        exits: dict[str, float] = {}
        codes: dict[str, int | None] = {}
        deadline = t0 + s.request_s + 30
        while len(exits) < len(procs) and time.monotonic() < deadline:
            for name, p in procs:
                if name not in exits and p.poll() is not None:
                    exits[name], codes[name] = time.monotonic() - t0, p.returncode
            time.sleep(0.05)
        slowest = max(exits.values()) if exits else None
        res.figures.update(exit_s={k: _r(v) for k, v in exits.items()}, bound_s=_r(s.request_s + 5))
        res.check("every worker exited 0", len(exits) == len(procs) and all(c == 0 for c in codes.values()),
                  codes)
        res.check("exit within the running requests' time + 5 s", slowest is not None
                  and slowest <= s.request_s + 5, f"{_r(slowest)} s > {_r(s.request_s + 5)} s")
        aborted_at_stop = st.sim_stats()["aborted"]
        res.check("nothing aborted by the shutdown", aborted_at_stop == 0, aborted_at_stop)
        live_running = r.zcount(KEYS.chunks, "-inf", "(inf")
        res.check("no chunk left running", live_running == 0, live_running)
        for i in range(s.workers):
            st.add_worker(f"w{i}-after")
        rc = prod.finish(st, 180 + s.prompts / 10, res=res)
        res.check("produce exit 0", rc == 0, f"rc {rc}: {prod.stderr[-300:]}")
        figures = audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir))
        res.check("nothing redone (wasted = 0)", figures["wasted"] == 0, figures["wasted"])
        res.figures["recovery_s"] = _r(slowest)
    return res


def produce_races(ctx: Ctx) -> Result:
    """Two produce at once (the second refused); produce --detach killed -9 again and again while it prepares
    and enqueues; then a rerun: no sample in two chunks, none lost, none generated twice."""
    s = ctx.scale
    res = Result("produce-races", s.name)
    with ctx.stack("produce-races", workers=0) as st:
        r = st.client()
        first = ctx.produce(st, "first")
        wait_until(lambda: r.exists(KEYS.collector) == 1, 120, "the first produce attached")
        second = ctx.produce(st, "second")
        rc2 = second.wait(120)
        res.check("second produce refused with exit 1", rc2 == 1 and "another produce is attached" in second.stderr,
                  f"rc {rc2}: {second.stderr[-300:]}")
        first.kill()  # its lock is taken over at once by the next produce on this host
        r.flushall()
        shutil.rmtree(st.workdir / "out", ignore_errors=True)
        # Kill detached runs right where they enqueue. A run holds the collector lock once its input is
        # validated and rendered; it then sends its chunks in batches of BATCH_CHUNKS, each one bump of the
        # chunk counter (bq:ds:{n}:seq), then the payloads built and sent in one MULTI/EXEC. Kills land when the
        # lock appears, or 0-200 ms after the counter first moved. Each run may enqueue more than the last
        # (--max-samples grows): every kill can land on work.
        attach_s, window = _detach_window(ctx, st, "probe")
        r.flushall()
        shutil.rmtree(st.workdir / "out", ignore_errors=True)
        kills: list[dict[str, Any]] = []
        points = (("attached", 0.0), ("seq moved", 0.0), ("seq moved", 0.01), ("seq moved", 0.03),
                  ("seq moved", 0.06), ("seq moved", 0.1), ("seq moved", 0.2), ("attached", 0.9 * window))
        held_before = 0
        for i, (trigger, delay) in enumerate(points):
            cap = s.prompts * (i + 1) // len(points)
            seq0 = int(r.get(KEYS.seq) or 0)
            p = ctx.produce(st, f"kill{i}", "--detach", "--max-samples", str(cap))
            if trigger == "attached":
                _wait_attached(r, p)
            else:
                def moved(seq0: int = seq0, p: Produce = p) -> bool:
                    return int(r.get(KEYS.seq) or 0) != seq0 or p.proc.poll() is not None
                wait_until(moved, 300, "the chunk counter moved", interval=0.001)
            time.sleep(delay)
            p.kill()
            n_held = sum(_samples_in_queue(r).values())
            # Whole batches: the queue holds what it held before plus whole batches, or every selected sample.
            added, batch = n_held - held_before, BATCH_CHUNKS * s.chunk
            outcome = ("nothing" if added == 0 else "all" if n_held == cap else
                       f"{added // batch} batches" if added % batch == 0 else f"PART ({n_held})")
            kills.append({"trigger": trigger, "delay_s": round(delay, 3), "rc": p.proc.returncode,
                          "max_samples": cap, "enqueued": outcome})
            held_before = n_held
        res.figures.update(prepare_s=_r(attach_s), enqueue_window_s=round(window, 3), kills=kills)
        res.check("each killed enqueue left whole batches", not [k for k in kills if "PART" in k["enqueued"]],
                  kills)
        held = _samples_in_queue(r)
        dupes = {sid: n for sid, n in held.items() if n > 1}
        res.figures["queued_samples"] = sum(held.values())
        res.check("no sample enqueued twice", not dupes, f"{len(dupes)} samples in two queued chunks")
        for i in range(s.workers):
            st.add_worker(f"w{i}")
        rerun = ctx.produce(st, "rerun")
        rc = rerun.finish(st, 180 + s.prompts / 10, res=res)
        res.check("rerun exit 0", rc == 0, f"rc {rc}: {rerun.stderr[-300:]}")
        figures = audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir))
        res.check("nothing generated twice (wasted = 0)", figures["wasted"] == 0, figures["wasted"])
    return res


def _detach_window(ctx: Ctx, st: ChaosStack, tag: str) -> tuple[float, float]:
    """(seconds until a detached produce attaches, seconds from then until it exits)."""
    r = st.client()
    p = ctx.produce(st, tag, "--detach")
    _wait_attached(r, p)
    attached = time.monotonic()
    p.wait(300)
    return attached - p.started, time.monotonic() - attached


def _wait_attached(r: Any, p: Produce) -> None:
    """Until this produce holds the collector lock (its value names the pid), or has exited."""
    mark = f":{p.proc.pid}:".encode()
    wait_until(lambda: mark in (r.get(KEYS.collector) or b"") or p.proc.poll() is not None, 300,
               "produce attached", interval=0.005)


def _samples_in_queue(r: Any) -> dict[str, int]:
    """sample id -> number of queued chunk jobs holding it."""
    counts: dict[str, int] = {}
    for jid in r.lrange("rq:queue:" + QUEUE, 0, -1):
        try:
            job = Job.fetch(jid.decode(), connection=r, serializer=JSONSerializer)
        except NoSuchJobError:
            continue
        for sample in job.args[0]["samples"]:
            counts[sample["id"]] = counts.get(sample["id"], 0) + 1
    return counts


