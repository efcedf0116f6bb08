"""Benchmark: how close each admission mode lands on the budget, side by side in one run.

    python -m bench.budget_modes            # ~2 minutes; results in bench/results/budget_modes.json

The workload is the issue's: lognormal completion lengths (mean 3.8K, sigma 0.8, capped at max_new_tokens
16K), 256 requests in flight over 4 workers, a budget worth minutes of simulated GPU time (the simulator runs
time-scaled). For each mode it reports final tokens / budget, samples discarded, and the wall (and simulated)
time from 90% of the budget to the dataset's close and to the last commit. drain is the baseline.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import Stack, produce_cmd, scratch, write_prompts

RESULTS = Path(__file__).resolve().parent / "results"


def build_tokenizer(directory: Path) -> Path:
    from demo.tokenizer import build_tokenizer as build
    return build(directory, thinking="none")


class Watch(threading.Thread):
    """Polls the dataset's counter and status every 20 ms to time the 90% mark and the close."""

    def __init__(self, stack: Stack, name: str, budget: int) -> None:
        super().__init__(daemon=True)
        self.r = stack.client()
        self.name, self.budget = name, budget
        self.t90: float | None = None
        self.t_closed: float | None = None
        self.stop_flag = threading.Event()
        self.history: list[tuple[float, int, int, int]] = []  # (t, used, reserved, in flight) every ~0.2 s

    def run(self) -> None:
        used_key, meta = f"bq:ds:{{{self.name}}}:used", f"bq:ds:{{{self.name}}}"
        while not self.stop_flag.is_set():
            used = int(self.r.get(used_key) or 0)
            now = time.monotonic()
            if self.t90 is None and used >= 0.9 * self.budget:
                self.t90 = now
            if self.t_closed is None and self.r.hget(meta, "status") == b"closed":
                self.t_closed = now
            if not self.history or now - self.history[-1][0] >= 0.2:
                resv = sum(int(x) for x in self.r.hvals(meta + ":resv"))
                inflight = sum(int(x) for x in self.r.hvals(meta + ":inflight"))
                self.history.append((now, used, resv, inflight))
            time.sleep(0.02)


def run_mode(mode: str, args: argparse.Namespace, tok: Path, data: Path, work: Path) -> dict[str, Any]:
    sim = ["--length-dist", "lognormal", "--mean-tokens", str(args.mean), "--sigma", str(args.sigma),
           "--tokens-per-second-per-request", str(args.per_request_tps), "--saturation-batch", "256",
           "--max-running", "256", "--time-scale", str(args.time_scale), "--seed", str(args.seed),
           "--prefix-cache-pages", "0"]
    # Reservations are restated every simulated 2 s (1 s of real time at --time-scale 1 is the default).
    env = {"BUDGETQ_CONCURRENCY": str(args.in_flight // args.workers),
           "BUDGETQ_RESERVE_INTERVAL": str(max(0.02, 2.0 / args.time_scale))}
    with Stack(work / mode, sim_args=sim, workers=args.workers, worker_env=env) as stack:
        watch = Watch(stack, "prompts", args.budget)
        watch.start()
        t0 = time.monotonic()
        out = work / mode / "out"
        res = subprocess.run([*produce_cmd(), f"prompts={data}", "--tokenizer", str(tok), "--max-tokens",
                              str(args.max_tokens), "--budget", str(args.budget), "--budget-mode", mode,
                              "--chunk-size", str(args.chunk_size), "--queue-depth", "8", "--max-context", "65536",
                              "--expect-mean", str(args.mean), "--out", str(out), "--redis-url", stack.redis_url,
                              "--quiet"], capture_output=True, text=True, timeout=args.timeout)
        t_end = time.monotonic()
        watch.stop_flag.set()
        watch.join()
        if res.returncode != 0:
            raise RuntimeError(f"{mode}: produce failed: {res.stderr[-2000:]}")
        recs = [json.loads(line) for line in (out / "prompts" / "raw_responses.jsonl").read_text().splitlines()]
        r = stack.client()
        meta = {k.decode(): v.decode() for k, v in r.hgetall("bq:ds:{prompts}").items()}
        stats = {k.decode(): v.decode() for k, v in r.hgetall("bq:ds:{prompts}:stats").items()}
        total = sum(x["completion_tokens"] for x in recs)
        sim_stats = stack.sim_stats()
        t90 = watch.t90 or t_end
        (work / f"{mode}-history.json").write_text(json.dumps(watch.history))
        return {
            "mode": mode, "budget": args.budget, "tokens": total, "ratio": total / args.budget,
            "samples": len(recs), "discarded_samples": int(meta.get("todo", 0)),
            "discarded_chunks": int(meta.get("discarded_chunks", 0)), "late": int(stats.get("late", 0)),
            "s_90_to_close": (watch.t_closed - t90) if watch.t_closed else None,
            "s_90_to_end": t_end - t90, "wall_s": t_end - t0,
            "sim_s_90_to_close": ((watch.t_closed - t90) * args.time_scale) if watch.t_closed else None,
            "sim_s_90_to_end": (t_end - t90) * args.time_scale,
            "sim_completed": sim_stats["completed"], "sim_aborted": sim_stats["aborted"],
        }


def table(rows: list[dict[str, Any]]) -> str:
    base = next(r for r in rows if r["mode"] == "drain")
    lines = ["| mode | final tokens / budget | over budget | samples never sent / chunks discarded | "
             "90% -> close (wall / simulated) | 90% -> last commit (wall / simulated) | close time vs drain |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        close = r["s_90_to_close"]
        vs = (f"{close / base['s_90_to_close']:.2f}x" if close and base["s_90_to_close"] else "-")
        lines.append(
            f"| {r['mode']} | {r['ratio']:.4f} | {r['tokens'] - r['budget']:+,} | "
            f"{r['discarded_samples']} / {r['discarded_chunks']} | "
            + (f"{close:.1f} s / {r['sim_s_90_to_close']:.0f} s" if close else "-")
            + f" | {r['s_90_to_end']:.1f} s / {r['sim_s_90_to_end']:.0f} s | {vs} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=10_000_000)
    ap.add_argument("--mean", type=float, default=3800)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--per-request-tps", type=float, default=30.0, help="simulated decode tok/s per request")
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default="drain,predict,strict")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    n_prompts = int(args.budget / args.mean * 1.6) + args.in_flight
    results = []
    with scratch("modes") as work:
        tok = build_tokenizer(work / "tok")
        data = write_prompts(work / "prompts.jsonl", n_prompts)
        for mode in args.modes.split(","):
            row = run_mode(mode, args, tok, data, work)
            print(json.dumps(row), flush=True)
            results.append(row)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "budget_modes.json").write_text(json.dumps({"args": vars(args), "rows": results}, indent=2) + "\n")
    if any(r["mode"] == "drain" for r in results):
        print(table(results))


if __name__ == "__main__":
    main()
