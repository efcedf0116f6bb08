"""Benchmark: a mix run stopped by its deadline (issue 27 §3, docs/mix.md "A deadline").

    python -m bench.deadline --repeats 2          # ~4 minutes a repeat; results in bench/results/deadline.json
    python -m bench.deadline --total 25700000 --calibration-total 600000 --prompts 35000 --timeout 4000 \
        --out deadline_long                       # a 40-minute deadline: the bound's 2% term (48 s) rules

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
- ``requests`` (from the simulator's request log, ``--request-log``: each answered request's arrival and answer
  times, so the server's own view): the run's request latencies (p50, p99, max; p99 per dataset), the last
  admission (the last arrival) before the deadline, when the last answer left, the issue's bound
  ``max(2% of the time to the deadline, the run's p99 latency)`` and whether the end kept within it
  (``end_within_bound``, ``missed_by_s``); the occupancy (requests running on the server, time-averaged, over
  --workers x 16 in flight) from the first moment the batch was full to the first close and to the last
  admission, and over each 5 s of the last 30 s before the deadline; the requests that ended last (dataset,
  tokens, arrival and latency) beside each dataset's mean latency. The calibration run gives its own p99 and
  occupancy to its last admission as the control;
- ``final_pp`` / ``at_deadline_pp``: the worst deviation of a, b, c's shares of the committed tokens from their
  weights' shares, in percentage points, at the end and at the deadline.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bench.harness import save_results, scratch, sim_args
from bench.mix_proportion import PROMPTS, Mix, Trace, build_mix, deviation, length_sim_args, run_produce
from budget.keys import DatasetKeys
from budget.record import request_id
from demo.appending import read_jsonl
from demo.stack import Stack

#: Requests in flight per worker (BUDGETQ_CONCURRENCY): --workers x this is a full batch, occupancy 1.
PER_WORKER = 16
#: The issue's bound on the end: max(this share of the time to the deadline, one p99 request latency).
END_SHARE = 0.02


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

    def mean_live(self, lo: float, hi: float) -> float | None:
        """The polled running + queued, averaged over the samples in [lo, hi]: a cross-check of the request log's
        occupancy."""
        inside = [live for t, live, _, _ in self.samples if lo <= t <= hi]
        return round(sum(inside) / len(inside), 2) if inside else None

    def live_at(self, when: float) -> int:
        before = [live for t, live, _, _ in self.samples if t <= when]
        return before[-1] if before else 0


@dataclass(frozen=True)
class Request:
    """One answered request as the simulator logged it: its dataset (None: not this run's), arrival and answer
    (unix s), and completion tokens."""

    dataset: str | None
    start: float
    end: float
    tokens: int

    @property
    def latency(self) -> float:
        return self.end - self.start


def rid_names(m: Mix) -> dict[str, str]:
    """A rid's first 28 characters (budget.record.request_id: the hash of dataset and sample) -> the dataset."""
    return {request_id(n, str(x["id"]), 0)[:28]: n for n, path in m.files.items() for x in read_jsonl(path)}


def read_requests(log: Path, offset: int, names: dict[str, str]) -> list[Request]:
    """The request log's lines from byte ``offset`` on (one run's: the log is appended to across runs)."""
    out = []
    with open(log, "rb") as fh:
        fh.seek(offset)
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            x = json.loads(raw)
            end = float(x["response_sent_to_client_ts"])
            out.append(Request(names.get(x["rid"][:28]), end - float(x["e2e_latency"]), end,
                               int(x["completion_tokens"])))
    return [q for q in out if q.dataset is not None]


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (q in [0, 1]) of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def occupancy(reqs: Sequence[Request], lo: float, hi: float, capacity: int) -> float | None:
    """The requests running on the server over [lo, hi], time-averaged, over ``capacity``; None for an empty span."""
    if hi <= lo:
        return None
    busy = sum(max(0.0, min(q.end, hi) - max(q.start, lo)) for q in reqs)
    return round(busy / ((hi - lo) * capacity), 4)


def first_full(reqs: Sequence[Request], capacity: int) -> float | None:
    """The first moment ``capacity`` requests ran at once (None: never)."""
    events = sorted([(q.start, 1) for q in reqs] + [(q.end, -1) for q in reqs], key=lambda e: (e[0], e[1]))
    running = 0
    for t, step in events:
        running += step
        if running >= capacity:
            return t
    return None


def request_report(reqs: Sequence[Request], capacity: int, t0: float, deadline: float | None,
                   first_close: float | None) -> dict[str, Any]:
    """Latencies, the last admission and answer, the occupancy to the closes and, with a deadline, the issue's
    bound on the end and the requests that ended last."""
    if not reqs:
        return {}
    lat = [q.latency for q in reqs]
    p99 = percentile(lat, 0.99)
    last_start = max(q.start for q in reqs)
    last_end = max(q.end for q in reqs)
    full = first_full(reqs, capacity)
    by_ds: dict[str, list[Request]] = {}
    for q in reqs:
        by_ds.setdefault(str(q.dataset), []).append(q)
    out: dict[str, Any] = {
        "count": len(reqs), "latency_p50_s": round(percentile(lat, 0.5), 2), "latency_p99_s": round(p99, 2),
        "latency_max_s": round(max(lat), 2),
        "latency_p99_by_dataset_s": {n: round(percentile([q.latency for q in v], 0.99), 2)
                                     for n, v in sorted(by_ds.items())},
        "mean_latency_by_dataset_s": {n: round(statistics.fmean(q.latency for q in v), 2)
                                      for n, v in sorted(by_ds.items())},
        "mean_tokens_by_dataset": {n: round(statistics.fmean(q.tokens for q in v)) for n, v in sorted(by_ds.items())},
        "batch_full_after_s": None if full is None else round(full - t0, 2),
        "occupancy_start_to_last_admission": occupancy(reqs, t0, last_start, capacity),
        "occupancy_full_to_last_admission": None if full is None else occupancy(reqs, full, last_start, capacity),
        "occupancy_full_to_first_close": (None if full is None or first_close is None
                                          else occupancy(reqs, full, first_close, capacity)),
    }
    if deadline is None:
        return out
    bound = max(END_SHARE * (deadline - t0), p99)
    past = last_end - deadline
    out.update({
        "last_admission_before_deadline_s": round(deadline - last_start, 2),
        "last_end_after_deadline_s": round(past, 2),
        "bound_s": round(bound, 2), "end_within_bound": past <= bound,
        "missed_by_s": round(max(0.0, past - bound), 2),
        "occupancy_last_30s_by_5s": [occupancy(reqs, deadline - a, deadline - a + 5, capacity)
                                     for a in range(30, 0, -5)],
        "ended_last": [{"dataset": q.dataset, "tokens": q.tokens, "arrived_before_deadline_s": round(deadline - q.start, 2),
                        "latency_s": round(q.latency, 2)}
                       for q in sorted(reqs, key=lambda q: q.end)[-5:]],
    })
    return out


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
    """One produce of the mix named with ``prefix``: with ``deadline_in`` seconds, a --deadline that far ahead and
    the budget --total; without, the calibration, whose budget is --calibration-total."""
    m = base.named(prefix)
    if deadline_in is None and args.calibration_total:
        args = argparse.Namespace(**{**vars(args), "total": args.calibration_total})
    extra: list[str] = []
    deadline = None
    if deadline_in is not None:
        deadline = time.time() + deadline_in
        extra = ["--deadline", datetime.datetime.fromtimestamp(deadline, datetime.timezone.utc).isoformat()]
    tokens0, aborted0 = sim_counters(stack)
    log = work / "requests.jsonl"
    offset = log.stat().st_size if log.exists() else 0
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
    first_close = min(poll.closed_at.values()) if poll.closed_at else None
    reqs = read_requests(log, offset, rid_names(m))
    row["requests"] = request_report(reqs, args.workers * PER_WORKER, t0, deadline, first_close)
    if reqs:
        row["requests"]["polled_mean_live_start_to_last_admission"] = poll.mean_live(t0, max(q.start for q in reqs))
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
    ap.add_argument("--calibration-total", type=int, default=None,
                    help="the calibration's budget, when smaller than --total: R is a steady rate, so a long deadline "
                         "run needs no calibration as long (default: --total)")
    ap.add_argument("--prompts", type=int, default=PROMPTS,
                    help="prompts in each of a, b, c: enough that none runs dry by the deadline (default %(default)s)")
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
        base = build_mix(work, 0, args.prompts)
        sim = sim_args(mean=args.mean, per_request_tps=100, saturation=64, time_scale=args.time_scale,
                       seed=args.seed, extra=["--context-length", "65536", "--request-log", str(work / "requests.jsonl"),
                                             *length_sim_args(tok, lengths)])
        with Stack(work / "stack", sim_args=sim, workers=args.workers,
                   worker_env={"BUDGETQ_CONCURRENCY": str(PER_WORKER)}) as stack:
            stack.wait_for_workers()
            for rep in range(args.repeats):
                cal, cal_trace = run_once(stack, work, tok, base, f"cal{rep}", args, None)
                tps = cal["steady_tokens_per_s"]
                cal["needs_s"] = round(args.total / tps, 2)  # --total's time at the calibration's rate
                print(json.dumps(cal), flush=True)
                row, _ = run_once(stack, work, tok, base, f"dl{rep}", args, args.fraction * cal["needs_s"])
                row["predicted_at_deadline"] = round(tps * row["deadline_after_s"])
                # the control: what the run without a deadline had committed as long after its start
                # (none when a smaller --calibration-total ended before)
                row["calibration_at_same_time"] = (used_at(cal_trace, cal["t0"] + row["deadline_after_s"])
                                                   if cal["seconds"] >= row["deadline_after_s"] else None)
                row["at_deadline_vs_predicted"] = round(row["tokens_at_deadline"] / row["predicted_at_deadline"], 4)
                row["calibration"] = {k: cal[k] for k in ("run", "seconds", "total_used", "steady_tokens_per_s", "needs_s",
                                                          "thrown_away", "final_pp", "requests")}
                print(json.dumps(row), flush=True)
                rows.append(row)
    save_results(args.out, {"args": vars(args), "runs": rows})


if __name__ == "__main__":
    main()
