"""Benchmark: a mix's proportion over time (issue 27 §2, docs/mix.md), with pacing and without, on one stack.

    python -m bench.mix_proportion --seeds 1,2,3 --total 300000                 # one length for all (~4 min)
    python -m bench.mix_proportion --lengths 1,4,8 --dry 300 --seeds 1,...,10 --total 1000000

Per seed, one stack (redis-server, sglang-sim time-scaled with ``--seed S``, --workers workers x 16 in flight)
and two runs on it, one after the other: the default pacing, then ``--no-mix-pacing``. A run is three synthetic
datasets a, b, c (4,000 prompts each) with one ``--budget TOTAL --mix a=1,b=1,c=2``, and with ``--dry N`` a
fourth, d (weight 1), of only N prompts: it runs out of prompts early, and its rest of the total must pass to the
others by weight. ``--lengths 1,4,8`` gives a, b and c mean answer lengths in that ratio (sglang-sim
``--length-scale-by-text``: each dataset's prompts say "Write A item", "Write B item", ...; d has factor 1); the
default, all 1, is one length distribution for every dataset.

While each run goes, every dataset's committed tokens (``bq:ds:{n}:used``) are read every 0.2 s. Reported per run:

- ``worst_pp``: the worst deviation of a, b, c's shares of their committed tokens from their weights' shares
  (0.25, 0.25, 0.5), in percentage points, over the samples after 5%, 10%, 25%, 50% of the total. Among a, b, c
  the target is the same whether d is still going or dry, so the figure means one thing all along;
- ``worst_with_dry_pp``: the same over all four datasets (target 1/5, 1/5, 2/5, 1/5), over the samples before d
  ran dry (after 5% of the total);
- ``final``: each dataset's tokens, its share after the redistribution (``(total - used of d) x w / 4`` for a, b,
  c; d's share is what it used) and the difference; ``final_pp``: a, b, c's final deviation;
- ``in_bound``: the total of the run lands in [TOTAL, TOTAL + the sum over the members still going of predict's
  bound, max(0.5% of its share, --max-tokens)] (docs/budget.md, docs/mix.md).

Without pacing the workers pull the datasets' chunks at about one rate, so the tokens go by sample counts and
lengths (1:4:8 lengths: 1:4:8) against a mix of 1:1:2. Results: bench/results/mix_proportion.json (or --out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from bench.harness import save_results, scratch, sim_args
from budget.keys import DatasetKeys, mix
from demo.stack import Stack, produce_cmd
from demo.synthetic import write_prompts

WEIGHTS = {"a": 1, "b": 1, "c": 2}
DRY = "d"
DRY_WEIGHT = 1
PROMPTS = 4000


def marker(name: str) -> str:
    """The text every prompt of dataset ``name`` holds: what the simulator's --length-scale-by-text reads."""
    return f"Write {name.upper()} item"


@dataclass
class Trace:
    """What the watcher saw: (wall time, used per dataset) samples, and when the dry member was marked dry."""

    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    dry_at: float | None = None


def watch(stack: Stack, members: Sequence[str], mix_id: str, dry: str | None, stop: threading.Event,
          trace: Trace, interval: float = 0.2) -> None:
    """Read every member's committed tokens (and whether the dry one is marked dry) until ``stop``."""
    r = stack.client()
    keys = {n: DatasetKeys(n).used for n in members}
    mix_key = mix(mix_id)
    while not stop.is_set():
        trace.samples.append((time.time(), {n: int(r.get(k) or 0) for n, k in keys.items()}))
        if dry is not None and trace.dry_at is None and r.hexists(mix_key, f"dry:{dry}"):
            trace.dry_at = time.time()
        stop.wait(interval)


def deviation(used: dict[str, int], weights: dict[str, float]) -> float:
    """Percentage points: the largest |share of the tokens - share of the weight| over ``weights``' datasets."""
    tok, wsum = sum(used[n] for n in weights), sum(weights.values())
    if tok <= 0:
        return 0.0
    return max(abs(used[n] / tok - w / wsum) * 100 for n, w in weights.items())


def worst_deviation(samples: Sequence[tuple[float, dict[str, int]]], weights: dict[str, float], total: int,
                    after: float = 0.05, before: float | None = None) -> float | None:
    """The worst `deviation` over the samples once all datasets together have ``after`` of the total (and taken
    before wall time ``before``); None when no sample qualifies."""
    devs = [deviation(s, weights) for t, s in samples
            if sum(s.values()) >= after * total and (before is None or t < before)]
    return max(devs) if devs else None


def predict_bound(share: int, max_tokens: int) -> int:
    """How far above its share predict may land a dataset (docs/budget.md): max(0.5% of it, max_new_tokens)."""
    return max(share // 200, max_tokens)


@dataclass(frozen=True)
class Mix:
    """One run's datasets: name -> (prompts file, weight); ``dry`` is the member meant to run out of prompts."""

    files: dict[str, Path]
    weights: dict[str, float]
    dry: str | None

    def named(self, prefix: str) -> "Mix":
        return Mix({prefix + n: p for n, p in self.files.items()}, {prefix + n: w for n, w in self.weights.items()},
                   None if self.dry is None else prefix + self.dry)

    @property
    def mix_id(self) -> str:
        return ",".join(sorted(self.files))

    def argv(self) -> list[str]:
        """The datasets and the --mix of a produce command."""
        return [*(f"{n}={p}" for n, p in self.files.items()),
                "--mix", ",".join(f"{n}={w:g}" for n, w in self.weights.items())]


def build_mix(work: Path, dry: int, prompts: int = PROMPTS) -> Mix:
    """a, b, c with ``prompts`` prompts each (and d with ``dry`` prompts when > 0), each saying its own marker."""
    files = {n: write_prompts(work / f"{n}.jsonl", prompts, prefix=marker(n)) for n in WEIGHTS}
    weights: dict[str, float] = dict(WEIGHTS)
    if dry > 0:
        files[DRY] = write_prompts(work / f"{DRY}.jsonl", dry, prefix=marker(DRY))
        weights[DRY] = DRY_WEIGHT
    return Mix(files, weights, DRY if dry > 0 else None)


def length_sim_args(tok: Path, lengths: Sequence[float]) -> list[str]:
    """The simulator options giving a, b, c their length factors (none when all are 1: no tokenizer needed)."""
    if all(f == 1 for f in lengths):
        return []
    out = ["--tokenizer", str(tok), "--no-reasoning"]
    for name, f in zip(WEIGHTS, lengths, strict=True):
        out += ["--length-scale-by-text", f"{marker(name)}={f:g}"]
    return out


def final_report(m: Mix, used: dict[str, int], total: int, max_tokens: int) -> dict[str, Any]:
    """Each member's tokens against its share after the dry member's rest was shared again, and the total's bound."""
    going = {n: w for n, w in m.weights.items() if n != m.dry}
    rest = total - (used[m.dry] if m.dry is not None else 0)
    wsum = sum(going.values())
    shares = {n: int(rest * w // wsum) for n, w in going.items()}
    if m.dry is not None:
        shares[m.dry] = used[m.dry]
    bound = sum(predict_bound(shares[n], max_tokens) for n in going)
    got = sum(used.values())
    return {"final": {n: {"used": used[n], "share": shares[n], "over": used[n] - shares[n]} for n in m.files},
            "final_pp": round(deviation(used, going), 3), "total_used": got, "total_over": got - total,
            "bound": bound, "in_bound": 0 <= got - total <= bound}


def run_produce(stack: Stack, m: Mix, tok: Path, out: Path, args: argparse.Namespace, extra: Sequence[str] = (),
                trace: Trace | None = None) -> tuple[subprocess.CompletedProcess[str], Trace, float, float]:
    """One ``produce`` of mix ``m`` with the watcher running: (its result, the trace, wall start, wall end)."""
    trace = trace or Trace()
    stop = threading.Event()
    t = threading.Thread(target=watch, args=(stack, list(m.files), m.mix_id, m.dry, stop, trace), daemon=True)
    t.start()
    t0 = time.time()
    res = subprocess.run([*produce_cmd(), *m.argv(), "--tokenizer", str(tok), "--max-tokens", str(args.max_tokens),
                          "--budget", str(args.total), "--chunk-size", str(args.chunk_size), "--queue-depth", "4",
                          "--expect-mean", str(args.expect_mean or args.mean), "--out", str(out),
                          "--redis-url", stack.redis_url, "--quiet", *extra],
                         capture_output=True, text=True, timeout=args.timeout)
    t1 = time.time()
    stop.set()
    t.join(3)
    if res.returncode != 0:
        raise RuntimeError(f"produce failed ({res.returncode}): {res.stderr[-2000:]}")
    return res, trace, t0, t1


def one_run(stack: Stack, work: Path, tok: Path, base: Mix, prefix: str, pace: bool,
            args: argparse.Namespace) -> dict[str, Any]:
    m = base.named(prefix)
    _, trace, t0, t1 = run_produce(stack, m, tok, work / "out" / prefix, args,
                                   [] if pace else ["--no-mix-pacing"])
    r = stack.client()
    used = {n: int(r.get(DatasetKeys(n).used) or 0) for n in m.files}
    going = {n: w for n, w in m.weights.items() if n != m.dry}
    row: dict[str, Any] = {
        "run": prefix, "pacing": pace, "seconds": round(t1 - t0, 1), "samples": len(trace.samples),
        "worst_pp": {f"{a:.0%}": worst_deviation(trace.samples, going, args.total, a) for a in (0.05, 0.1, 0.25, 0.5)},
    }
    if m.dry is not None:
        row["dry_at_fraction"] = (None if trace.dry_at is None else round(
            next((sum(s.values()) for t, s in trace.samples if t >= trace.dry_at), sum(used.values())) / args.total, 3))
        row["worst_with_dry_pp"] = worst_deviation(trace.samples, m.weights, args.total, 0.05, trace.dry_at)
    row.update(final_report(m, used, args.total, args.max_tokens))
    return row


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the median and the worst of each figure over the seeds, and how many runs landed in the bound."""
    out: dict[str, Any] = {}
    for arm, pace in (("paced", True), ("unpaced", False)):
        rs = [r for r in rows if r["pacing"] == pace]
        if not rs:
            continue
        cell: dict[str, Any] = {"runs": len(rs), "in_bound": sum(r["in_bound"] for r in rs)}
        for a in ("5%", "50%"):
            xs = [r["worst_pp"][a] for r in rs if r["worst_pp"][a] is not None]
            cell[f"worst_after_{a}"] = {"median": round(statistics.median(xs), 2), "max": round(max(xs), 2)}
        cell["final_pp"] = {"median": round(statistics.median(r["final_pp"] for r in rs), 3),
                            "max": round(max(r["final_pp"] for r in rs), 3)}
        out[arm] = cell
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3", help="simulator seeds, one stack each (default %(default)s)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--total", type=int, default=400_000, help="the mix's total budget (default %(default)s)")
    ap.add_argument("--mean", type=float, default=300, help="the simulator's mean length, factor 1 (default %(default)s)")
    ap.add_argument("--lengths", default="1,1,1", help="a, b, c's mean length factors (default %(default)s)")
    ap.add_argument("--dry", type=int, default=0, metavar="N",
                    help="add dataset d (weight 1, factor 1) of only N prompts: it runs dry (default: none)")
    ap.add_argument("--expect-mean", type=float, default=None, help="produce --expect-mean (default: --mean)")
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--chunk-size", type=int, default=16)
    ap.add_argument("--time-scale", type=float, default=20)
    ap.add_argument("--arms", choices=("both", "paced", "unpaced"), default="both")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default="mix_proportion", help="results name under bench/results (default %(default)s)")
    args = ap.parse_args()
    lengths = [float(x) for x in args.lengths.split(",")]
    if len(lengths) != len(WEIGHTS):
        ap.error(f"--lengths: {len(WEIGHTS)} factors, one for each of {', '.join(WEIGHTS)}")
    arms = {"both": (True, False), "paced": (True,), "unpaced": (False,)}[args.arms]
    rows = []
    with scratch("mix-proportion") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        base = build_mix(work, args.dry)
        for seed in (int(s) for s in args.seeds.split(",")):
            sim = sim_args(mean=args.mean, per_request_tps=100, saturation=64, time_scale=args.time_scale, seed=seed,
                           extra=["--context-length", "65536", *length_sim_args(tok, lengths)])
            with Stack(work / f"stack{seed}", sim_args=sim, workers=args.workers,
                       worker_env={"BUDGETQ_CONCURRENCY": "16"}) as stack:
                stack.wait_for_workers()
                for pace in arms:  # interleaved: both arms see the same machine
                    row = one_run(stack, work, tok, base, f"s{seed}{'p' if pace else 'n'}", pace, args)
                    row["seed"] = seed
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = summarize(rows)
    print(json.dumps({"summary": summary}))
    save_results(args.out, {"args": vars(args), "runs": rows, "summary": summary})


if __name__ == "__main__":
    main()
