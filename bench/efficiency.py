"""Benchmark (1): throughput through budgetq vs a plain asyncio client, and the server's batch occupancy.

    python -m bench.efficiency            # ~4 minutes; results in bench/results/efficiency.json

Both sides drive the same simulated server (a fresh sglang-sim each, same seed: the n-th request gets the same
length on both) with the same request bodies and the same total number of requests in flight (256 = the
saturation batch): first the baseline (bench/client.py: one process, one aiohttp session, a semaphore),
then budgetq with default settings (attached ``produce`` with a budget it never reaches, so predict's
bookkeeping runs, and 4 ``rq worker -w worker.Worker`` at the default BUDGETQ_CONCURRENCY of 64).

Each side is measured over the same steady-state window (``--warm`` seconds after its first request, for
``--window`` seconds):
- generated tok/s: from the simulator's occupancy integral (tokens/s per request x mean decoding requests):
  exact, no edge effect from long requests finishing just after the window;
- completed tok/s: tokens of answers the client received (baseline) / budgetq committed (``used``) in the
  window;
- occupancy: mean running requests / saturation batch, and its lowest 1-second value in the window.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import (
    CpuMeter,
    SimProbe,
    fmt_cpu,
    percentile,
    save_results,
    scratch,
    sim_args,
    sim_stats_url,
    wait_first_request,
    window_rate,
)
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd, start_sim
from demo.synthetic import write_prompts


def render_bodies(tok: Path, data: Path) -> list[list[int]]:
    """The input_ids produce sends, rendered the same way (render/chat.py), for the baseline client."""
    from render.chat import Renderer, load_tokenizer
    renderer = Renderer(load_tokenizer(tok))
    conversations = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    ids = [r.input_ids for i in range(0, len(conversations), 256)
           for r in renderer.render_many(conversations[i:i + 256])]
    return ids


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def per_second_occupancy(samples: list[tuple[float, list[dict[str, Any] | None]]], t_a: float, t_b: float,
                         saturation: int) -> list[float]:
    pts = [(t, s[0]) for t, s in samples if s[0] is not None and t_a - 0.01 <= t <= t_b + 0.5]
    out = []
    for (_, a), (_, b) in zip(pts, pts[1:], strict=False):
        dt = b["uptime"] - a["uptime"]
        if dt > 0:
            out.append((b["running_integral"] - a["running_integral"]) / dt / saturation)
    return out


def measure(url: str, args: argparse.Namespace, pids: dict[str, int], used: Any = None) -> dict[str, Any]:
    """Wait for the first request, then take the window; ``used`` reads budgetq's committed tokens."""
    t_first = wait_first_request(url)
    probe = SimProbe([url], interval=1.0)
    sleep_until(t_first + args.warm)
    a = sim_stats_url(url)
    t_a = time.time()
    u_a = used() if used else None
    cpu = CpuMeter(pids)
    probe.start()
    sleep_until(t_first + args.warm + args.window)
    b = sim_stats_url(url)
    t_b = time.time()
    u_b = used() if used else None
    shares = cpu.stop()
    probe.stop()
    tps_wall = args.per_request_tps * args.time_scale
    w: dict[str, Any] = dict(window_rate(a, b, tps_wall, 256))
    occ = per_second_occupancy(probe.samples, t_a, t_b, 256)
    w.update({"t_first": t_first, "t_a": t_a, "t_b": t_b, "occupancy_min_1s": min(occ) if occ else None,
              "occupancy_p5_1s": percentile(occ, 0.05) if occ else None, "occupancy_series": occ, "cpu": shares,
              "submitted_by_window_end": b["submitted"]})
    if u_a is not None and u_b is not None:
        w["committed_tok_s"] = (u_b - u_a) / (t_b - t_a)
    return w


def run_baseline(args: argparse.Namespace, work: Path, bodies: Path, sim: list[str]) -> dict[str, Any]:
    sim_service, url = start_sim("sim-baseline", sim, work)
    proc = sim_service.proc
    out = work / "baseline-done.json"
    try:
        client = subprocess.Popen([sys.executable, "-m", "bench.client", "--url", url, "--bodies", str(bodies),
                                   "--in-flight", str(args.in_flight), "--duration",
                                   str(args.warm + args.window + 3), "--out", str(out)])
        try:
            w = measure(url, args, {"client": client.pid, "sim": proc.pid})
            client.wait(args.warm + args.window + 60)
        finally:
            if client.poll() is None:
                client.kill()
        res = json.loads(out.read_text())
        w["completed_tok_s_client"] = sum(n for t, n in res["done"] if w["t_a"] <= t < w["t_b"]) / (w["t_b"] - w["t_a"])
        w["errors"] = res["errors"]
        return w
    finally:
        proc.kill()
        proc.wait()


def run_budgetq(args: argparse.Namespace, work: Path, tok: Path, data: Path, sim: list[str]) -> dict[str, Any]:
    with Stack(work / "budgetq", sim_args=sim, workers=args.workers) as stack:
        r = stack.client()
        produce = subprocess.Popen([*produce_cmd(), f"prompts={data}", "--tokenizer", str(tok), "--max-tokens",
                                    str(args.max_tokens), "--budget", "1G", "--max-context", "65536",
                                    "--out", str(work / "out"), "--redis-url", stack.redis_url, "--quiet"],
                                   stdout=subprocess.DEVNULL, stderr=open(work / "produce.log", "wb"))
        try:
            pids = {**stack.pids(), "produce": produce.pid}
            w = measure(stack.sim_urls[0], args, pids, used=lambda: int(r.get(DatasetKeys("prompts").used) or 0))
            w["workers"] = args.workers
            w["concurrency_per_worker"] = args.in_flight // args.workers
            return w
        finally:
            produce.kill()
            produce.wait()
            stack.kill()


def table(base: dict[str, Any], bq: dict[str, Any]) -> str:
    rows = ["| figure | baseline (asyncio client) | budgetq | ratio |", "| --- | --- | --- | --- |"]
    rows.append(f"| generated tok/s (engine integral) | {base['generated_tok_s']:,.0f} | {bq['generated_tok_s']:,.0f} "
                f"| {bq['generated_tok_s'] / base['generated_tok_s']:.4f} |")
    rows.append(f"| completed tok/s (received / committed) | {base['completed_tok_s_client']:,.0f} | "
                f"{bq['committed_tok_s']:,.0f} | {bq['committed_tok_s'] / base['completed_tok_s_client']:.4f} |")
    rows.append(f"| occupancy: mean running / 256 | {base['occupancy']:.4f} | {bq['occupancy']:.4f} | |")
    rows.append(f"| occupancy: lowest 1-s value | {base['occupancy_min_1s']:.4f} | {bq['occupancy_min_1s']:.4f} | |")
    rows.append(f"| CPU share (cores) | {fmt_cpu(base['cpu'])} | {fmt_cpu(bq['cpu'])} | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mean", type=float, default=3800)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--per-request-tps", type=float, default=30.0)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--warm", type=float, default=20.0, help="seconds after the first request before the window")
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    sim = sim_args(mean=args.mean, sigma=args.sigma, per_request_tps=args.per_request_tps,
                   time_scale=args.time_scale, seed=args.seed)
    # Enough prompts that neither side runs dry before the window ends.
    tok_s = 256 * args.per_request_tps * args.time_scale
    n_prompts = int(tok_s * (args.warm + args.window + 10) / args.mean * 1.5) + 2 * args.in_flight
    with scratch("efficiency") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = write_prompts(work / "prompts.jsonl", n_prompts)
        bodies = work / "bodies.json"
        bodies.write_text(json.dumps({"input_ids": render_bodies(tok, data),
                                      "sampling_params": {"max_new_tokens": args.max_tokens}}))
        base = run_baseline(args, work, bodies, sim)
        print("baseline", json.dumps({k: v for k, v in base.items() if k != "occupancy_series"}), flush=True)
        bq = run_budgetq(args, work, tok, data, sim)
        print("budgetq", json.dumps({k: v for k, v in bq.items() if k != "occupancy_series"}), flush=True)
    result = {"args": vars(args), "prompts": n_prompts, "baseline": base, "budgetq": bq,
              "ratio_generated": bq["generated_tok_s"] / base["generated_tok_s"],
              "ratio_completed": bq["committed_tok_s"] / base["completed_tok_s_client"]}
    save_results("efficiency", result)
    print(table(base, bq))


if __name__ == "__main__":
    main()
