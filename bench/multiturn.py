"""Multi-turn benchmarks (issue 14, docs/multiturn.md): efficiency and prefix-cache affinity of ``--turns all``.

    python -m bench.multiturn efficiency   # ~5 minutes; bench/results/multiturn_efficiency.json
    python -m bench.multiturn affinity     # ~2 minutes; bench/results/multiturn_affinity.json

Dataset: 3-turn conversations (system, u1, a1, u2, a2, u3), the assistant turns made-up text that is never sent
(``--turns all`` regenerates every turn on the model's own answers), rendered with the demo tokenizer
(demo/tokenizer.py, no thinking: reasoning parser ``none``).

**efficiency** (figure 1's workload, bench/efficiency.py: lognormal lengths of mean 3.8K, sigma 0.8,
max_new_tokens 16K, 30 tok/s per request, a 256-request saturation batch; time scale 10, not 20: the simulator
tokenizes here, see ``--time-scale``). The simulator answers with
the demo tokenizer's real ids (``--tokenizer``), so an answer re-rendered into the next prompt is about as long as
it was generated (pseudo-word ids would grow ~5x once re-tokenized). Both sides drive a fresh simulator with the
same seed and 256 requests in flight: first the baseline (bench/multiturn_client.py: one asyncio process, 256
conversations carried at once, each turn rendered with render/chat.py over the model's parsed answers), then
budgetq (an attached ``produce --turns all`` with a budget it never reaches, 4 ``rq worker`` at the default
BUDGETQ_CONCURRENCY of 64). Each side is measured as bench/efficiency.py measures (its ``measure``): generated
tok/s from the simulator's occupancy integral, completed tok/s (answers received / tokens committed), occupancy
over a window ``--warm`` seconds after the first request (later, as a conversation's turns take ~3 answers to
reach their steady mix).

**affinity** (figure 2's multi-turn row, bench/affinity.py): two simulators with their prefix cache on, 2 workers x
16 in flight, short answers (the figure is about prompts), a long first user turn of its own per conversation
(~1.5K tokens), an attached ``produce --turns all`` to the end. Once with the worker's affinity on (turn i+1 to
turn i's server while it is not much busier, worker/sglang.py ``pick_server``), once with BUDGETQ_AFFINITY=0
(least in flight only). Figures: Σ cached_tokens / Σ prompt_tokens over both servers; the share *cacheable at
all*: every prompt page an earlier answered prompt holds, in one unbounded cache (replayed from the simulators'
request log, sglang-sim ``--request-log``, in the order answered); the share of later turns sent to their
previous turn's server; and, from the same log, how many later prompts hold the answer the server gave the turn
before and how many any of the dataset's answers (0).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.efficiency import measure
from bench.harness import fmt_cpu, save_results, scratch, sim_args, sim_stats_url
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd, start_sim
from demo.synthetic import CONVERSATIONS_PARSER, DATASET_MARK, write_conversations

PARSER = CONVERSATIONS_PARSER  # bench/budget_modes.py reads it here
DATASET = "convs"
#: Seconds the baseline client runs past the window's planned end: on a loaded machine the window's last snapshot
#: comes seconds late (64 s instead of 60 once), and a client that stopped before it shows a false idle tail.
DURATION_MARGIN = 15.0


def produce_argv(data: Path, tok: Path, out: Path, redis_url: str, max_tokens: int, extra: list[str]) -> list[str]:
    return [*produce_cmd(), f"{DATASET}={data}", "--tokenizer", str(tok), "--turns", "all", "--reasoning-parser",
            PARSER, "--max-tokens", str(max_tokens), "--max-context", "65536", "--out", str(out), "--redis-url",
            redis_url, *extra]


# -- bench 1: efficiency --------------------------------------------------------------------------------------


def run_baseline(args: argparse.Namespace, work: Path, tok: Path, data: Path, sim: list[str]) -> dict[str, Any]:
    sim_service, url = start_sim("sim-baseline", sim, work)
    proc = sim_service.proc
    out = work / "baseline-done.json"
    try:
        client = subprocess.Popen([sys.executable, "-m", "bench.multiturn_client", "--url", url, "--data", str(data),
                                   "--tokenizer", str(tok), "--reasoning-parser", PARSER, "--max-tokens",
                                   str(args.max_tokens), "--max-context", "65536", "--in-flight",
                                   str(args.in_flight), "--duration", str(args.warm + args.window + DURATION_MARGIN),
                                   "--out", str(out)])
        try:
            w = measure(url, args, {"client": client.pid, "sim": proc.pid})
            w["loadavg_1_5_15"] = os.getloadavg()  # the machine is shared: how loaded it was at the window's end
            client.wait(args.warm + args.window + DURATION_MARGIN + 60)
        finally:
            if client.poll() is None:
                client.kill()
        res = json.loads(out.read_text())
        w["completed_tok_s_client"] = sum(n for t, n, _ in res["done"] if w["t_a"] <= t < w["t_b"]) / (w["t_b"] - w["t_a"])
        w["turns_in_window"] = dict(collections.Counter(i for t, _, i in res["done"] if w["t_a"] <= t < w["t_b"]))
        w["errors"] = res["errors"]
        w["ended"] = res["ended"]
        w["conversations_started"] = res["conversations_started"]
        return w
    finally:
        proc.kill()
        proc.wait()


def run_budgetq(args: argparse.Namespace, work: Path, tok: Path, data: Path, sim: list[str]) -> dict[str, Any]:
    with Stack(work / "budgetq", sim_args=sim, workers=args.workers) as stack:
        r = stack.client()
        produce = subprocess.Popen(produce_argv(data, tok, work / "out", stack.redis_url, args.max_tokens,
                                                ["--budget", "1G", "--quiet"]),
                                   stdout=subprocess.DEVNULL, stderr=open(work / "produce.log", "wb"))
        try:
            pids = {**stack.pids(), "produce": produce.pid}
            w = measure(stack.sim_urls[0], args, pids, used=lambda: int(r.get(DatasetKeys(DATASET).used) or 0))
            w["loadavg_1_5_15"] = os.getloadavg()
            w["workers"] = args.workers
            w["concurrency_per_worker"] = args.in_flight // args.workers
            stats: dict[bytes, bytes] = r.hgetall(DatasetKeys(DATASET).stats)  # type: ignore[assignment]
            w["stats"] = {k.decode(): v.decode() for k, v in stats.items()}
            if produce.poll() is not None:
                w["produce_exit"] = produce.returncode
            return w
        finally:
            produce.kill()
            produce.wait()
            stack.kill()


def efficiency_table(base: dict[str, Any], bq: dict[str, Any]) -> str:
    rows = ["| figure | baseline (asyncio client) | budgetq | ratio |", "| --- | --- | --- | --- |"]
    rows.append(f"| generated tok/s (engine integral) | {base['generated_tok_s']:,.0f} | {bq['generated_tok_s']:,.0f} "
                f"| **{bq['generated_tok_s'] / base['generated_tok_s']:.4f}** |")
    rows.append(f"| completed tok/s (received / committed) | {base['completed_tok_s_client']:,.0f} | "
                f"{bq['committed_tok_s']:,.0f} | {bq['committed_tok_s'] / base['completed_tok_s_client']:.4f} |")
    rows.append(f"| occupancy: mean running / 256 | {base['occupancy']:.4f} | **{bq['occupancy']:.4f}** | |")
    rows.append(f"| occupancy: lowest 1-s value | {base['occupancy_min_1s']:.4f} | {bq['occupancy_min_1s']:.4f} | |")
    rows.append(f"| CPU share (cores) | {fmt_cpu(base['cpu'])} | {fmt_cpu(bq['cpu'])} | |")
    rows.append(f"| load average at the window's end (1, 5, 15 min) | "
                f"{', '.join(f'{x:.2f}' for x in base['loadavg_1_5_15'])} | "
                f"{', '.join(f'{x:.2f}' for x in bq['loadavg_1_5_15'])} | |")
    return "\n".join(rows)


def efficiency(args: argparse.Namespace) -> None:
    conv_seconds = 3 * args.mean / (args.per_request_tps * args.time_scale)
    n = int(args.in_flight * (args.warm + args.window + 10) / conv_seconds * 1.5) + args.in_flight
    with scratch("multiturn") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        sim = sim_args(mean=args.mean, sigma=args.sigma, per_request_tps=args.per_request_tps,
                       time_scale=args.time_scale, seed=args.seed,
                       extra=["--tokenizer", str(tok), "--no-reasoning", "--context-length", "131072"])
        data = write_conversations(work / "convs.jsonl", n)
        base = run_baseline(args, work, tok, data, sim)
        print("baseline", json.dumps({k: v for k, v in base.items() if k != "occupancy_series"}), flush=True)
        bq = run_budgetq(args, work, tok, data, sim)
        print("budgetq", json.dumps({k: v for k, v in bq.items() if k != "occupancy_series"}), flush=True)
    result = {"args": vars(args), "conversations": n, "baseline": base, "budgetq": bq,
              "ratio_generated": bq["generated_tok_s"] / base["generated_tok_s"],
              "ratio_completed": bq["committed_tok_s"] / base["completed_tok_s_client"]}
    save_results("multiturn_efficiency", result)
    print(efficiency_table(base, bq))


# -- bench 2: prefix-cache affinity ---------------------------------------------------------------------------


def replay_log(path: Path, conversations: int, page: int, tok: Path) -> dict[str, Any]:
    """From the simulators' request log: the share of prompt tokens one unbounded cache would have held (every
    page of an earlier answered prompt), how many later turns went to their previous turn's server, and the
    history check from the server's side: how many later turns' prompts (decoded) hold the answer the server gave
    to the turn before, and how many hold any of the dataset's answers (must be 0)."""
    from tokenizers import Tokenizer

    from budget import keys
    from budget.record import request_id
    from sglang_sim.prefix_cache import PrefixCache
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    cache = PrefixCache(page, 1 << 40)
    prompt = cacheable = 0
    answer_of: dict[str, dict[str, Any]] = {}  # the last answer to each turn's requests
    for line in lines:
        ids = line["input_ids"]
        prompt += len(ids)
        cacheable += cache.match_and_insert(ids)
        answer_of[line["rid"][:28]] = line
    decoder = Tokenizer.from_file(str(tok / "tokenizer.json"))
    same = later = carries = dataset_answers = 0
    for c in range(conversations):
        sid = f"c{c:05d}"
        answers = [answer_of.get(request_id(DATASET, sid if t == 0 else keys.turn_field(sid, t), 0)[:28])
                   for t in range(3)]
        for a, b in zip(answers, answers[1:], strict=False):
            if a is not None and b is not None:
                later += 1
                same += a["port"] == b["port"]
                text = decoder.decode(b["input_ids"], skip_special_tokens=False)
                carries += a["text"].strip() in text
                dataset_answers += DATASET_MARK in text
    return {"requests": len(lines), "prompt_tokens_logged": prompt, "cacheable_share": cacheable / max(1, prompt),
            "later_turns": later, "same_server_share": same / max(1, later),
            "later_prompts_with_previous_answer": carries, "later_prompts_with_a_dataset_answer": dataset_answers}


def affinity_run(mode: str, args: argparse.Namespace, work: Path, tok: Path, data: Path) -> dict[str, Any]:
    where = work / mode.replace(" ", "-")
    where.mkdir(parents=True)
    log = where / "requests.jsonl"
    sims = [sim_args(mean=args.mean_tokens, per_request_tps=args.per_request_tps, time_scale=args.time_scale,
                     seed=args.seed + i, extra=["--request-log", str(log)]) for i in range(2)]
    with Stack(where, sim_args_each=sims, workers=0) as stack:
        try:
            env = {"BUDGETQ_CONCURRENCY": str(args.concurrency), "BUDGETQ_AFFINITY": "1" if mode == "on" else "0"}
            for i in range(2):
                stack.start_worker(f"w{i}", env=env)
            res = subprocess.run(produce_argv(data, tok, where / "out", stack.redis_url, args.max_tokens,
                                              ["--chunk-size", str(args.chunk_size)]),
                                 capture_output=True, text=True, timeout=args.timeout)
            if res.returncode != 0:
                raise RuntimeError(f"affinity {mode}: produce exited {res.returncode}: {res.stderr[-2000:]}")
            records = [json.loads(x) for x in (where / "out" / DATASET / "raw_responses.jsonl").read_text().splitlines()]
            stats = [sim_stats_url(u) for u in stack.sim_urls]
        finally:
            stack.kill()
    prompt = sum(s["prompt_tokens_total"] for s in stats)
    cached = sum(s["cached_tokens_total"] for s in stats)
    out = {"mode": mode, "records": len(records), "turns": sum(len(r.get("turns") or []) for r in records),
           "prompt_tokens": prompt, "cached_tokens": cached, "cached_share": cached / max(1, prompt),
           "requests_per_server": [s["completed"] for s in stats],
           **replay_log(log, args.conversations, 16, tok)}
    print("affinity", json.dumps(out), flush=True)
    return out


def affinity_table(rows: list[dict[str, Any]]) -> str:
    out = ["| affinity | conversations on disk (turns) | requests per server | later turns on their previous "
           "turn's server | cached_tokens / prompt_tokens | cacheable at all | later prompts holding the previous "
           "answer / a dataset answer |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['records']} ({r['turns']}) | {r['requests_per_server']} | "
                   f"{r['same_server_share']:.3f} | **{r['cached_share']:.3f}** | {r['cacheable_share']:.3f} | "
                   f"{r['later_prompts_with_previous_answer']} of {r['later_turns']} / "
                   f"{r['later_prompts_with_a_dataset_answer']} |")
    return "\n".join(out)


def affinity(args: argparse.Namespace) -> None:
    with scratch("multiturn-affinity") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = write_conversations(work / "convs.jsonl", args.conversations, context_words=700)
        rows = [affinity_run(mode, args, work, tok, data) for mode in args.modes]
    save_results("multiturn_affinity", {"args": vars(args), "rows": rows})
    print(affinity_table(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="bench", required=True)
    e = sub.add_parser("efficiency", help="bench 1: tok/s and occupancy against a plain asyncio client")
    e.add_argument("--mean", type=float, default=3800)
    e.add_argument("--sigma", type=float, default=0.8)
    e.add_argument("--max-tokens", type=int, default=16384)
    e.add_argument("--in-flight", type=int, default=256)
    e.add_argument("--workers", type=int, default=4)
    e.add_argument("--per-request-tps", type=float, default=30.0)
    # 10, not figure 1's 20: with --tokenizer the simulator tokenizes every answer and decodes every prompt (~13 ms a
    # request for 3-turn prompts), and at 20 it starved on the shared 2-core machine (a 5-s /sim/stats timeout).
    e.add_argument("--time-scale", type=float, default=10.0)
    e.add_argument("--warm", type=float, default=50.0, help="seconds after the first request before the window "
                   "(500 simulated s: more than one 3-turn conversation, so the turns are in their steady mix)")
    e.add_argument("--window", type=float, default=60.0)
    e.add_argument("--seed", type=int, default=1)
    a = sub.add_parser("affinity", help="bench 2: cached_tokens share on two servers, affinity on and off")
    a.add_argument("--conversations", type=int, default=120)
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--mean-tokens", type=float, default=40.0)
    a.add_argument("--per-request-tps", type=float, default=30.0)
    a.add_argument("--time-scale", type=float, default=20.0)
    a.add_argument("--concurrency", type=int, default=16)
    a.add_argument("--chunk-size", type=int, default=16)
    a.add_argument("--modes", nargs="+", default=["on", "off"], choices=["on", "off"])
    a.add_argument("--seed", type=int, default=1)
    a.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    if args.bench == "efficiency":
        efficiency(args)
    else:
        affinity(args)


if __name__ == "__main__":
    main()
