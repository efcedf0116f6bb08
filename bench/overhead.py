"""Benchmark (3): budgetq's per-sample overhead: one worker process vs a bare aiohttp client, zero latency.

    python -m bench.overhead              # ~3 minutes; results in bench/results/overhead.json

The simulator answers at once (``--zero-latency``) with short responses (32 tokens), so all that is measured
is client-side work. In one command, against the same simulator process:
1. ``produce --detach`` enqueues the prompts (chunks of 256, the default); ONE ``rq worker -w worker.Worker``
   at the default 64 in flight starts on them;
2. alternating windows (``--rounds``): baseline (bench/client.py: one aiohttp session, 64 in flight, the same
   bodies) while the worker is paused with SIGSTOP, then budgetq (samples/s = Redis ``committed`` over the
   window) while it runs, ..., ending with a baseline. The figure is median / median: the machine is shared,
   and alternating short windows makes drift hit both sides alike;
3. where the worker's time goes: py-spy (``--profile``, when installed) samples the worker while it runs;
   the samples are sorted into what the request thread and RQ's main thread were doing;
4. Redis round trips per sample, in isolation: the budget scripts (admit + commit) called one by one, as the
   worker calls them, vs the same calls pipelined 64 at a time.
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis

from bench.harness import CpuMeter, fmt_cpu, save_results, scratch, thread_cpu
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd
from demo.synthetic import write_prompts

SIM = ["--zero-latency", "--length-dist", "fixed", "--mean-tokens", "32", "--seed", "1"]


def baseline(stack: Stack, work: Path, bodies: Path, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    out = work / f"baseline-{tag}.json"
    client = subprocess.Popen([sys.executable, "-m", "bench.client", "--url", stack.sim_urls[0], "--bodies",
                               str(bodies), "--in-flight", str(args.in_flight), "--duration",
                               str(args.warm + args.duration), "--repeat", "--out", str(out)])
    time.sleep(args.warm)
    cpu = CpuMeter({"client": client.pid, "sim": stack.sims[0].pid})
    t_a = time.time()
    time.sleep(args.duration - 0.2)
    t_b = time.time()
    shares = cpu.stop()
    client.wait(60)
    res = json.loads(out.read_text())
    n = sum(1 for t, _ in res["done"] if t_a <= t < t_b)
    return {"samples_per_s": n / (t_b - t_a), "errors": res["errors"], "cpu": shares}


def budgetq_window(stack: Stack, worker: subprocess.Popen[bytes], committed: Any,
                   args: argparse.Namespace) -> dict[str, Any]:
    time.sleep(args.warm)
    pids = {"worker": worker.pid, "sim": stack.sims[0].pid, "redis": stack.pids()["redis"]}
    cpu = CpuMeter(pids)
    th_a = thread_cpu(worker.pid)
    c_a, t_a = committed(), time.time()
    time.sleep(args.duration)
    c_b, t_b = committed(), time.time()
    th_b = thread_cpu(worker.pid)
    n = max(1, c_b - c_a)
    return {"samples_per_s": (c_b - c_a) / (t_b - t_a), "cpu": cpu.stop(),
            "worker_threads_us_per_sample": _by_thread(worker.pid, th_a, th_b, n)}


def _by_thread(pid: int, before: dict[int, float], after: dict[int, float], n: int) -> dict[str, float]:
    """The worker's CPU per committed sample, by thread. Threads carry no OS names, so they are told apart by
    what they do: the process's own thread is RQ's main thread; of the others, the busiest is the request
    loop (worker/rqworker.py) and the next the ledger thread (worker/batch.py); the rest idle."""
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main = used.pop(pid, 0.0)
    others = sorted(used.values(), reverse=True) + [0.0, 0.0]
    return {"main (RQ)": round(main / n * 1e6, 1), "request loop": round(others[0] / n * 1e6, 1),
            "ledger thread": round(others[1] / n * 1e6, 1), "rest": round(sum(others[2:]) / n * 1e6, 1)}


def alternate(stack: Stack, work: Path, bodies: Path, args: argparse.Namespace
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], subprocess.Popen[bytes]]:
    """baseline, budgetq, baseline, ... : the worker is paused (SIGSTOP) while the baseline runs, so the two
    never compete, and drift of the shared machine hits both alike."""
    r = stack.client()
    worker = stack.start_worker("w0")
    committed = lambda: int(r.hget(DatasetKeys("prompts").meta, "committed") or 0)  # noqa: E731
    deadline = time.monotonic() + 60
    while committed() == 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the worker committed nothing")
        time.sleep(0.02)
    bases, bqs = [], []
    for i in range(args.rounds):
        worker.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        bases.append(baseline(stack, work, bodies, args, str(i)))
        print("baseline", json.dumps(bases[-1]), flush=True)
        worker.send_signal(signal.SIGCONT)
        bqs.append(budgetq_window(stack, worker, committed, args))
        print("budgetq", json.dumps(bqs[-1]), flush=True)
    worker.send_signal(signal.SIGSTOP)
    time.sleep(0.3)
    bases.append(baseline(stack, work, bodies, args, "last"))
    print("baseline", json.dumps(bases[-1]), flush=True)
    worker.send_signal(signal.SIGCONT)
    return bases, bqs, worker


def profile(pid: int, seconds: float, out: Path) -> dict[str, Any] | None:
    """py-spy samples of the worker: for each thread, the share of samples in each activity."""
    if shutil.which("py-spy") is None:
        return None
    raw = out.with_suffix(".txt")
    subprocess.run(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "250",
                    "--format", "raw", "--threads", "--idle", "--nonblocking", "-o", str(raw)],
                   check=True, capture_output=True)
    return summarize(raw.read_text())


# What a stack of the request thread is doing: the first category with a matching frame; order matters.
CATEGORIES = [
    ("idle: waiting for network events (epoll)", ("select (selectors.py", "poll (selectors.py")),
    ("Redis admit/commit/fail, batched: one pipeline per loop iteration (worker/batch.py)",
     ("run_many (budget/ledger.py", "admit_call (budget/ledger.py", "commit_call (budget/ledger.py",
      "fail_call (budget/ledger.py")),
    ("Redis admit (blocking call on the event loop)", ("admit (budget/ledger.py",)),
    ("Redis commit (blocking call on the event loop)", ("commit (budget/ledger.py",)),
    ("Redis other ledger calls (start/finish/refresh/length sample/fail)",
     ("start_chunk (budget/ledger.py", "finish_chunk (budget/ledger.py", "refresh_chunk (budget/ledger.py",
      "length_sample (budget/ledger.py", "fail (budget/ledger.py")),
    ("HTTP (aiohttp: request write, response read)", ("(aiohttp/",)),
    ("response JSON parse + validation", ("loads (json/", "parse_generation (worker/sglang.py")),
    ("result record + reasoning split", ("result_record (worker/sglang.py",)),
    ("asyncio scheduling (tasks, semaphores, futures)", ("_run_once (asyncio/base_events.py",)),
]
SOCKET_LEAVES = ("send_packed_command", "read_from_socket", "recv", "sendall", "can_read")
MAIN_CATEGORIES = [
    ("RQ: waiting for the job's samples to start (Runtime.run_chunk)", ("run_chunk (worker/rqworker.py",)),
    ("RQ: dequeue (BLMOVE/BLPOP and job fetch)", ("dequeue_job_and_maintain_ttl (rq/",)),
    ("RQ: job bookkeeping (prepare, status, result, registries)", ("perform_job (rq/", "handle_job_success (rq/",
                                                                    "prepare_job_execution (rq/",
                                                                    "execute_job (rq/")),
    ("RQ: other (heartbeats, maintenance)", ("work (rq/", "work (worker/rqworker.py")),
]


def _thread_of(frames: list[str]) -> str:
    return frames[0]


def summarize(text: str) -> dict[str, Any]:
    by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = _thread_of(frames)
        if "budgetq-requests" in thread or any("_serve (worker/rqworker.py" in f for f in frames):
            name = "requests"
        elif "MainThread" in thread:
            name = "main"
        else:
            name = thread.split(": ", 1)[-1]
        cats = CATEGORIES if name == "requests" else MAIN_CATEGORIES
        cat = "other"
        for label, needles in cats:
            if any(any(n in f for n in needles) for f in reversed(frames)):
                cat = label
                break
        if cat.startswith("Redis"):
            waiting = any(w in frames[-1] for w in SOCKET_LEAVES)
            cat += (": in a socket call (send, wait for the reply)" if waiting else
                    ": Python (JSON of the record, redis-py pack/parse)")
        by_thread[name][cat] += int(count)
        totals[name] += int(count)
    return {t: {"samples": totals[t], "shares": {c: round(n / totals[t], 4) for c, n in cnt.most_common()}}
            for t, cnt in by_thread.items() if totals[t] > 0}


def redis_round_trips(redis_url: str, n: int = 2048, batch: int = 64) -> dict[str, Any]:
    """admit + commit for n samples: one call at a time (the worker before worker/batch.py) vs ``batch`` at a
    time in one pipeline (budget/ledger.py ``run_many``, what the worker's batcher sends)."""
    from budget.ledger import Ledger, run_many
    from producer.session.attach import JobSettings
    from producer.session.loop import Item, enqueue_chunks, make_queue
    out: dict[str, Any] = {"samples": n, "batch": batch}
    client = redis.Redis.from_url(redis_url)
    for mode in ("one_by_one", "pipelined"):
        name = f"micro_{mode}"
        ledger = Ledger(client)
        ledger.set_budget(name, None)
        chunks = [[Item(f"s{i + j}", [1, 2, 3], False) for j in range(batch)] for i in range(0, n, batch)]
        cids = enqueue_chunks(client, make_queue(client), name, chunks, sampling_params={"max_new_tokens": 64},
                              think=None, settings=JobSettings())
        client.delete("rq:queue:budgetq")  # keep the worker away from these
        for cid in cids:
            ledger.start_chunk(name, cid)
        record = {"id": "", "dataset": name, "response": "word " * 31, "reasoning": None, "content": "word " * 31,
                  "reasoning_truncated": False, "prompt_tokens": 20, "completion_tokens": 32,
                  "finish_reason": "stop", "sampling_params": {"max_new_tokens": 64}}
        t0, c0 = time.perf_counter(), time.process_time()
        if mode == "one_by_one":
            for cid, items in zip(cids, chunks, strict=True):
                for it in items:
                    ledger.admit(name, it.id, cid)
                for it in items:
                    ledger.commit(name, it.id, 32, {**record, "id": it.id}, chunk=cid)
        else:  # as the worker sends them: a chunk's admissions in one call, then its commits merged into one
            for cid, items in zip(cids, chunks, strict=True):
                run_many(client, [ledger.admit_call(name, [it.id for it in items], cid)])
                run_many(client, [ledger.commit_call(name, it.id, 32, {**record, "id": it.id}, chunk=cid,
                                                     finish_reason="stop") for it in items])
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        assert int(client.hget(keys_meta(name), "committed") or 0) == n, "micro benchmark lost commits"
        out[mode] = {"us_per_sample": dt / n * 1e6, "cpu_us_per_sample": cpu / n * 1e6, "samples_per_s": n / dt}
    return out


def keys_meta(name: str) -> str:
    from budget import keys
    return keys.DatasetKeys(name).meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=150000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=256,
                    help="samples per chunk job (produce's default --chunk-size)")
    ap.add_argument("--warm", type=float, default=1.5)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--profile-seconds", type=float, default=10.0)
    ap.add_argument("--no-profile", action="store_true")
    args = ap.parse_args()
    with scratch("overhead") as work:
        from bench.efficiency import render_bodies
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = write_prompts(work / "prompts.jsonl", args.prompts)
        bodies = work / "bodies.json"
        bodies_data = write_prompts(work / "bodies.jsonl", 5000)  # the same prompts' first 5,000, cycled
        bodies.write_text(json.dumps({"input_ids": render_bodies(tok, bodies_data),
                                      "sampling_params": {"max_new_tokens": 64}}))
        with Stack(work / "stack", sim_args=SIM, workers=0) as stack:
            subprocess.run([*produce_cmd(), f"prompts={data}", "--tokenizer", str(tok), "--max-tokens", "64",
                            "--max-context", "65536", "--out", str(work / "out"), "--redis-url", stack.redis_url,
                            "--detach", "--quiet", "--chunk-size", str(args.chunk_size)], check=True, capture_output=True)
            bases, bqs, worker = alternate(stack, work, bodies, args)
            prof = None
            if not args.no_profile:
                time.sleep(1.0)
                prof = profile(worker.pid, args.profile_seconds, work / "profile")
                if prof is not None:
                    RESULTS_PROFILE.parent.mkdir(exist_ok=True)
                    shutil.copy(work / "profile.txt", RESULTS_PROFILE)
                print("profile", json.dumps(prof), flush=True)
            left = int(stack.client().llen("rq:queue:budgetq"))
            worker.kill()
            worker.wait()
            rt = redis_round_trips(stack.redis_url)
            print("redis", json.dumps(rt), flush=True)
            stack.kill()
    base = statistics.median(b["samples_per_s"] for b in bases)
    bq = statistics.median(q["samples_per_s"] for q in bqs)
    res = {"args": vars(args), "baselines": bases, "budgetq_windows": bqs, "baseline_median": base,
           "budgetq_median": bq, "ratio": bq / base, "chunks_left_when_profiled": left, "profile": prof,
           "redis_round_trips": rt}
    save_results("overhead", res)
    print("| figure | baseline (bare aiohttp, 64 in flight) | budgetq (1 worker, 64 in flight) | ratio |")
    print("| --- | --- | --- | --- |")
    b_all = ", ".join(f"{b['samples_per_s']:,.0f}" for b in bases)
    q_all = ", ".join(f"{q['samples_per_s']:,.0f}" for q in bqs)
    print(f"| samples/s, zero-latency server, 32-token answers (median of {len(bases)} / {len(bqs)} alternating "
          f"windows) | {base:,.0f} ({b_all}) | {bq:,.0f} ({q_all}) | {res['ratio']:.3f} |")
    print(f"| CPU share (cores), first windows | {fmt_cpu(bases[0]['cpu'])} | {fmt_cpu(bqs[0]['cpu'])} | |")
    per_thread = {k: statistics.median(q["worker_threads_us_per_sample"][k] for q in bqs)
                  for k in bqs[0]["worker_threads_us_per_sample"]}
    base_us = statistics.median(b["cpu"]["client"] / b["samples_per_s"] * 1e6 for b in bases)
    print(f"| CPU µs per sample (median of windows) | client {base_us:.0f} | worker "
          f"{sum(per_thread.values()):.0f}: " + ", ".join(f"{k} {v:.0f}" for k, v in per_thread.items()) + " | |")
    print(f"| Redis admit+commit per sample, wall (client CPU) | | one by one {rt['one_by_one']['us_per_sample']:.0f} us "
          f"({rt['one_by_one']['cpu_us_per_sample']:.0f}), pipelined x64 "
          f"{rt['pipelined']['us_per_sample']:.0f} us ({rt['pipelined']['cpu_us_per_sample']:.0f}) | |")
    if prof and "requests" in prof:
        print("\nrequest thread (py-spy, wall time):")
        for k, v in prof["requests"]["shares"].items():
            print(f"- {v:.1%} {k}")


RESULTS_PROFILE = Path(__file__).resolve().parent / "results" / "overhead-profile.txt"

if __name__ == "__main__":
    main()
