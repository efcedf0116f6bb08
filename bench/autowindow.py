"""Benchmark: the automatic window (BUDGETQ_CONCURRENCY unset) against the best hand-tuned one, per server size.

    python -m bench.autowindow                                  # the full grid, ~25 minutes
    python -m bench.autowindow --sizes 64,1024 --workers 1,4    # a reduced grid

For each server size (the simulator's ``--max-running`` = ``--saturation-batch``: throughput grows with the batch
up to it, requests beyond it queue) and each number of workers, one fresh stack per run (redis-server, sglang-sim,
the workers, an attached ``produce`` with a budget it never reaches), the reference workload (docs/performance.md:
lognormal lengths, mean 3.8K, ~30 tok/s per request):

- ``auto``: the workers without BUDGETQ_CONCURRENCY;
- the sweep: BUDGETQ_CONCURRENCY = ceil(f x size / workers) for each factor f of ``--factors`` (default 0.5, 1,
  1.25, 2: half the batch, the batch, the batch and a queue, twice the batch).

Each run is measured over the same steady-state window (``--warm`` s after its first request, for ``--window`` s)
by the simulator's occupancy integral: generated tok/s = tok/s per request x mean decoding requests (exact, no edge
effect), with mean running and mean queued requests beside it. The figure per cell: auto's generated tok/s / the
best of the sweep's, all from the same invocation. Results in bench/results/autowindow.json.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.harness import save_results, scratch, sim_args, sim_stats_url, wait_first_request, window_rate
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd
from demo.synthetic import write_prompts


def run_one(args: argparse.Namespace, work: Path, tok: Path, size: int, n_workers: int,
            concurrency: int | None) -> dict[str, Any]:
    """One fresh stack; the steady-state window's figures."""
    sim = sim_args(saturation=size, time_scale=args.time_scale, per_request_tps=args.per_request_tps)
    data = write_prompts(work / "prompts.jsonl", max(2000, 6 * size))
    env = {} if concurrency is None else {"BUDGETQ_CONCURRENCY": str(concurrency)}
    with Stack(work / "stack", sim_args=sim, workers=n_workers, worker_env=env) as stack:
        r = stack.client()
        produce = subprocess.Popen([*produce_cmd(), f"prompts={data}", "--tokenizer", str(tok), "--max-tokens",
                                    "16384", "--budget", "1G", "--max-context", "65536", "--turns", "last",
                                    "--out", str(work / "out"), "--redis-url", stack.redis_url, "--quiet"],
                                   stdout=subprocess.DEVNULL, stderr=open(work / "produce.log", "wb"))
        try:
            url = stack.sim_urls[0]
            t_first = wait_first_request(url)
            time.sleep(max(0.0, t_first + args.warm - time.time()))
            a, used_a, t_a = sim_stats_url(url), int(r.get(DatasetKeys("prompts").used) or 0), time.time()
            time.sleep(args.window)
            b, used_b, t_b = sim_stats_url(url), int(r.get(DatasetKeys("prompts").used) or 0), time.time()
        finally:
            produce.terminate()
            produce.wait(30)
    w: dict[str, Any] = dict(window_rate(a, b, args.per_request_tps * args.time_scale, size))
    w["mean_queued"] = (b["queued_integral"] - a["queued_integral"]) / w["seconds"]
    w["committed_tok_s"] = (used_b - used_a) / (t_b - t_a)
    w["concurrency"] = concurrency if concurrency is not None else "auto"
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256,1024", help="the servers' --max-running, comma-separated")
    ap.add_argument("--workers", default="1,2,4", help="numbers of workers per server, comma-separated")
    ap.add_argument("--factors", default="0.5,1,1.25,2",
                    help="the hand-tuned sweep: total in flight as multiples of the server's size")
    ap.add_argument("--warm", type=float, default=12.0)
    ap.add_argument("--window", type=float, default=12.0)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--per-request-tps", type=float, default=30.0)
    ap.add_argument("--name", default="autowindow", help="results file name under bench/results/")
    args = ap.parse_args()
    os.environ.pop("BUDGETQ_CONCURRENCY", None)  # the automatic runs must not inherit one
    sizes = [int(x) for x in args.sizes.split(",")]
    counts = [int(x) for x in args.workers.split(",")]
    factors = [float(x) for x in args.factors.split(",")]
    cells: list[dict[str, Any]] = []
    with scratch("autowindow") as tmp:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(tmp / "tok")
        for size in sizes:
            for n in counts:
                runs = []
                for i, conc in enumerate([None, *sorted({math.ceil(f * size / n) for f in factors})]):
                    with scratch(f"autowindow-{size}-{n}-{i}") as work:
                        run = run_one(args, work, tok, size, n, conc)
                    runs.append(run)
                    print(f"size {size:5d} workers {n}  concurrency {str(run['concurrency']):>5}: "
                          f"{run['generated_tok_s']:9.0f} tok/s, running {run['mean_running']:7.1f}, "
                          f"queued {run['mean_queued']:7.1f}", flush=True)
                best = max(runs[1:], key=lambda x: x["generated_tok_s"])
                ratio = runs[0]["generated_tok_s"] / best["generated_tok_s"]
                cells.append({"size": size, "workers": n, "auto": runs[0], "sweep": runs[1:],
                              "best_concurrency": best["concurrency"], "ratio": ratio})
                print(f"size {size:5d} workers {n}: auto / best hand-tuned ({best['concurrency']}) = {ratio:.3f}",
                      flush=True)
                # after every cell: a grid cut short keeps what it measured
                path = save_results(args.name, {"args": vars(args), "cells": cells,
                                                "min_ratio": min(c["ratio"] for c in cells)})
    print("\n| max running | workers | auto tok/s | best hand-tuned (per worker) | its tok/s | ratio | auto running / queued |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in cells:
        best = max(c["sweep"], key=lambda x: x["generated_tok_s"])
        print(f"| {c['size']} | {c['workers']} | {c['auto']['generated_tok_s']:.0f} | {c['best_concurrency']} | "
              f"{best['generated_tok_s']:.0f} | {c['ratio']:.3f} | {c['auto']['mean_running']:.0f} / "
              f"{c['auto']['mean_queued']:.0f} |")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
