"""Benchmark (6): what one RQ job costs: rq's forking Worker vs worker.Worker, and the chunk size.

    python -m bench.job_cost              # ~2 minutes; results in bench/results/job_cost.json

Against a zero-latency simulator (32-token answers), on one private Redis:
1. job latency: ``--jobs`` chunk jobs of 64 samples, one at a time (each enqueued once the previous one is
   done), run by one idle worker: first ``rq worker -w worker.Worker`` (no fork, one Runtime for its life),
   then rq's default ``Worker`` (``-S rq.serializers.JSONSerializer``), which forks a work horse per job. Timed
   on Redis' clock with MONITOR: enqueue -> ``start_chunk`` (the job began), -> the first ``admit`` that grants
   a start (the first request is sent right after), -> the chunk's last commit. The forking worker's horse
   exits when the job returns (once its samples have *started*): the samples still in flight then die with it,
   counted as "lost in flight".
2. chunk size: ``produce --detach`` then one worker.Worker at the default 64 in flight; committed samples/s at
   chunk sizes 1, 8, 64 and 256 (RQ's per-job cost is paid once per chunk).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.harness import (
    CpuMeter,
    RedisMonitor,
    admits_start,
    cpu_seconds,
    fmt_cpu,
    save_results,
    scratch,
    sim_stats_url,
)
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd
from demo.synthetic import write_prompts

SIM = ["--zero-latency", "--length-dist", "fixed", "--mean-tokens", "32", "--seed", "1"]


def cpu_with_children(pid: int) -> float:
    """CPU seconds of a process plus its waited-for children (a forking worker's work horses)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return cpu_seconds(pid)


def latency_runs(stack: Stack, kind: str, jobs: int, size: int) -> dict[str, Any]:
    from budget.ledger import Ledger
    from producer.session.attach import JobSettings
    from producer.session.loop import Item, enqueue_chunks, make_queue
    r = stack.client()
    name = f"lat_{kind}"
    Ledger(r).set_budget(name, None)
    worker = stack.start_worker(f"{kind}", worker_class="worker.Worker" if kind == "nofork" else None)
    stack.wait_for_workers()
    time.sleep(1.0)
    infl = DatasetKeys(name).inflight
    mon = RedisMonitor(stack.redis_url, grep=DatasetKeys(name).meta,
                       keep=lambda c: c.startswith("HINCRBY " + infl) or c.startswith("HSET " + infl)
                       or c.startswith(f"HINCRBY {DatasetKeys(name).meta} committed")).start()
    queue = make_queue(r)
    rows = []
    cpu0 = cpu_with_children(worker.pid)
    meter = CpuMeter({"sim": stack.sims[0].pid, "redis": stack.pids()["redis"]})
    t_all = time.time()
    for j in range(jobs):
        before = int(r.hget(DatasetKeys(name).meta, "committed") or 0)
        items = [Item(f"{j}-{i}", [1, 2, 3, 4, 5], False) for i in range(size)]
        secs, usecs = r.time()
        t_enq = secs + usecs / 1e6
        (cid,) = enqueue_chunks(r, queue, name, [items], sampling_params={"max_new_tokens": 64}, think=None,
                                settings=JobSettings())
        sim0 = sim_stats_url(stack.sim_urls[0])["submitted"]
        first_arrival = None
        t_poll = time.monotonic() + 2
        while time.monotonic() < t_poll:  # the first request reaching the server (polled ~every ms)
            if sim_stats_url(stack.sim_urls[0])["submitted"] > sim0:
                first_arrival = time.time()
                break
        deadline = time.monotonic() + 15
        while True:  # done: the job ended and nothing more arrives
            st = r.hget("rq:job:" + cid, "status")
            if st in (b"finished", b"failed") and r.zscore(DatasetKeys(name).chunks, cid) is None:
                break
            if st in (b"finished", b"failed") and time.monotonic() > deadline - 10:
                break  # a forked horse died with requests in flight: the chunk stays live, nothing more comes
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        time.sleep(0.05)
        committed = int(r.hget(DatasetKeys(name).meta, "committed") or 0) - before
        arrived = sim_stats_url(stack.sim_urls[0])["submitted"] - sim0
        rows.append({"chunk": cid, "t_enq": t_enq, "status": st.decode() if isinstance(st, bytes) else str(st),
                     "committed": committed, "lost_in_flight": size - committed,
                     "requests_sent": arrived,
                     "ms_to_first_arrival": (first_arrival - t_enq) * 1000 if first_arrival else None,
                     })
    wall = time.time() - t_all
    cpu = cpu_with_children(worker.pid) - cpu0
    shares = {"worker (horses included)": round(cpu / wall, 3), **meter.stop()}
    events = mon.stop()
    for i, row in enumerate(rows):  # Redis-clock times of each job's milestones, from MONITOR
        t_enq, cid = row["t_enq"], row["chunk"]
        t_next = rows[i + 1]["t_enq"] if i + 1 < len(rows) else float("inf")
        ev = [(t, c) for t, _k, c in events if t_enq <= t < t_next]
        start = next((t for t, c in ev if c.startswith("HSET") and cid in c), None)
        first = next((t for t, c in ev if cid in c and admits_start(c, infl)), None)
        last_commit = max((t for t, c in ev if "committed" in c), default=None)
        row["ms_to_start_chunk"] = (start - t_enq) * 1000 if start else None
        row["ms_to_first_admission"] = (first - t_enq) * 1000 if first else None
        row["ms_to_last_commit"] = (last_commit - t_enq) * 1000 if last_commit else None
    worker.terminate()
    worker.wait(20)
    stack.workers.remove(worker)

    def med(key: str) -> float | None:
        xs = [x[key] for x in rows if x[key] is not None]
        return statistics.median(xs) if xs else None
    return {"kind": kind, "jobs": jobs, "size": size, "median_ms_to_start_chunk": med("ms_to_start_chunk"),
            "median_ms_to_first_admission": med("ms_to_first_admission"),
            "median_ms_to_first_request": med("ms_to_first_arrival"),
            "requests_sent": sum(x["requests_sent"] for x in rows),
            "median_ms_to_last_commit": med("ms_to_last_commit"),
            "samples_committed": sum(x["committed"] for x in rows), "samples_lost_in_flight":
            sum(x["lost_in_flight"] for x in rows), "worker_cpu_s_per_job": cpu / jobs,
            "worker_cpu_share": cpu / wall, "cpu": shares, "runs": rows}


def chunk_sweep(stack: Stack, work: Path, tok: Path, data: Path, sizes: list[int],
                window: float) -> list[dict[str, Any]]:
    r = stack.client()
    worker = stack.start_worker("sweep")
    out = []
    for size in sizes:
        name = f"cs{size}"
        r.delete("rq:queue:budgetq")
        t0 = time.time()
        subprocess.run([*produce_cmd(), f"{name}={data}", "--tokenizer", str(tok), "--max-tokens", "64",
                        "--max-context", "65536", "--chunk-size", str(size), "--out", str(work / "out"),
                        "--redis-url", stack.redis_url, "--detach", "--quiet"], check=True, capture_output=True)
        enqueue_s = time.time() - t0
        committed = lambda name=name: int(r.hget(DatasetKeys(name).meta, "committed") or 0)  # noqa: E731
        deadline = time.monotonic() + 30
        while committed() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(1.0)
        c0, t_a, cpu0 = committed(), time.time(), cpu_seconds(worker.pid)
        time.sleep(window)
        c1, t_b, cpu1 = committed(), time.time(), cpu_seconds(worker.pid)
        row = {"chunk_size": size, "samples_per_s": (c1 - c0) / (t_b - t_a),
               "worker_cpu_share": (cpu1 - cpu0) / (t_b - t_a),
               "produce_enqueue_s": enqueue_s}
        print(json.dumps(row), flush=True)
        out.append(row)
        r.delete("rq:queue:budgetq")
        time.sleep(0.5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=20)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--sizes", default="1,8,64,256")
    ap.add_argument("--sweep-prompts", type=int, default=40000)
    ap.add_argument("--window", type=float, default=6.0)
    args = ap.parse_args()
    with scratch("jobcost") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = write_prompts(work / "prompts.jsonl", args.sweep_prompts)
        with Stack(work / "stack", sim_args=SIM, workers=0) as stack:
            nofork = latency_runs(stack, "nofork", args.jobs, args.size)
            print("nofork", json.dumps({k: v for k, v in nofork.items() if k != "runs"}), flush=True)
            fork = latency_runs(stack, "fork", args.jobs, args.size)
            print("fork", json.dumps({k: v for k, v in fork.items() if k != "runs"}), flush=True)
            sweep = chunk_sweep(stack, work, tok, data, [int(x) for x in args.sizes.split(",")], args.window)
            stack.kill()
    res = {"args": vars(args), "nofork": nofork, "fork": fork, "chunk_sweep": sweep}
    save_results("job_cost", res)
    print("| worker | enqueue -> job starts | enqueue -> first admission | enqueue -> first request at the server | "
          "enqueue -> last commit (64 samples) | worker CPU per job (horse included) | requests sent / committed | "
          "CPU share (cores) |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for x in (nofork, fork):
        def ms(v: float | None) -> str:
            return f"{v:.1f} ms" if v is not None else "-"
        print(f"| {'worker.Worker (no fork)' if x['kind'] == 'nofork' else 'rq Worker (fork per job)'} | "
              f"{ms(x['median_ms_to_start_chunk'])} | {ms(x['median_ms_to_first_admission'])} | "
              f"{ms(x['median_ms_to_first_request'])} | {ms(x['median_ms_to_last_commit'])} | "
              f"{x['worker_cpu_s_per_job'] * 1000:.0f} ms | {x['requests_sent']} / {x['samples_committed']} "
              f"of {x['jobs'] * x['size']} | {fmt_cpu(x['cpu'])} |")
    print("\n| chunk size | samples/s (1 worker, zero latency) | worker CPU share |\n| --- | --- | --- |")
    for row in sweep:
        print(f"| {row['chunk_size']} | {row['samples_per_s']:,.0f} | {row['worker_cpu_share']:.2f} |")


if __name__ == "__main__":
    main()
