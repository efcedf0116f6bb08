"""Benchmark: a mix run stopped by its deadline (issue 27 §3, docs/mix.md "A deadline").

    python -m bench.deadline --repeats 2          # ~4 minutes a repeat; results in bench/results/deadline.json

One stack (redis-server, sglang-sim at --time-scale, --workers workers x 16 in flight) and, per repeat, two runs
of the mix of bench/mix_proportion.py (a, b, c, weights 1:1:2, mean lengths --lengths, default 1:4:8):

1. the calibration: the whole ``--budget TOTAL`` with no deadline. Its throughput R is the committed tokens per
   second between 10% and 90% of the total (the batch full, before the end's taper); the time the budget needs
   is T = TOTAL / R (the run's own wall time, start to exit, is reported beside it: it adds the start and the
   taper);
2. the same mix under other names with ``--deadline`` at --fraction (0.6) x T from its start.

Reported for the deadline run:

- ``at_deadline``: the tokens committed at the deadline (the watcher's samples, every 0.2 s) and at the end,
  against R x the time from ``produce`` starting to the deadline;
- ``thrown_away``: the simulator's aborted requests during the run, and the tokens it generated (its
  ``completion_tokens_total``) that budgetq did not commit (sum of ``bq:ds:{n}:used``); the calibration run gives
  the same two figures as the control (what differs between the counters when nothing is thrown away);
- ``calibration_at_same_time``: what the calibration run had committed as long after its start (the control);
  ``committed_after_deadline``: what the requests running at the deadline added;
- ``past_deadline_s``: how far past the deadline the simulator's last request ended (its running and queued
  counts polled every 0.1 s: the first poll from which both stay 0), and when ``produce`` exited;
  ``live_at_deadline`` requests were running then, 90% of them had ended ``p90_of_them_ended_after_s`` later;
  ``mean_live_last_10s``: the requests running over the 10 s before the deadline (the occupancy the closes
  leave; --workers x 16 is full);
- ``closed_before_deadline_s``: how long before the deadline each dataset closed (its ``closed_by`` first seen);
- ``closed_by``: each dataset's ``closed_by`` (``deadline`` expected);
- ``final_pp`` / ``at_deadline_pp``: the worst deviation of a, b, c's shares of the committed tokens from their
  weights' shares, in percentage points, at the end and at the deadline.
"""
from __future__ import annotations

import argparse
import datetime
import json
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from bench.harness import save_results, scratch, sim_args
from bench.mix_proportion import Mix, Trace, build_mix, deviation, length_sim_args, run_produce
from budget.keys import DatasetKeys
from demo.stack import Stack


class SimPoll(threading.Thread):
    """(wall time, running + queued, completion tokens, aborted) of the simulator every ``interval`` s, and the
    wall time each dataset's ``closed_by`` was first seen set."""

    def __init__(self, stack: Stack, names: Sequence[str], interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.stack, self.names, self.interval = stack, list(names), interval
        self.stop_flag = threading.Event()
        self.samples: list[tuple[float, int, int, int]] = []
        self.closed_at: dict[str, float] = {}

    def run(self) -> None:
        r = self.stack.client()
        while not self.stop_flag.is_set():
            try:
                s = self.stack.sim_stats()
                self.samples.append((time.time(), int(s["running"]) + int(s["queued"]),
                                     int(s["completion_tokens_total"]), int(s["aborted"])))
            except OSError:
                pass
            for n in self.names:
                if n not in self.closed_at and r.hget(DatasetKeys(n).meta, "closed_by"):
                    self.closed_at[n] = time.time()
            self.stop_flag.wait(self.interval)

    def live_at(self, when: float) -> int:
        before = [live for t, live, _, _ in self.samples if t <= when]
        return before[-1] if before else 0


def sim_counters(stack: Stack) -> tuple[int, int]:
    """The simulator's (completion tokens, aborted requests) since it started."""
    s = stack.sim_stats()
    return int(s["completion_tokens_total"]), int(s["aborted"])


def steady_rate(trace: Trace, total: int, lo: float = 0.1, hi: float = 0.9) -> float:
    """Committed tokens per second between the samples where the run had ``lo`` and ``hi`` of the total: the
    throughput once the batch is full and before the end's taper, which a deadline is planned against."""
    pts = [(t, sum(s.values())) for t, s in trace.samples]
    a = next(p for p in pts if p[1] >= lo * total)
    b = next(p for p in pts if p[1] >= hi * total)
    return (b[1] - a[1]) / (b[0] - a[0])


def used_at(trace: Trace, when: float) -> int:
    """All datasets' committed tokens at wall time ``when``: the last sample at or before it."""
    before = [sum(s.values()) for t, s in trace.samples if t <= when]
    return before[-1] if before else 0


def shares_at(trace: Trace, when: float) -> dict[str, int]:
    before = [s for t, s in trace.samples if t <= when]
    return before[-1] if before else {}


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def run_once(stack: Stack, work: Path, tok: Path, base: Mix, prefix: str, args: argparse.Namespace,
             deadline_in: float | None) -> tuple[dict[str, Any], Trace]:
    """One produce of the mix named with ``prefix``; with ``deadline_in`` seconds, a --deadline that far ahead."""
    m = base.named(prefix)
    extra: list[str] = []
    deadline = None
    if deadline_in is not None:
        deadline = time.time() + deadline_in
        extra = ["--deadline", datetime.datetime.fromtimestamp(deadline, datetime.timezone.utc).isoformat()]
    tokens0, aborted0 = sim_counters(stack)
    poll = SimPoll(stack, list(m.files))
    poll.start()
    _, trace, t0, t1 = run_produce(stack, m, tok, work / "out" / prefix, args, extra)
    # produce exits once every chunk is settled; the simulator is idle by then unless something was left running
    time.sleep(1.0)
    poll.stop_flag.set()
    poll.join(5)
    tokens1, aborted1 = sim_counters(stack)
    r = stack.client()
    used = {n: int(r.get(DatasetKeys(n).used) or 0) for n in m.files}
    closed = {n: _text(r.hget(DatasetKeys(n).meta, "closed_by")) for n in m.files}
    busy = [t for t, live, _, _ in poll.samples if live > 0]
    row: dict[str, Any] = {
        "run": prefix, "seconds": round(t1 - t0, 2), "used": used, "total_used": sum(used.values()),
        "closed_by": closed, "final_pp": round(deviation(used, m.weights), 3),
        "thrown_away": {"aborted": aborted1 - aborted0,
                        "generated_not_committed": (tokens1 - tokens0) - sum(used.values())},
        "last_request_end": busy[-1] if busy else None, "t0": t0, "t1": t1,
    }
    if deadline is None:
        row["steady_tokens_per_s"] = round(steady_rate(trace, args.total), 1)
    if deadline is not None:
        at = shares_at(trace, deadline)
        row.update({
            "deadline_after_s": round(deadline - t0, 2),
            "tokens_at_deadline": used_at(trace, deadline),
            "at_deadline_pp": round(deviation(at, m.weights), 3) if at else None,
            "past_deadline_s": None if not busy else round(busy[-1] + poll.interval - deadline, 2),
            "produce_exit_after_deadline_s": round(t1 - deadline, 2),
            "committed_after_deadline": sum(used.values()) - used_at(trace, deadline),
            "closed_before_deadline_s": {n: round(deadline - t, 2) for n, t in sorted(poll.closed_at.items())},
        })
        live = poll.live_at(deadline)
        last10 = [x for t, x, _, _ in poll.samples if deadline - 10 <= t <= deadline]
        tail = [t for t, x, _, _ in poll.samples if t > deadline and x <= 0.1 * live]
        row.update({"live_at_deadline": live,
                    "mean_live_last_10s": round(sum(last10) / len(last10), 1) if last10 else None,
                    "p90_of_them_ended_after_s": round(tail[0] - deadline, 2) if tail else None})
    return row, trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1, help="calibration + deadline pairs (default %(default)s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--total", type=int, default=600_000, help="the mix's total budget (default %(default)s)")
    ap.add_argument("--fraction", type=float, default=0.6,
                    help="the deadline, as a fraction of the time the budget needs at the calibration run's steady "
                         "throughput (default %(default)s)")
    ap.add_argument("--mean", type=float, default=150, help="the simulator's mean length, factor 1 (default %(default)s)")
    ap.add_argument("--lengths", default="1,4,8", help="a, b, c's mean length factors (default %(default)s)")
    ap.add_argument("--expect-mean", type=float, default=None, help="produce --expect-mean (default: --mean)")
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--chunk-size", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=2,
                    help="sglang-sim --time-scale: low, so the simulator's batch, not the 2 cores, sets the pace "
                         "(default %(default)s)")
    ap.add_argument("--seed", type=int, default=1, help="the simulator's seed (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default="deadline", help="results name under bench/results (default %(default)s)")
    args = ap.parse_args()
    lengths = [float(x) for x in args.lengths.split(",")]
    rows: list[dict[str, Any]] = []
    with scratch("deadline") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        base = build_mix(work, 0)
        sim = sim_args(mean=args.mean, per_request_tps=100, saturation=64, time_scale=args.time_scale,
                       seed=args.seed, extra=["--context-length", "65536", *length_sim_args(tok, lengths)])
        with Stack(work / "stack", sim_args=sim, workers=args.workers,
                   worker_env={"BUDGETQ_CONCURRENCY": "16"}) as stack:
            stack.wait_for_workers()
            for rep in range(args.repeats):
                cal, cal_trace = run_once(stack, work, tok, base, f"cal{rep}", args, None)
                tps = cal["steady_tokens_per_s"]
                cal["needs_s"] = round(args.total / tps, 2)
                print(json.dumps(cal), flush=True)
                row, _ = run_once(stack, work, tok, base, f"dl{rep}", args, args.fraction * cal["needs_s"])
                row["predicted_at_deadline"] = round(tps * row["deadline_after_s"])
                # the control: what the run without a deadline had committed as long after its start
                row["calibration_at_same_time"] = used_at(cal_trace, cal["t0"] + row["deadline_after_s"])
                row["at_deadline_vs_predicted"] = round(row["tokens_at_deadline"] / row["predicted_at_deadline"], 4)
                row["calibration"] = {k: cal[k] for k in ("run", "seconds", "total_used", "steady_tokens_per_s", "needs_s",
                                                          "thrown_away", "final_pp")}
                print(json.dumps(row), flush=True)
                rows.append(row)
    save_results(args.out, {"args": vars(args), "runs": rows})


if __name__ == "__main__":
    main()
