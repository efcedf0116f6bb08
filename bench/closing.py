"""Benchmark (5): how fast a dataset closes: the last request start after the closing commit, and discard.

    python -m bench.closing               # ~3 minutes; results in bench/results/closing.json

1. Close to last start. One stack (redis-server, sglang-sim at the reference workload (docs/performance.md) time-scaled, 4 workers x 64
   in flight), one dataset per run (``close0``, ``close1``, ...) with a budget of ``--budget`` tokens and an
   attached ``produce``; each run ends before the next starts. Times, on Redis' clock (the closing commit
   writes ``closed_at`` from Redis ``TIME``):
   - last admission: Redis MONITOR sees the commands the budget scripts run; ``admit`` grants a start with
     ``HINCRBY bq:ds:{n}:inflight CHUNK n`` (n > 0: the samples it started), so the last such command of
     the dataset is its last start;
   - last arrival at the server: the simulator's ``submitted`` counter, polled every few ms once the dataset
     closed (an upper bound: a start between two polls counts at the later poll).
   Reported: median and max over the runs of (time - closed_at), per budget mode (drain, predict).
2. Discard. A private redis-server; ``--discard-chunks`` chunks of a closed dataset enqueued with
   producer.session.loop.enqueue_chunks, interleaved with another dataset's chunks in the shared queue; median of
   the runs of: the ``discard`` script's time in Redis (SLOWLOG at 0 µs), after which no worker can start any
   of them (the target); the wall time of the whole ``Ledger.discard``, which then marks the jobs canceled in
   ``mark_discarded`` calls of 1,000; the longest single script, i.e. the longest Redis served nothing else.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import CpuMeter, RedisMonitor, admits_start, fmt_cpu, save_results, scratch, sim_args, sim_stats_url
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd
from demo.synthetic import write_prompts


class ArrivalWatch(threading.Thread):
    """Once the dataset is closed: poll the simulator's ``submitted`` every few ms, keep when it last grew."""

    def __init__(self, stack: Stack, name: str) -> None:
        super().__init__(daemon=True)
        self.stack, self.name = stack, name
        self.r = stack.client()
        self.detected: float | None = None
        self.last_growth: float | None = None
        self.arrivals_after_detection = 0
        self.stop_flag = threading.Event()

    def run(self) -> None:
        meta = DatasetKeys(self.name).meta
        while not self.stop_flag.is_set() and self.r.hget(meta, "status") != b"closed":
            time.sleep(0.002)
        if self.stop_flag.is_set():
            return
        self.detected = time.time()
        url = self.stack.sim_urls[0]
        last = sim_stats_url(url)["submitted"]
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            now_n = sim_stats_url(url)["submitted"]
            if now_n > last:
                self.arrivals_after_detection += now_n - last
                self.last_growth = time.time()
                last = now_n
            time.sleep(0.004)


def close_runs(args: argparse.Namespace, work: Path, tok: Path, data: Path) -> list[dict[str, Any]]:
    sim = sim_args(time_scale=args.time_scale, seed=args.seed)
    rows = []
    with Stack(work / "stack", sim_args=sim, workers=args.workers) as stack:
        r = stack.client()
        run = 0
        for mode in args.modes.split(","):
            for _rep in range(args.repeats):
                name = f"close{run}"
                run += 1
                key = DatasetKeys(name).inflight
                mon = RedisMonitor(stack.redis_url, grep=key, workdir=work,
                                   keep=lambda c, key=key: admits_start(c, key)).start()
                watch = ArrivalWatch(stack, name)
                watch.start()
                cpu = CpuMeter(stack.pids())
                res = subprocess.run([*produce_cmd(), f"{name}={data}", "--tokenizer", str(tok), "--max-tokens",
                                      str(args.max_tokens), "--budget", str(args.budget), "--budget-mode", mode,
                                      "--max-context", "65536", "--expect-mean", "3800", "--out", str(work / "out"),
                                      "--redis-url", stack.redis_url, "--quiet"],
                                     capture_output=True, text=True, timeout=args.timeout)
                shares = cpu.stop()
                watch.stop_flag.set()
                watch.join(3)
                events = mon.stop()
                if res.returncode != 0:
                    raise RuntimeError(f"produce failed: {res.stderr[-2000:]}")
                closed_at = float(r.hget(DatasetKeys(name).meta, "closed_at") or 0)
                starts = [t for t, kind, _ in events if kind == "lua"]
                last_start = max(starts) if starts else None
                arrival = watch.last_growth if watch.last_growth is not None else watch.detected
                row = {"mode": mode, "run": name, "closed_at": closed_at, "starts": len(starts),
                       "ms_close_to_last_admission": (last_start - closed_at) * 1000 if last_start else None,
                       "ms_close_to_last_arrival_upper_bound": (arrival - closed_at) * 1000 if arrival else None,
                       "ms_close_to_detection": (watch.detected - closed_at) * 1000 if watch.detected else None,
                       "arrivals_after_detection": watch.arrivals_after_detection,
                       "used": int(r.get(DatasetKeys(name).used) or 0), "budget": args.budget, "cpu": shares}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def discard_runs(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from budget.ledger import Ledger
    from producer.session.attach import JobSettings
    from producer.session.loop import Item, enqueue_chunks, make_queue
    rows = []
    with Stack(work / "discard", workers=0, sim_count=0) as stack:
        r = stack.client()
        ledger = Ledger(r)
        queue = make_queue(r)
        params = {"max_new_tokens": 16384}
        from budget import keys, scripts
        for rep in range(args.repeats):
            r.flushall()
            name, other = f"disc{rep}", f"keep{rep}"
            ledger.set_budget(name, None)
            ledger.set_budget(other, None)
            n, per_batch = args.discard_chunks, 500
            n_other = args.other_chunks
            made = kept = 0
            while made < n or kept < n_other:  # interleave the two datasets' jobs in the queue
                if made < n:
                    b = min(per_batch, n - made)
                    enqueue_chunks(r, queue, name, [[Item(f"{made + i}-{j}", list(range(200)), False)
                                                     for j in range(args.chunk_size)] for i in range(b)],
                                   sampling_params=params, think=None, settings=JobSettings())
                    made += b
                if kept < n_other:
                    b = min(per_batch // 5, n_other - kept)
                    enqueue_chunks(r, queue, other, [[Item(f"k{kept + i}", [1, 2, 3], False)] for i in range(b)],
                                   sampling_params=params, think=None, settings=JobSettings())
                    kept += b
            qlen = int(r.llen("rq:queue:budgetq"))
            ledger.set_budget(name, 0)  # closes it
            for script in (scripts.DISCARD, scripts.MARK_DISCARDED):  # loaded before the timer: the first
                r.script_load(script)                                  # call must not pay for it
            r.config_set("slowlog-log-slower-than", 0)  # every command, with Redis' own time for it
            r.config_set("slowlog-max-len", 100_000)
            r.slowlog_reset()
            cpu = CpuMeter({"redis": stack.pids()["redis"]})
            t0 = time.perf_counter()
            dropped = ledger.discard(name, "budget reached")
            ms = (time.perf_counter() - t0) * 1000
            shares = cpu.stop()
            scripts_us = [e["duration"] for e in reversed(r.slowlog_get(100_000))
                          if e["command"].split(b" ", 1)[0].upper() == b"EVALSHA"]
            r.config_set("slowlog-log-slower-than", 10_000)
            raw_desc = r.hget(keys.rq_job_key(keys.chunk_id(name, 1)), "description")
            descs = raw_desc if isinstance(raw_desc, bytes) else b""
            left = int(r.llen("rq:queue:budgetq"))
            canceled = int(r.zcard("rq:canceled:budgetq"))
            ok = dropped == n and left == n_other and canceled == n and descs.endswith(b"[discarded: budget reached]")
            row = {"cpu": shares, "queue_before": qlen, "discarded": dropped, "queue_after": left,
                   "canceled_registry": canceled, "scripts": len(scripts_us),
                   "queue_emptied_ms": scripts_us[0] / 1000, "longest_script_ms": max(scripts_us) / 1000,
                   "ms": ms, "ok": ok}
            print(json.dumps(row), flush=True)
            if not ok:
                raise RuntimeError(f"discard left the queue wrong: {row}")
            rows.append(row)
    return rows


def median_cpu(rows: list[dict[str, Any]]) -> dict[str, float]:
    names = {k for r in rows for k in r["cpu"]}
    return {k: round(statistics.median(r["cpu"].get(k, 0.0) for r in rows), 3) for k in sorted(names)}


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    xs = [r[key] for r in rows if r[key] is not None]
    return {"median": statistics.median(xs), "max": max(xs), "min": min(xs), "n": len(xs)} if xs else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=2_000_000)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=50.0)
    ap.add_argument("--modes", default="drain,predict")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--discard-chunks", type=int, default=10_000)
    ap.add_argument("--other-chunks", type=int, default=2_000)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--discard-only", action="store_true")
    args = ap.parse_args()
    with scratch("closing") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = write_prompts(work / "prompts.jsonl", int(args.budget / 3800 * 2) + 600)
        disc = discard_runs(args, work)
        close = close_runs(args, work, tok, data) if not args.discard_only else []
    res: dict[str, Any] = {"args": vars(args), "close_runs": close, "discard_runs": disc,
                           "discard_ms": summary(disc, "ms"), "queue_emptied_ms": summary(disc, "queue_emptied_ms"),
                           "longest_script_ms": summary(disc, "longest_script_ms")}
    for mode in args.modes.split(",") if close else []:
        rows = [r for r in close if r["mode"] == mode]
        res[f"{mode}_last_admission_ms"] = summary(rows, "ms_close_to_last_admission")
        res[f"{mode}_last_arrival_ms"] = summary(rows, "ms_close_to_last_arrival_upper_bound")
    save_results("closing", res)
    print("| figure | target | median | max | runs | CPU share (cores, median of the runs) |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for mode in args.modes.split(",") if close else []:
        for key, label in (("last_admission", "closing commit -> last admitted start (Redis clock)"),
                           ("last_arrival", "closing commit -> last request at the server (upper bound)")):
            s = res[f"{mode}_{key}_ms"]
            if s:
                print(f"| {mode}: {label} | <= 50 ms | {s['median']:+.1f} ms | {s['max']:+.1f} ms | {s['n']} | "
                      f"{fmt_cpu(median_cpu([r for r in close if r['mode'] == mode]))} |")
    queue = args.discard_chunks + args.other_chunks
    for key, label, target in (
            ("queue_emptied_ms", "discard script: queue emptied, no worker can start them", "<= 100 ms"),
            ("discard_ms", "Ledger.discard, all jobs marked canceled too (wall)", "report"),
            ("longest_script_ms", "longest single script (Redis serves nothing else meanwhile)", "report")):
        d = res[key]
        print(f"| {args.discard_chunks:,} queued chunks (queue of {queue:,}): {label}"
              f" | {target} | {d['median']:.1f} ms | {d['max']:.1f} ms | {d['n']} | {fmt_cpu(median_cpu(disc))} |")


if __name__ == "__main__":
    main()
