"""Chaos scenarios of a Redis that goes away mid-run and comes back with its data (issue 12): killed -9 and
started again from its AOF after 20 s or 90 s, frozen (SIGSTOP) for 45 s, and every open connection to it
black-holed at once (tests/chaos/blackhole.py: what a crashed host or a replaced pod looks like, no reset ever sent).

The promise under each: no worker hangs or exits, no request is generated twice (wasted = 0: a response that
finished during the fault is committed once Redis answers again, before its chunk's lease is reclaimed),
every sample exactly once, and produce done about as soon after the fault as the work left needs.
"""
from __future__ import annotations

import re
import time
from typing import Callable

from demo.stack import wait_until
from tests.chaos.audit import DATASET, Result, audit, log_files, sample_ids
from tests.chaos.audit import rounded as _r
from tests.chaos.redis_faults import REDIS_DOWN_TB, _done
from tests.chaos.run import ChaosStack, Ctx, Watch

#: What a worker logs when a Redis connection went silent or away: budget/runtime.py's timeout warning,
#: the dispatcher's wait for Redis, or rq's own dequeue retry.
LOST_CONNECTION = r"did not answer within|Redis unavailable|could not connect to Redis|Redis error in the work loop"
#: rq's own tracebacks when it loses Redis, and the socket timeout chained under redis-py's TimeoutError.
SILENT_TB = REDIS_DOWN_TB + r"|^TimeoutError: timed out$"
#: How much longer than the work left may produce take after the fault: RQ's socket timeout (20 s, worker/
#: rqworker.py DEQUEUE_TIMEOUT_S + 10) for a worker whose RQ connection went silent, plus slack for a loaded
#: machine. Before the fix a silent connection held a worker for 415 s.
DELAY_BOUND_S = 45.0


Inject = Callable[[ChaosStack], "int | None"]


def _kill(down_s: float) -> Inject:
    def inject(st: ChaosStack) -> None:
        st.kill_redis()
        time.sleep(down_s)
        st.start_redis()
    return inject


def _freeze(frozen_s: float) -> Inject:
    def inject(st: ChaosStack) -> None:
        st.freeze_redis(True)
        try:
            time.sleep(frozen_s)
        finally:
            st.freeze_redis(False)
    return inject


def _silence(st: ChaosStack) -> int:
    assert st.blackhole is not None
    return st.blackhole.silence()


def redis_kill_20(ctx: Ctx) -> Result:
    """kill -9 redis-server at 30% of the run; started again from its AOF 20 s later."""
    return _outage(ctx, "redis-kill-20s", _kill(20.0))


def redis_kill_90(ctx: Ctx) -> Result:
    """kill -9 redis-server at 30% of the run; started again from its AOF 90 s later (every lease lapsed)."""
    return _outage(ctx, "redis-kill-90s", _kill(90.0))


def redis_freeze_45(ctx: Ctx) -> Result:
    """SIGSTOP redis-server at 30% of the run, SIGCONT 45 s later: connections open, nothing answered."""
    return _outage(ctx, "redis-freeze-45s", _freeze(45.0))


def redis_blackhole(ctx: Ctx) -> Result:
    """Every client (workers, produce) reaches Redis through a proxy that, at 30% of the run, stops forwarding
    on every open connection without closing it; new connections work."""
    return _outage(ctx, "redis-blackhole", _silence, blackhole=True)


def _outage(ctx: Ctx, name: str, inject: Inject, blackhole: bool = False) -> Result:
    s = ctx.scale
    res = Result(name, s.name)
    with ctx.stack(name, blackhole=blackhole) as st:
        out = st.workdir / "out" / DATASET / "raw_responses.jsonl"
        watch = Watch(st.direct_url, out)
        watch.start()
        prod = ctx.produce(st, "1")
        wait_until(lambda: _done(st) >= s.prompts * 3 // 10, 300, "30% committed")
        t_fault = time.monotonic()
        at_fault = _done(st)
        running = int(st.sim_stats().get("running", 0))
        first = watch.reached(1) or prod.started
        rate = at_fault / max(1e-3, t_fault - first)  # samples/s before the fault
        silenced = inject(st)  # returns once the fault is over (Redis back) or in place (the black hole)
        t_back = time.monotonic()
        rc = prod.finish(st, 240 + s.prompts / 10, res=res)
        watch.stop()
        rest_s = (s.prompts - at_fault) / rate if rate > 0 else 0.0
        after = (prod.ended or time.monotonic()) - t_back
        w_back, p_back = watch.first_commit_after(t_back), watch.first_write_after(t_back)
        res.figures.update(
            fault_s=_r(t_back - t_fault), committed_at_fault=at_fault, running_at_sim=running,
            connections_silenced=silenced,
            workers_back_s=_r(None if w_back is None else w_back - t_back),
            produce_back_s=_r(None if p_back is None else p_back - t_back),
            produce_done_after_fault_s=_r(after), work_left_s=_r(rest_s), delay_s=_r(after - rest_s))
        res.check("produce exit 0", rc == 0, f"rc {rc}: {prod.stderr[-300:]}")
        alive = {n: p.poll() for n, p in st.by_name.items()}
        res.check("every worker still running", all(v is None for v in alive.values()), alive)
        res.check(f"produce done within {DELAY_BOUND_S:.0f} s of the work left", after - rest_s <= DELAY_BOUND_S,
                  f"{after:.1f} s after the fault, {rest_s:.1f} s of work left")
        quiet = [n for n in st.by_name
                 if not re.search(LOST_CONNECTION, (st.workdir / f"{n}.log").read_text(errors="replace"))]
        res.check("each worker logged the lost connection", not quiet, quiet)
        figures = audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir),
                        allowed_tracebacks=SILENT_TB)
        res.check("nothing generated twice (wasted = 0)", figures["wasted"] == 0, figures["wasted"])
    return res
