"""Benchmark: predict's landing over a sweep of lengths, widths, speeds and budgets (issue 24), on real workers.

    # the issue's own cell: 192 in flight (3 workers x 64), median 300 (mean 413), cap 2048, 600,000, 10 seeds
    python -m bench.predict_sweep --issue-cell --seeds 1,2,3,4,5,6,7,8,9,10 --results predict_sweep_issue.json
    # the sweep: median length x in flight x speed x budget (36 cells), one seed each
    python -m bench.predict_sweep --seeds 1 --results predict_sweep.json
    # a part of it
    python -m bench.predict_sweep --lengths 300 --in-flight 64,192 --speeds short --factors 10,2,1 --seeds 1,2

Each run is one bench/budget_modes.py run_mode (redis-server, sglang-sim, N ``rq worker``s, ``produce``). The cells:

- length: lognormal sigma 0.8, median 300 (mean 413, capped at max_new_tokens 2,048: issue 24's workload) or
  the reference workload (mean 3.8K, median 2.8K, capped at 16,384: docs/performance.md);
- in flight: 64 (1 worker x 64), 192 (3 x 64), 1024 (4 x 256);
- speed: ``short``, requests of about 0.5 s mean (0.1-2 s: decode mean / 0.5 tok/s per request, time scale 1),
  or ``long``, about 60 simulated s mean (30-120 s: mean / 60 tok/s, the simulator at time scale 30, so a long
  request takes about 2 s of the machine's time);
- budget: 10x, 2x, 1x what is in flight (in flight x mean).

The worker runs with its defaults as a user's would (BUDGETQ_RESERVE_INTERVAL 1 s of real time at time scale 1;
at time scale 30, 1/30 s: one simulated second, so the interval stays 1/60 of a long request, as on a real GPU),
produce with its default --chunk-size 256 and no --expect-mean. Per cell: runs in the bound [0, max(0.5% of the
budget, max_new_tokens)], median and worst overshoot, and the median simulated time from 90% of the budget to the
close (the taper's cost). ``--modes predict,strict`` also runs strict, checked against [-max_new_tokens, 0].

The machine matters: at 1024 in flight of 0.5 s requests the workers and the simulator need more CPU than a small
machine has, so requests run slower than asked (the rows record the load average).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from bench.budget_modes import RESULTS, build_tokenizer, run_mode
from bench.harness import scratch
from demo.synthetic import write_prompts

#: median -> (mean, max_new_tokens) of a lognormal of sigma 0.8: 300 is issue 24's; 2.8K is the reference's 3.8K mean.
LENGTHS = {300: (413.0, 2048), 2800: (3800.0, 16384)}
#: in flight -> (workers, concurrency each)
WIDTHS = {64: (1, 64), 192: (3, 64), 1024: (4, 256)}
#: speed -> (seconds per request at the mean, simulator time scale)
SPEEDS = {"short": (0.5, 1.0), "long": (60.0, 30.0)}


def cell_args(median: int, in_flight: int, speed: str, args: argparse.Namespace) -> argparse.Namespace:
    mean, cap = LENGTHS[median]
    workers, _each = WIDTHS[in_flight]
    seconds, scale = SPEEDS[speed]
    return argparse.Namespace(
        mean=mean, sigma=0.8, max_tokens=cap, in_flight=in_flight, workers=workers, chunk_size=256,
        per_request_tps=mean / seconds, time_scale=scale, reserve_interval=1.0 / scale,
        no_expect_mean=not args.expect_mean,
        timeout=args.timeout, turn_length_scale="", history_dir=args.history_dir, budget=0, seed=1, auto_window=False)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per cell and mode: runs in the bound (predict [0, max(0.5% of the budget, max_new_tokens)], strict
    [-max_new_tokens, 0]), median overshoot, the lowest and highest, median simulated 90% -> close, load."""
    lines = ["| median length (cap) | in flight | speed | budget (x in flight) | mode | runs in bound | median over | "
             "lowest / highest | bound | median 90% -> close (simulated) | load (1 min) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def key(r: dict[str, Any]) -> tuple[int, int, str, float, str]:
        c = r["cell"]
        return c["median"], c["in_flight"], c["speed"], c["factor"], r["mode"]
    for median, width, speed, factor, mode in sorted({key(r) for r in rows},
                                                     key=lambda k: (k[0], k[1], k[2] != "short", -k[3], k[4])):
        rs = [r for r in rows if key(r) == (median, width, speed, factor, mode)]
        budget, cap = rs[0]["budget"], LENGTHS[median][1]
        over = sorted(r["tokens"] - budget for r in rs)
        lo, hi = (-cap, 0) if mode == "strict" else (0, max(0.005 * budget, cap))
        ok = sum(lo <= o <= hi for o in over)
        closes = [r["sim_s_90_to_close"] for r in rs if r["sim_s_90_to_close"] is not None]
        close = f"{statistics.median(closes):,.1f} s" if closes else "-"
        med = statistics.median(over)
        loads = [r["loadavg_1_5_15"][0] for r in rs]
        lines.append(f"| {median:,} ({cap:,}) | {width} | {speed} | {budget:,} ({factor:.3g}x) | {mode} | {ok}/{len(rs)} | "
                     f"{med:+,.0f} ({med / budget:+.2%}) | {over[0]:+,} / {over[-1]:+,} | [{lo:,}, {hi:,.0f}] | {close} | "
                     f"{min(loads):.1f}-{max(loads):.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="300,2800", help="medians: 300 (issue 24) and/or 2800 (the reference)")
    ap.add_argument("--in-flight", default="64,192,1024")
    ap.add_argument("--speeds", default="short,long")
    ap.add_argument("--factors", default="10,2,1", help="budgets: factor x in flight x mean")
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--modes", default="predict")
    ap.add_argument("--issue-cell", action="store_true",
                    help="issue 24's own setup instead of the sweep: median 300, 192 in flight, 600,000 tokens, "
                         "6,000 prompts, --speed-tps tok/s per request, time scale 1, 1 s interval")
    ap.add_argument("--speed-tps", default="3000,300", help="with --issue-cell: per-request decode speeds")
    ap.add_argument("--expect-mean", action="store_true",
                    help="give produce --expect-mean (the true mean) instead of no prior (max_new_tokens until lengths)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--history-dir", default="")
    ap.add_argument("--results", default="predict_sweep.json", help="file name under bench/results/")
    ap.add_argument("--table", nargs="+", metavar="FILE", help="print the summary of these results files and exit")
    args = ap.parse_args()
    if args.table:
        print(summary([row for f in args.table for row in json.loads(Path(f).read_text())["rows"]]))
        return
    seeds = [int(x) for x in args.seeds.split(",")]
    modes = args.modes.split(",")
    rows: list[dict[str, Any]] = []
    cells: list[tuple[dict[str, Any], argparse.Namespace, int]] = []
    if args.issue_cell:
        for tps in (float(x) for x in args.speed_tps.split(",")):
            a = cell_args(300, 192, "short", args)
            a.per_request_tps = tps
            cell = {"median": 300, "in_flight": 192, "speed": f"{tps:g} tok/s", "factor": 600_000 / (192 * a.mean)}
            cells.append((cell, a, 600_000))
    else:
        for median in (int(x) for x in args.lengths.split(",")):
            for width in (int(x) for x in args.in_flight.split(",")):
                for speed in args.speeds.split(","):
                    for factor in (float(x) for x in args.factors.split(",")):
                        a = cell_args(median, width, speed, args)
                        cell = {"median": median, "in_flight": width, "speed": speed, "factor": factor}
                        cells.append((cell, a, round(factor * width * a.mean)))
    with scratch("predict-sweep") as work:
        tok = build_tokenizer(work / "tok")
        for seed in seeds:  # seed-major: a sweep cut short still has every cell of its first seeds
            for i, (cell, a, budget) in enumerate(cells):
                where = work / f"cell{i}"  # run_mode names its directories by mode, budget and seed only
                if args.history_dir:
                    a.history_dir = str(Path(args.history_dir) / f"cell{i}")
                n = 6000 if args.issue_cell else int(budget / a.mean * 1.6) + a.in_flight
                data = work / f"prompts-{n}.jsonl"
                if not data.exists():
                    write_prompts(data, n)
                for mode in modes:
                    a.seed = seed
                    try:
                        row = run_mode(mode, a, tok, data, where, budget=budget, seed=seed)
                    except Exception as exc:  # a cell that fails (timeout, produce error) is reported, not fatal
                        print(json.dumps({"cell": cell, "mode": mode, "seed": seed, "error": repr(exc)[:500]}),
                              flush=True)
                        continue
                    row["cell"] = cell
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    RESULTS.mkdir(exist_ok=True)
                    (RESULTS / args.results).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    if rows:
        print(summary(rows))


if __name__ == "__main__":
    main()
