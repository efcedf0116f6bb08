"""Benchmark: a mix's proportion over time (issue 27 §2, docs/mix.md), with pacing and without, in the same run.

    python -m bench.mix_proportion            # ~4 minutes; results in bench/results/mix_proportion.json

One stack (redis-server, sglang-sim time-scaled, --workers workers x 16 in flight). Per repeat, two runs, one
after the other, of three synthetic datasets (a, b, c: 4,000 prompts each) with one ``--budget TOTAL --mix
a=1,b=1,c=2``: one with the default pacing, one with ``--no-mix-pacing``. While each runs, every dataset's
committed tokens (``bq:ds:{n}:used``) are read every 0.2 s. Reported per run: the worst deviation, after the
first 5% of the total, of a dataset's share of the committed tokens from its weight's share (0.25, 0.25, 0.5),
in percentage points (and after 10%, 25% and 50%); then the median over the repeats of each arm.

The simulator draws every response from one length distribution, so the datasets differ here in weight only (the
issue's 1:4:8 lengths need a per-dataset length in the simulator: not built yet). Without pacing the workers pull
the three datasets' chunks at about one rate, so the tokens go 1:1:1 against a mix of 1:1:2.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
from pathlib import Path
from typing import Any

from bench.harness import save_results, scratch, sim_args
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd
from demo.synthetic import write_prompts

WEIGHTS = {"a": 1, "b": 1, "c": 2}


def watch(stack: Stack, prefix: str, stop: threading.Event, samples: list[dict[str, int]]) -> None:
    r = stack.client()
    keys = {n: DatasetKeys(f"{prefix}{n}").used for n in WEIGHTS}
    while not stop.is_set():
        samples.append({n: int(r.get(k) or 0) for n, k in keys.items()})
        stop.wait(0.2)


def worst_deviation(samples: list[dict[str, int]], total: int, after: float = 0.05) -> float:
    """Percentage points: max over samples past ``after`` of the total and datasets of |share - weight share|."""
    wsum = sum(WEIGHTS.values())
    worst = 0.0
    for s in samples:
        used = sum(s.values())
        if used < after * total:
            continue
        worst = max(worst, *(abs(s[n] / used - WEIGHTS[n] / wsum) * 100 for n in WEIGHTS))
    return worst


def one_run(stack: Stack, work: Path, tok: Path, data: Path, prefix: str, pace: bool,
            args: argparse.Namespace) -> dict[str, Any]:
    stop, samples = threading.Event(), []  # type: ignore[var-annotated]
    t = threading.Thread(target=watch, args=(stack, prefix, stop, samples), daemon=True)
    t.start()
    files = [f"{prefix}{n}={data}" for n in WEIGHTS]
    mix = ",".join(f"{prefix}{n}={w}" for n, w in WEIGHTS.items())
    res = subprocess.run([*produce_cmd(), *files, "--tokenizer", str(tok), "--max-tokens", str(args.max_tokens),
                          "--budget", str(args.total), "--mix", mix, "--chunk-size", "16", "--queue-depth", "4",
                          "--expect-mean", str(args.mean), "--out", str(work / "out"), "--redis-url",
                          stack.redis_url, "--quiet", *([] if pace else ["--no-mix-pacing"])],
                         capture_output=True, text=True, timeout=args.timeout)
    stop.set()
    t.join(3)
    if res.returncode != 0:
        raise RuntimeError(f"produce failed: {res.stderr[-2000:]}")
    final = samples[-1] if samples else {}
    return {"pacing": pace, "run": prefix, "worst_deviation_pp": worst_deviation(samples, args.total),
            "worst_after_pp": {f"{a:.0%}": worst_deviation(samples, args.total, a) for a in (0.1, 0.25, 0.5)},
            "final": final, "samples": len(samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--total", type=int, default=400_000)
    ap.add_argument("--mean", type=float, default=300)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--time-scale", type=float, default=20)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    with scratch("mix-proportion") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = write_prompts(work / "prompts.jsonl", 4000)
        sim = sim_args(mean=args.mean, per_request_tps=100, saturation=64, time_scale=args.time_scale)
        rows = []
        with Stack(work / "stack", sim_args=sim, workers=args.workers,
                   worker_env={"BUDGETQ_CONCURRENCY": "16"}) as stack:
            stack.wait_for_workers()
            for rep in range(args.repeats):
                for pace in (True, False):  # interleaved: both arms see the same machine
                    row = one_run(stack, work, tok, data, f"r{rep}{'p' if pace else 'n'}", pace, args)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = {arm: statistics.median(r["worst_deviation_pp"] for r in rows if r["pacing"] == (arm == "paced"))
               for arm in ("paced", "unpaced")}
    print(json.dumps({"median_worst_deviation_pp": summary}))
    save_results("mix_proportion", {"args": vars(args), "runs": rows, "median_worst_deviation_pp": summary})


if __name__ == "__main__":
    main()
