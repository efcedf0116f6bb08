"""Benchmark (7): a worker's memory over 10,000 samples: it must stay flat.

    python -m bench.memory                # ~1-2 minutes; results in bench/results/memory.json

One ``rq worker -w worker.Worker`` with ``BUDGETQ_CONCURRENCY=64`` (``--concurrency``; 0 leaves it unset, so the
worker runs the automatic window, ~274 in flight against the simulator's 256 slots, and its RSS measures those
extra requests' answers, not growth) against a zero-latency simulator that still answers
the reference workload's lengths (docs/performance.md: lognormal, mean 3.8K tokens, max_new_tokens 16K: ~40 KB answers), fed by an attached
``produce`` (which collects the results, as in production). The worker's RSS (VmRSS) is sampled every 0.25 s
together with the committed count; reported: RSS at every 1,000 samples, the peak (VmHWM), and the growth
from the 2,000th to the last sample (after start-up allocations settle).
"""
from __future__ import annotations

import argparse
import subprocess
import time
from typing import Any

from bench.harness import cpu_seconds, rss_kb, save_results, scratch
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd
from demo.synthetic import write_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--mean", type=float, default=3800)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--concurrency", type=int, default=64,
                    help="the worker's BUDGETQ_CONCURRENCY; 0: unset (the automatic window)")
    args = ap.parse_args()
    sim = ["--zero-latency", "--length-dist", "lognormal", "--mean-tokens", str(args.mean), "--sigma", "0.8",
           "--seed", "1"]
    with scratch("memory") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = write_prompts(work / "prompts.jsonl", args.samples)
        env = {"BUDGETQ_CONCURRENCY": str(args.concurrency)} if args.concurrency else {}
        with Stack(work / "stack", sim_args=sim, workers=1, worker_env=env) as stack:
            r = stack.client()
            worker = stack.workers[0]
            stack.wait_for_workers()
            base_rss = rss_kb(worker.pid)[0]
            produce = subprocess.Popen([*produce_cmd(), f"prompts={data}", "--tokenizer", str(tok), "--max-tokens",
                                        str(args.max_tokens), "--max-context", "65536", "--out", str(work / "out"),
                                        "--redis-url", stack.redis_url, "--quiet"],
                                       stdout=subprocess.DEVNULL, stderr=open(work / "produce.log", "wb"))
            series: list[tuple[float, int, int]] = []
            t0 = time.time()
            cpu0 = cpu_seconds(worker.pid)
            try:
                while produce.poll() is None and time.time() - t0 < args.timeout:
                    committed = int(r.hget(DatasetKeys("prompts").meta, "committed") or 0)
                    series.append((time.time() - t0, committed, rss_kb(worker.pid)[0]))
                    time.sleep(0.25)
                rss_now, peak = rss_kb(worker.pid)
                committed = int(r.hget(DatasetKeys("prompts").meta, "committed") or 0)
                series.append((time.time() - t0, committed, rss_now))
                wall, cpu = time.time() - t0, cpu_seconds(worker.pid) - cpu0
                # newline-terminated lines only: produce may be writing one (killed at the timeout)
                lines = (work / "out" / "prompts" / "raw_responses.jsonl").read_bytes().count(b"\n")
            finally:
                if produce.poll() is None:
                    produce.kill()
                stack.kill()
    marks: dict[int, float] = {}
    for _t, c, rss in series:
        k = (c // 1000) * 1000
        if k and k not in marks:
            marks[k] = rss / 1024
    after = [rss for _t, c, rss in series if c >= 2000]
    res: dict[str, Any] = {
        "args": vars(args), "samples_committed": committed, "lines_on_disk": lines, "wall_s": wall,
        "worker_cpu_share": cpu / wall, "rss_mb_before_first_job": base_rss / 1024, "peak_rss_mb": peak / 1024,
        "rss_mb_at": marks, "growth_mb_from_2000_to_end": (after[-1] - after[0]) / 1024 if after else None,
        "max_minus_min_mb_after_2000": (max(after) - min(after)) / 1024 if after else None,
        "series": series}
    save_results("memory", res)
    print("| samples committed | " + " | ".join(f"{k:,}" for k in marks) + " |")
    print("| --- | " + " | ".join("---" for _ in marks) + " |")
    print("| worker RSS (MB) | " + " | ".join(f"{v:.1f}" for v in marks.values()) + " |")
    print(f"\npeak RSS {peak / 1024:.1f} MB (idle worker before the first job: {base_rss / 1024:.1f} MB); growth from "
          f"sample 2,000 to {committed:,}: {res['growth_mb_from_2000_to_end']:+.1f} MB; worker CPU share "
          f"{res['worker_cpu_share']:.2f}; {lines:,} lines on disk")


if __name__ == "__main__":
    main()
