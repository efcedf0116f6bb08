"""Benchmark: how close each admission mode lands on the budget, side by side in one run.

    python -m bench.budget_modes            # ~2 minutes; results in bench/results/budget_modes.json
    # the taper (docs/budget.md): budgets of 10x, 2x, 1x (requests in flight x mean), seeds, taper on and off
    python -m bench.budget_modes --modes predict --budget-factors 10,2,1 --seeds 1,2,3 --tapers 2,0
    # the model's own error in the reservations (BUDGETQ_PREDICT_MODEL_ERROR) on and off, back to back
    python -m bench.budget_modes --modes predict --budget-factors 2 --seeds 1,2,3 --tapers 2 --model-errors 1,0

The workload is the reference one (docs/performance.md, "The reference workload"): lognormal completion lengths (mean 3.8K, sigma 0.8, capped at max_new_tokens
16K), 256 requests in flight over 4 workers, a budget worth minutes of simulated GPU time (the simulator runs
time-scaled). For each mode it reports final tokens / budget, samples discarded, and the wall (and simulated)
time from 90% of the budget to the dataset's close and to the last commit. drain is the baseline.

With ``--budget-factors`` the budget is each factor x in-flight x mean; ``--seeds`` reruns each case with the
simulator's lengths drawn from another seed; ``--tapers`` runs predict once per BUDGETQ_PREDICT_TAPER value
(0 = the margin rule alone); ``--model-errors`` once per BUDGETQ_PREDICT_MODEL_ERROR value (0 = the plain
estimate, as before it). The taper table then gives, per budget size and taper, the median and largest
overshoot, how many runs land in the bound [0, max(0.5% of the budget, max_new_tokens)], and the median
simulated time from 90% of the budget to the close.

Multi-turn (issue 14, bench 3): ``--turns 3`` runs the modes on 3-turn conversations (bench/multiturn.py's
dataset: system, u1, a1, u2, a2, u3, the dataset's answers never sent) with ``produce --turns all``, the
simulator answering in the demo tokenizer's real ids (``--tokenizer``, as bench 1: a re-rendered answer is as
long in the next prompt as it was generated). ``--turns 1,3`` runs single-turn and 3-turn side by side in one
command. The multi-turn table adds conversations and turns on disk, how they stopped, and the checks: predict in
[0, bound], strict over <= 0 and under by at most one max_new_tokens.

    python -m bench.budget_modes --turns 1,3 --results budget_modes_turns.json   # ~12 minutes
    # turns that answer with lengths of their own (turn 2 three times turn 0's): what the per-turn model is for
    python -m bench.budget_modes --modes predict --turns 3 --turn-length-scale 1,2,3 --seeds 1,2,3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import scratch
from bench.multiturn import DATASET as CONV_DATASET
from bench.multiturn import PARSER, write_conversations
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd
from demo.synthetic import write_prompts

RESULTS = Path(__file__).resolve().parent / "results"


def build_tokenizer(directory: Path) -> Path:
    from demo.tokenizer import build_tokenizer as build
    return build(directory, thinking="none")


class Watch(threading.Thread):
    """Polls the dataset's counter and status every 20 ms to time the 90% mark and the close, and every ~0.2 s
    builds predict's length model from what the workers' models read (the ledger's length sample), to see how far
    it strays from the run's own lengths (issue 24: a model that collapses to the lengths seen)."""

    def __init__(self, stack: Stack, name: str, budget: int) -> None:
        super().__init__(daemon=True)
        self.r = stack.client()
        self.stack = stack
        self.name, self.budget = name, budget
        self.t90: float | None = None
        self.t_closed: float | None = None
        self.stop_flag = threading.Event()
        self.history: list[tuple[float, int, int, int]] = []  # (t, used, reserved, in flight) every ~0.2 s
        #: (t, lengths seen, running, young, mean, sd) of the length model every ~0.2 s, predict only
        self.models: list[tuple[float, int, int, bool, float, float]] = []
        #: (t, used, the simulator's completion tokens, its requests running) every ~0.2 s: what the server has
        #: answered and the ledger not yet counted (one server, one dataset: the run's whole traffic)
        self.server: list[tuple[float, int, int, int]] = []

    def _model(self, now: float) -> None:
        from budget.ledger import Ledger
        from worker.estimate import LengthModel
        sample = Ledger(self.r).length_sample(self.name)
        if sample.mode != "predict" or not sample.max_new_tokens:
            return
        m = LengthModel(sample.lengths, sample.prior_mean, sample.max_new_tokens, running=sample.running)
        self.models.append((now, m.observed, len(sample.running), m.young, m.mean(), m.sd()))

    def run(self) -> None:
        ks = DatasetKeys(self.name)
        used_key, meta = ks.used, ks.meta
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
                sim = self.stack.sim_stats()
                self.server.append((now, used, int(sim["completion_tokens_total"]), int(sim["running"])))
                self._model(now)
            time.sleep(0.02)


def _text_hash(raw: Any) -> dict[str, str]:
    """A hash read by a client that does not decode responses, as text."""
    return {bytes(k).decode(): bytes(v).decode() for k, v in dict(raw).items()}


def run_mode(mode: str, args: argparse.Namespace, tok: Path, data: Path, work: Path, budget: int | None = None,
             seed: int | None = None, taper: str | None = None, model_error: str | None = None,
             turns: int = 1) -> dict[str, Any]:
    budget = args.budget if budget is None else budget
    seed = args.seed if seed is None else seed
    name = "prompts" if turns == 1 else CONV_DATASET
    sim = ["--length-dist", "lognormal", "--mean-tokens", str(args.mean), "--sigma", str(args.sigma),
           "--tokens-per-second-per-request", str(args.per_request_tps),
           "--saturation-batch", str(max(256, args.in_flight)),
           # --auto-window: the server runs exactly --in-flight at once and the workers find that themselves
           "--max-running", str(args.in_flight if args.auto_window else max(256, args.in_flight)),
           "--time-scale", str(args.time_scale), "--seed", str(seed),
           "--prefix-cache-pages", "0"]
    multi: list[str] = []
    if turns > 1:  # real ids, so an answer re-rendered into the next prompt is as long as it was generated
        sim += ["--tokenizer", str(tok), "--no-reasoning", "--context-length", "131072"]
        if args.turn_length_scale:  # later turns answer with lengths of their own (sglang-sim --turn-length-scale)
            sim += ["--turn-length-scale", args.turn_length_scale]
        multi = ["--turns", "all", "--reasoning-parser", PARSER]
    # Reservations are restated every simulated 2 s (1 s of real time at --time-scale 1 is the default).
    env = {"BUDGETQ_CONCURRENCY": "" if args.auto_window else str(args.in_flight // args.workers),
           "BUDGETQ_RESERVE_INTERVAL": str(args.reserve_interval if args.reserve_interval is not None
                                           else max(0.02, 2.0 / args.time_scale))}
    if taper is not None:
        env["BUDGETQ_PREDICT_TAPER"] = taper
    if model_error is not None:
        env["BUDGETQ_PREDICT_MODEL_ERROR"] = model_error
    label = (f"{mode}-b{budget}-s{seed}" + (f"-t{taper}" if taper is not None else "")
             + (f"-z{model_error}" if model_error is not None else "") + f"-turns{turns}")
    with Stack(work / label, sim_args=sim, workers=args.workers, worker_env=env) as stack:
        watch = Watch(stack, name, budget)
        watch.start()
        t0 = time.monotonic()
        out = work / label / "out"
        res = subprocess.run([*produce_cmd(), f"{name}={data}", *multi, "--tokenizer", str(tok), "--max-tokens",
                              str(args.max_tokens), "--budget", str(budget), "--budget-mode", mode,
                              "--chunk-size", str(args.chunk_size), "--queue-depth", "8", "--max-context", "65536",
                              *([] if args.no_expect_mean else ["--expect-mean", str(args.mean)]), "--out", str(out), "--redis-url", stack.redis_url,
                              "--quiet"], capture_output=True, text=True, timeout=args.timeout)
        t_end = time.monotonic()
        watch.stop_flag.set()
        watch.join()
        if res.returncode != 0:
            raise RuntimeError(f"{mode}: produce failed: {res.stderr[-2000:]}")
        recs = [json.loads(line) for line in (out / name / "raw_responses.jsonl").read_text().splitlines()]
        r = stack.client()
        ks = DatasetKeys(name)
        meta = _text_hash(r.hgetall(ks.meta))
        stats = _text_hash(r.hgetall(ks.stats))
        used = int(r.get(ks.used) or 0)
        unwritten = sum(int(v) for v in r.hvals(ks.turns))
        total = sum(x["completion_tokens"] for x in recs)
        sim_stats = stack.sim_stats()
        t90 = watch.t90 or t_end
        (Path(args.history_dir) if args.history_dir else work).mkdir(parents=True, exist_ok=True)
        (Path(args.history_dir or work) / f"{label}-history.json").write_text(
            json.dumps({"ledger": watch.history, "models": watch.models, "server": watch.server}))
        # answered by the server and not yet committed, in tokens, over the run and when the dataset closed
        behind = [sim_tokens - used_now for _t, used_now, sim_tokens, _n in watch.server]
        at_close = [sim_tokens - used_now for t, used_now, sim_tokens, _n in watch.server
                    if watch.t_closed is not None and t >= watch.t_closed][:1]
        lengths = [x["completion_tokens"] for x in recs]
        informed = [m for m in watch.models if not m[3]]  # what admission priced by (a young model prices the cap)
        stopped: dict[str, int] = {}
        for x in recs:
            key = str(x.get("stopped_by"))
            stopped[key] = stopped.get(key, 0) + 1
        return {
            "turns_mode": turns, "conversations": len(recs),
            "turns_on_disk": sum(len(x.get("turns") or [1]) for x in recs), "stopped_by": stopped,
            "redis_used": used, "unwritten_turn_tokens": unwritten, "drift": used - total - unwritten,
            "loadavg_1_5_15": os.getloadavg(),
            "mode": mode, "budget": budget, "seed": seed, "taper": taper, "model_error": model_error,
            "tokens": total, "ratio": total / budget,
            "samples": len(recs), "discarded_samples": int(meta.get("todo", 0)),
            "discarded_chunks": int(meta.get("discarded_chunks", 0)), "late": int(stats.get("late", 0)),
            "s_90_to_close": (watch.t_closed - t90) if watch.t_closed else None,
            "s_90_to_end": t_end - t90, "wall_s": t_end - t0,
            "sim_s_90_to_close": ((watch.t_closed - t90) * args.time_scale) if watch.t_closed else None,
            "sim_s_90_to_end": (t_end - t90) * args.time_scale,
            "sim_completed": sim_stats["completed"], "sim_aborted": sim_stats["aborted"],
            # the length model against the run's own mean: how often, and how low, it strayed below 90% of it
            "run_mean": statistics.fmean(lengths) if lengths else None,
            "model_reads": len(informed),
            "model_below_90pct": sum(m[4] < 0.9 * statistics.fmean(lengths) for m in informed) if lengths else None,
            "model_lowest_mean": min((m[4] for m in informed), default=None),
            "uncommitted_max": max(behind, default=None), "uncommitted_median": statistics.median(behind) if behind else None,
            "uncommitted_at_close": at_close[0] if at_close else None,
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


def turns_table(rows: list[dict[str, Any]], max_new: int) -> str:
    """Issue 14's bench 3: each mode at each turns setting, side by side, with the target checked: predict in
    [0, max(0.5% of the budget, max_new_tokens)], strict never over and under by at most one max_new_tokens,
    drain reported; and the invariant used = Σ on disk + Σ committed turns not written (drift)."""
    lines = ["| turns | mode | final tokens / budget | over budget | target | conversations on disk (turns) | "
             "stopped_by | never sent / chunks discarded | 90% -> close / last commit (simulated) | drift | load (1 min) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        over, budget = r["tokens"] - r["budget"], r["budget"]
        bound = max(0.005 * budget, max_new)
        target = {"predict": f"[0, {bound:,.0f}]: " + ("**met**" if 0 <= over <= bound else "**not met**"),
                  "strict": f"[-{max_new:,}, 0]: " + ("**met**" if -max_new <= over <= 0 else "**not met**")
                  }.get(r["mode"], "(reported)")
        close = f"{r['sim_s_90_to_close']:.0f} s" if r["sim_s_90_to_close"] is not None else "-"
        stops = ", ".join(f"{k}: {v}" for k, v in sorted(r.get("stopped_by", {}).items()))
        lines.append(f"| {r.get('turns_mode', 1)} | {r['mode']} | {r['ratio']:.4f} | {over:+,} ({over / budget:+.2%}) | "
                     f"{target} | {r.get('conversations', r['samples'])} ({r.get('turns_on_disk', '-')}) | {stops} | "
                     f"{r['discarded_samples']} / {r['discarded_chunks']} | {close} / {r['sim_s_90_to_end']:.0f} s | "
                     f"{r.get('drift', '-')} | {r.get('loadavg_1_5_15', [float('nan')])[0]:.2f} |")
    return "\n".join(lines)


def taper_table(rows: list[dict[str, Any]], in_flight: int, mean: float, max_new: int) -> str:
    """Per budget size and taper: the bound [0, max(0.5% of the budget, max_new_tokens)], how many runs land in it, median and largest overshoot,
    median simulated 90% -> close."""
    lines = ["| budget (x in flight x mean) | taper | model error | runs | in [0, bound] | median over | max over | bound | "
             "median 90% -> close (simulated) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    def case(r: dict[str, Any]) -> tuple[int, str, str]:
        return r["budget"], r["taper"] or "", r.get("model_error") or ""
    cases = sorted({case(r) for r in rows if r["mode"] == "predict"}, key=lambda c: (-c[0], c[1], c[2]))
    for budget, taper, model_error in cases:
        rs = [r for r in rows if r["mode"] == "predict" and case(r) == (budget, taper, model_error)]
        bound = max(0.005 * budget, max_new)
        over = sorted(r["tokens"] - budget for r in rs)
        closes = sorted(r["sim_s_90_to_close"] for r in rs if r["sim_s_90_to_close"] is not None)
        med_close = f"{statistics.median(closes):.0f} s" if closes else "-"
        lines.append(f"| {budget:,} ({budget / (in_flight * mean):.3g}x) | {taper or 'default'} | {model_error or 'default'} "
                     f"| {len(rs)} | {sum(0 <= o <= bound for o in over)}/{len(rs)} | "
                     f"{statistics.median(over):+,.0f} ({statistics.median(over) / budget:+.2%}) | {over[-1]:+,} | "
                     f"{bound:,.0f} | {med_close} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=10_000_000)
    ap.add_argument("--mean", type=float, default=3800)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--auto-window", action="store_true",
                    help="workers keep the window the server's limits give (BUDGETQ_CONCURRENCY unset; worker/window.py) "
                         "on a server that runs --in-flight at once, in place of --in-flight / --workers each")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--per-request-tps", type=float, default=30.0, help="simulated decode tok/s per request")
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reserve-interval", type=float, default=None,
                    help="BUDGETQ_RESERVE_INTERVAL in real seconds (default: 2 simulated s, 2 / --time-scale); "
                         "1 is the worker's own default, what a user who sets nothing runs")
    ap.add_argument("--no-expect-mean", action="store_true",
                    help="run produce without --expect-mean (no prior: the worker reserves max_new_tokens until it has lengths)")
    ap.add_argument("--history-dir", default="", help="keep each run's (t, used, reserved, in flight) series here")
    ap.add_argument("--prompts", type=int, default=0, help="dataset size (default: 1.6 x the largest budget / mean)")
    ap.add_argument("--modes", default="drain,predict,strict")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--budget-factors", default="",
                    help="comma list: budgets of factor x --in-flight x --mean (replaces --budget), e.g. 10,2,1")
    ap.add_argument("--seeds", default="", help="comma list of simulator seeds (replaces --seed), e.g. 1,2,3")
    ap.add_argument("--tapers", default="",
                    help="comma list of BUDGETQ_PREDICT_TAPER values for predict (0 = off), e.g. 2,0")
    ap.add_argument("--model-errors", default="",
                    help="comma list of BUDGETQ_PREDICT_MODEL_ERROR values for predict (0 = off), e.g. 1,0")
    ap.add_argument("--results", default="budget_modes.json", help="file name under bench/results/")
    ap.add_argument("--turns", default="1", help="comma list of turns per conversation: 1 (single-turn prompts) "
                    "and/or 3 (3-turn conversations, produce --turns all), e.g. 1,3")
    ap.add_argument("--turn-length-scale", default="", metavar="F,F,F",
                    help="with --turns 3: turn k of a conversation answers with the drawn length times entry k "
                         "(sglang-sim --turn-length-scale), e.g. 1,2,3: what predict's per-turn length model is for")
    args = ap.parse_args()
    budgets = ([round(float(f) * args.in_flight * args.mean) for f in args.budget_factors.split(",")]
               if args.budget_factors else [args.budget])
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    tapers: list[str | None] = [t.strip() for t in args.tapers.split(",")] if args.tapers else [None]
    errors: list[str | None] = [z.strip() for z in args.model_errors.split(",")] if args.model_errors else [None]
    turns_list = [int(x) for x in args.turns.split(",")]
    if any(t not in (1, 3) for t in turns_list):
        ap.error(f"--turns {args.turns}: each value must be 1 or 3")
    n_prompts = args.prompts or int(max(budgets) / args.mean * 1.6) + args.in_flight
    results = []
    with scratch("modes") as work:
        tok = build_tokenizer(work / "tok")
        datasets = {1: write_prompts(work / "prompts.jsonl", n_prompts)} if 1 in turns_list else {}
        if 3 in turns_list:  # a conversation is ~3 turns' worth of the budget
            scales = [float(x) for x in args.turn_length_scale.split(",")] if args.turn_length_scale else [1.0]
            per_conversation = args.mean * sum(scales[min(k, len(scales) - 1)] for k in range(3))
            datasets[3] = write_conversations(work / "convs.jsonl", int(max(budgets) / per_conversation * 1.6)
                                              + args.in_flight)
        for seed in seeds:  # seed-major: a run cut short still has every case of its first seeds
            for budget in budgets:
                for mode, turns in [(m, t) for m in args.modes.split(",") for t in turns_list]:
                    for taper in (tapers if mode == "predict" else [None]):
                        for model_error in (errors if mode == "predict" else [None]):
                            row = run_mode(mode, args, tok, datasets[turns], work, budget=budget, seed=seed,
                                           taper=taper, model_error=model_error, turns=turns)
                            print(json.dumps(row), flush=True)
                            results.append(row)
                            RESULTS.mkdir(exist_ok=True)
                            (RESULTS / args.results).write_text(
                                json.dumps({"args": vars(args), "rows": results}, indent=2) + "\n")
    if turns_list != [1]:
        print(turns_table(results, args.max_tokens))
    elif any(r["mode"] == "drain" for r in results) and len(budgets) == 1 and len(seeds) == 1:
        print(table(results))
    if any(r["mode"] == "predict" for r in results):
        print(taper_table(results, args.in_flight, args.mean, args.max_tokens))


if __name__ == "__main__":
    main()
