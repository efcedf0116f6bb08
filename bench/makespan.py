"""Benchmark: how long a WHOLE run takes (ramp-up, steady state and end-of-run tail), budgetq vs a plain asyncio client.

    python -m bench.makespan              # ~3 minutes; bench/results/makespan.json and makespan.log
    python -m bench.makespan --chunks 256,64 --prompts 3000 --time-scale 50

Why: bench/efficiency.py measures a steady-state window, but a run also has an end. budgetq hands samples out
in RQ chunks (``--chunk-size``, default 256) and each worker keeps 64 requests in flight (BUDGETQ_CONCURRENCY).
When the queue runs dry, the last chunk's unstarted samples can start only on the worker that holds it, 64 at
a time, while the other workers idle: server slots may stay empty at the end that a single client holding 256
requests in flight would fill. This measures what that costs on N prompts of one unbudgeted dataset.

Every side gets a fresh sglang-sim with the same seed (the n-th request gets the n-th length, so each side
generates the same N lengths) and the reference workload (docs/performance.md: lognormal lengths, mean 3.8K, sigma 0.8, 16K cap,
30 tok/s per request, a 256-request batch), time-scaled (``--time-scale 50``: a side takes ~30-40 s):
- baseline: bench/client.py, one process holding 256 requests in flight over the N bodies produce would send,
  until every one is answered;
- budgetq, once per chunk size: 4 ``rq worker -w worker.Worker`` x 64 (defaults) and an attached ``produce``
  with ``--chunk-size C`` and no budget (it exits 0 once every sample is committed).

Figures come from the simulator's /sim/stats, polled every ``--poll`` s, on the simulator's clock:
- makespan: first request at the server -> its ``completed`` counter reaches N (also: produce's exit, and
  when ``submitted`` reaches N: the last request started);
- ramp: first request -> ``running`` first reaches 95% of 256; tail: ``running`` drops below 95% of 256 for
  good -> end; occupancy: mean running / 256 (``running_integral``) over the makespan and over the tail;
- ideal: max(sum of the N lengths / (256 x tok/s per request x time scale), longest / (tok/s x scale)), a lower
  bound no client reaches (the last requests to start still run alone at the end).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.efficiency import render_bodies
from bench.harness import RESULTS, CpuMeter, fmt_cpu, save_results, scratch, sim_args, sim_stats_url
from demo.appending import read_jsonl
from demo.stack import Stack, produce_cmd, start_sim
from demo.synthetic import write_prompts

SAT = 256
SERIES_STEP = 0.5  # seconds between saved points of the running-count series
Sample = tuple[float, int, int, float, int]  # sim uptime, running, completed, running_integral, submitted


def watch(url: str, n: int, pids: dict[str, int], poll: float, timeout: float) -> dict[str, Any]:
    """Poll /sim/stats from before the first request until ``completed`` reaches n; CPU shares over that span."""
    deadline = time.monotonic() + timeout
    series: list[Sample] = []
    cpu: CpuMeter | None = None
    t_first = 0.0
    while True:
        s = sim_stats_url(url)
        if cpu is None and s["submitted"] > 0:
            cpu, t_first = CpuMeter(pids), time.time()
        if cpu is not None:
            series.append((s["uptime"], s["running"], s["completed"], s["running_integral"], s["submitted"]))
            if s["completed"] >= n:
                return {"t_first": t_first, "t_end": time.time(), "series": series, "cpu": cpu.stop(), "end": s}
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out: {s['completed']} of {n} completed")
        time.sleep(poll)


def summarize(w: dict[str, Any], n: int) -> dict[str, Any]:
    series: list[Sample] = w["series"]
    (u0, _, _, ri0, _), (u1, _, _, ri1, _) = series[0], series[-1]
    high = [i for i, x in enumerate(series) if x[1] >= 0.95 * SAT]
    ramp = series[high[0]][0] - u0 if high else None
    tail_i = high[-1] + 1 if high and high[-1] + 1 < len(series) else 0
    ut, rit = series[tail_i][0], series[tail_i][3]
    makespan, tail = u1 - u0, u1 - ut
    end = w["end"]
    started = next(x[0] - u0 for x in series if x[4] >= n)
    return {"makespan_s": makespan, "ramp_s": ramp, "all_started_s": started, "tail_s": tail,
            "occupancy": (ri1 - ri0) / makespan / SAT,
            "tail_occupancy": (ri1 - rit) / tail / SAT if tail > 0 else None,
            "idle_slot_s": SAT * makespan - (ri1 - ri0), "tail_idle_slot_s": SAT * tail - (ri1 - rit),
            "tokens": end["completion_tokens_total"], "submitted": end["submitted"], "aborted": end["aborted"],
            "completed": end["completed"], "cpu": w["cpu"], "polls": len(series),
            "running_series": thin([(round(u - u0, 3), r) for u, r, _, _, _ in series], SERIES_STEP)}


def thin(points: list[tuple[float, int]], step: float) -> list[tuple[float, int]]:
    """Every poll feeds the figures; the saved series keeps one point per ``step`` s (and the last)."""
    out: list[tuple[float, int]] = []
    for t, r in points:
        if not out or t - out[-1][0] >= step:
            out.append((t, r))
    if points and out[-1] != points[-1]:
        out.append(points[-1])
    return out


def run_baseline(args: argparse.Namespace, work: Path, bodies: Path, sim: list[str], timeout: float
                 ) -> dict[str, Any]:
    sim_service, url = start_sim("sim-baseline", sim, work)
    proc = sim_service.proc
    out = work / "baseline-done.json"
    try:
        client = subprocess.Popen([sys.executable, "-m", "bench.client", "--url", url, "--bodies", str(bodies),
                                   "--in-flight", str(SAT), "--out", str(out)])  # no --duration: until all answered
        try:
            res = summarize(watch(url, args.prompts, {"client": client.pid, "sim": proc.pid}, args.poll, timeout),
                            args.prompts)
            res["client_rc"] = client.wait(60)
        finally:
            if client.poll() is None:
                client.kill()
        done = json.loads(out.read_text())
        lengths = [n for _, n in done["done"]]
        res.update({"answers": len(lengths), "errors": done["errors"], "sum_lengths": sum(lengths),
                    "max_length": max(lengths)})
        return res
    finally:
        proc.kill()
        proc.wait()


def run_budgetq(args: argparse.Namespace, work: Path, tok: Path, data: Path, sim: list[str], chunk: int,
                timeout: float) -> dict[str, Any]:
    out = work / f"out-{chunk}"
    with Stack(work / f"budgetq-{chunk}", sim_args=sim, workers=args.workers) as stack:
        log = open(work / f"produce-{chunk}.log", "wb")
        produce = subprocess.Popen([*produce_cmd(), f"prompts={data}", "--tokenizer", str(tok), "--max-tokens",
                                    str(args.max_tokens), "--max-context", "65536", "--chunk-size", str(chunk),
                                    "--out", str(out), "--redis-url", stack.redis_url, "--quiet"],
                                   stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        try:
            w = watch(stack.sim_urls[0], args.prompts, {**stack.pids(), "produce": produce.pid}, args.poll, timeout)
            res = summarize(w, args.prompts)
            res["produce_rc"] = produce.wait(120)
            res["produce_exit_s"] = time.time() - w["t_first"]  # wall clock, from the first request seen
        finally:
            if produce.poll() is None:
                produce.kill()
                produce.wait()
            stack.kill()
    # Whole lines only: a produce killed at the timeout may have left half of one.
    recs = read_jsonl(out / "prompts" / "raw_responses.jsonl")
    res.update({"chunk_size": chunk, "lines": len(recs), "unique_ids": len({str(r["id"]) for r in recs}),
                "tokens_on_disk": sum(int(r["completion_tokens"]) for r in recs)})
    return res


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(base: dict[str, Any], sides: dict[int, dict[str, Any]], ideal: float, scale: float) -> str:
    cols = [base, *sides.values()]
    head = ["baseline (asyncio client, 256 in flight)", *(f"budgetq, chunks of {c}" for c in sides)]
    rows = [f"| figure (wall s; x {scale:g} = simulated s) | " + " | ".join(head) + " |",
            "| --- |" + " --- |" * len(cols)]

    def row(name: str, cells: list[str]) -> None:
        rows.append(f"| {name} | " + " | ".join(cells) + " |")

    row("makespan: first request -> N completed at the server",
        [f"**{c['makespan_s']:.2f}**" for c in cols])
    row("ratio baseline / this (>= 1: as fast as the baseline)",
        [f"**{base['makespan_s'] / c['makespan_s']:.4f}**" for c in cols])
    row(f"makespan / ideal ({ideal:.2f} s)", [f"{c['makespan_s'] / ideal:.3f}" for c in cols])
    row("produce exits (from the first request)", ["-", *(f"{c['produce_exit_s']:.2f}" for c in sides.values())])
    row("ramp: first request -> 95% of 256 running", [fmt(c["ramp_s"]) for c in cols])
    row("last of the N requests reaches the server", [f"{c['all_started_s']:.2f}" for c in cols])
    row("tail: running < 95% of 256 for good -> end", [f"{c['tail_s']:.2f}" for c in cols])
    row("tail minus the baseline's", [f"{c['tail_s'] - base['tail_s']:+.2f}" for c in cols])
    row("mean occupancy in the tail", [fmt(c["tail_occupancy"], ".3f") for c in cols])
    row("mean occupancy over the makespan", [f"{c['occupancy']:.4f}" for c in cols])
    row("idle slot-seconds: whole run / tail", [f"{c['idle_slot_s']:,.0f} / {c['tail_idle_slot_s']:,.0f}"
                                                for c in cols])
    row("tokens generated / requests submitted (aborted)",
        [f"{c['tokens']:,} / {c['submitted']:,} ({c['aborted']})" for c in cols])
    row("answers: client (errors) / produce rc, lines, unique ids",
        [f"{base['answers']:,} ({base['errors']})",
         *(f"rc {c['produce_rc']}, {c['lines']:,}, {c['unique_ids']:,}" for c in sides.values())])
    row("CPU share (cores) over the makespan", [fmt_cpu(c["cpu"]) for c in cols])
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3000)
    ap.add_argument("--chunks", default="256,64,16", help="budgetq chunk sizes to run, comma-separated")
    ap.add_argument("--mean", type=float, default=3800)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--per-request-tps", type=float, default=30.0)
    ap.add_argument("--time-scale", type=float, default=50.0)
    ap.add_argument("--poll", type=float, default=0.025, help="seconds between /sim/stats polls")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    sim = sim_args(mean=args.mean, sigma=args.sigma, per_request_tps=args.per_request_tps,
                   time_scale=args.time_scale, seed=args.seed)  # lengths capped by each request's max_new_tokens
    rate = args.per_request_tps * args.time_scale  # wall tok/s of one request
    timeout = 3 * args.prompts * args.mean / (SAT * rate) + 120
    log: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        log.append(line)

    t0 = time.time()
    with scratch("makespan") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = write_prompts(work / "prompts.jsonl", args.prompts)
        bodies = work / "bodies.json"
        bodies.write_text(json.dumps({"input_ids": render_bodies(tok, data),
                                      "sampling_params": {"max_new_tokens": args.max_tokens}}))
        base = run_baseline(args, work, bodies, sim, timeout)
        say("baseline " + json.dumps({k: v for k, v in base.items() if k != "running_series"}))
        sides: dict[int, dict[str, Any]] = {}
        for c in chunks:
            sides[c] = run_budgetq(args, work, tok, data, sim, c, timeout)
            say(f"budgetq chunk {c} " + json.dumps({k: v for k, v in sides[c].items() if k != "running_series"}))
    ideal = max(base["sum_lengths"] / (SAT * rate), base["max_length"] / rate)
    result = {"args": vars(args), "ideal_s": ideal, "wall_s": time.time() - t0, "baseline": base,
              "budgetq": {str(c): r for c, r in sides.items()},
              "ratio_baseline_over_budgetq": {str(c): base["makespan_s"] / r["makespan_s"] for c, r in sides.items()}}
    save_results("makespan", result)
    say(table(base, sides, ideal, args.time_scale))
    say(f"ideal = max({base['sum_lengths']:,} tokens / ({SAT} x {rate:g} tok/s), longest {base['max_length']:,} / "
        f"{rate:g}) = {ideal:.2f} s; whole command {time.time() - t0:.0f} s")
    (RESULTS / "makespan.log").write_text("\n".join(log) + "\n")


if __name__ == "__main__":
    main()
