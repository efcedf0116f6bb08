"""Benchmark (2): two servers of different speeds behind one SGLANG_URL list; one killed mid-run; a router.

    python -m bench.servers               # ~3 minutes; results in bench/results/servers.json

Workload: the reference one (docs/performance.md: lognormal, mean 3.8K, sigma 0.8, max_new_tokens 16K), every prompt of the dataset
sharing one long system prompt. Servers: sim0 at 1x (30 tok/s per request), sim1 at 0.5x (15 tok/s per
request), each with a 256-request saturation batch, so the sum of their ceilings is 256 x (30 + 15) simulated
tok/s. budgetq: 4 workers with BUDGETQ_CONCURRENCY=128 (512 in flight = both batches: fewer could not fill
both), SGLANG_URL listing both; an attached ``produce``.

Phases, all in one command:
1. throughput: over a steady-state window, tokens/s each server generated (occupancy integral x its
   per-request rate) summed, / the sum of the ceilings; also what budgetq committed; cached_tokens share.
2. failover: right after the window one server is killed (SIGKILL, ``--kill slow|fast``); the run goes on
   to the end on the other. Checked: produce exits 0, every prompt is in raw_responses.jsonl exactly once,
   nothing failed, Redis counts exactly the tokens on disk; reported: requests that were running on the dead
   server (GPU work redone once), failed attempts by kind, retries per sample.
   ``--revive-after`` seconds after the kill the server is started again on the same port: a recovered
   server should get requests again (worker/sglang.py's breaker says within 30 s).
3. router: one SGLANG_URL pointing at SGLang's real router (SGLang Model Gateway, sglang-router 0.3.2's
   ``smg launch``, demo/smg.py, with docs/deployment.md's settings) in front of the same two servers, once per
   policy (``--policies``, default cache_aware, round_robin, power_of_two): the same throughput figure over a
   shorter window, and the cached_tokens share of each server, against phase 1's budgetq dispatch to the list.
   The stand-in least-connections router (bench/router.py) serves only when sglang-router is not installed
   (``--policies stand-in`` asks for it).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import CpuMeter, fmt_cpu, save_results, scratch, sim_args, sim_stats_url, window_rate
from budget.keys import DatasetKeys
from demo.stack import Stack, produce_cmd, spawn_sim
from demo.synthetic import write_prompts

SPEEDS = (1.0, 0.5)

# A long system prompt shared by every prompt of the dataset (about 5K tokens with the demo tokenizer).
SYSTEM = " ".join(
    f"Rule {i}: when the user asks about topic {i}, first restate the question, then list the assumptions you make, "
    f"then answer step by step, and finish with a one-line summary; never invent facts about item {i * 7 % 101}."
    for i in range(60))


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def measure(urls: list[str], args: argparse.Namespace, pids: dict[str, int], used: Any, warm: float,
            window: float) -> dict[str, Any]:
    deadline = time.monotonic() + 180
    while not any(sim_stats_url(u)["submitted"] for u in urls):
        if time.monotonic() > deadline:
            raise RuntimeError("no request reached a simulator")
        time.sleep(0.05)
    t_first = time.time()
    sleep_until(t_first + warm)
    a = [sim_stats_url(u) for u in urls]
    u_a, t_a = used(), time.time()
    cpu = CpuMeter(pids)
    sleep_until(t_first + warm + window)
    b = [sim_stats_url(u) for u in urls]
    u_b, t_b = used(), time.time()
    shares = cpu.stop()
    per = [window_rate(x, y, args.per_request_tps * s * args.time_scale, 256) for x, y, s in zip(a, b, SPEEDS, strict=True)]
    ceiling = sum(256 * args.per_request_tps * s * args.time_scale for s in SPEEDS)
    generated = sum(p["generated_tok_s"] for p in per)
    return {"per_server": per, "generated_tok_s": generated, "ceiling_tok_s": ceiling,
            "ratio": generated / ceiling, "committed_tok_s": (u_b - u_a) / (t_b - t_a),
            "committed_ratio": (u_b - u_a) / (t_b - t_a) / ceiling, "cpu": shares,
            "cached_share": [y["cached_tokens_total"] / max(1, y["prompt_tokens_total"]) for y in b],
            "prompt_tokens": [y["prompt_tokens_total"] for y in b]}


def start_produce(stack: Stack, work: Path, tok: Path, data: Path, args: argparse.Namespace,
                  name: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*produce_cmd(), f"prompts={data}", "--tokenizer", str(tok), "--max-tokens",
                             str(args.max_tokens), "--budget", "1G", "--max-context", "65536", "--out",
                             str(work / f"out-{name}"), "--redis-url", stack.redis_url],
                            stdout=open(work / f"produce-{name}.out", "wb"),
                            stderr=open(work / f"produce-{name}.log", "wb"))


FAIL_RE = re.compile(r"prompts/(\S+) attempt (\d+) failed \((\w+)[^)]*? from (http://[\d.]+:\d+)")


def verify(stack: Stack, work: Path, n_prompts: int, name: str) -> dict[str, Any]:
    out = work / f"out-{name}" / "prompts"
    lines = (out / "raw_responses.jsonl").read_text().splitlines()
    ids = [json.loads(x)["id"] for x in lines]
    tokens = sum(json.loads(x)["completion_tokens"] for x in lines)
    failed = (out / "failed.jsonl").read_text().splitlines() if (out / "failed.jsonl").exists() else []
    r = stack.client()
    keys = DatasetKeys("prompts")
    return {"lines": len(lines), "unique_ids": len(set(ids)), "prompts": n_prompts,
            "duplicates": len(ids) - len(set(ids)), "failed": len(failed),
            "redis_done": int(r.hlen(keys.done)), "redis_used": int(r.get(keys.used) or 0),
            "tokens_on_disk": tokens, "ok": len(lines) == len(set(ids)) == n_prompts and not failed
            and int(r.get(keys.used) or 0) == tokens}


def worker_failures(work: Path, dead_url: str) -> dict[str, Any]:
    kinds: collections.Counter[str] = collections.Counter()
    per_sample: collections.Counter[str] = collections.Counter()
    for log in work.glob("w*.log"):
        for m in FAIL_RE.finditer(log.read_text(errors="replace")):
            sid, _attempt, kind, url = m.groups()
            kinds[f"{kind} from {'dead' if url == dead_url else 'live'} server"] += 1
            per_sample[sid] += 1
    return {"failed_attempts_by_kind": dict(kinds), "samples_with_a_failed_attempt": len(per_sample),
            "samples_by_failed_attempts": dict(collections.Counter(per_sample.values()))}


def phase_lists(args: argparse.Namespace, work: Path, tok: Path, data: Path, n_prompts: int) -> dict[str, Any]:
    sims = [sim_args(per_request_tps=args.per_request_tps * s, time_scale=args.time_scale, seed=args.seed + i)
            for i, s in enumerate(SPEEDS)]
    env = {"BUDGETQ_CONCURRENCY": str(args.in_flight // args.workers)}
    with Stack(work / "lists", sim_args_each=sims, workers=args.workers, worker_env=env) as stack:
        r = stack.client()
        produce = start_produce(stack, work / "lists", tok, data, args, "lists")
        try:
            used = lambda: int(r.get(DatasetKeys("prompts").used) or 0)  # noqa: E731
            thr = measure(stack.sim_urls, args, {**stack.pids(), "produce": produce.pid}, used, args.warm,
                          args.window)
            print("throughput", json.dumps(thr), flush=True)
            victim = 1 if args.kill == "slow" else 0
            before = sim_stats_url(stack.sim_urls[victim])
            committed_before = int(r.hget(DatasetKeys("prompts").meta, "committed") or 0)
            stack.sims[victim].kill()
            t_kill = time.time()
            revived = None
            if args.revive_after > 0:
                # The same server back on the same port: do the workers find it again?
                try:
                    rc = produce.wait(args.revive_after)
                except subprocess.TimeoutExpired:
                    port = int(stack.sim_urls[victim].rsplit(":", 1)[1])
                    revived = spawn_sim(f"sim{victim}-revived", sims[victim], stack.workdir, port=port)[0].proc
                    stack.procs.append(revived)
                    t_revive = time.time()
            try:
                rc = produce.wait(args.timeout)
            except subprocess.TimeoutExpired:
                produce.kill()
                raise RuntimeError("produce did not finish after the server was killed") from None
            t_end = time.time()
            revival = None
            if revived is not None:
                st = sim_stats_url(stack.sim_urls[victim])
                revival = {"revived_after_s": t_revive - t_kill, "watched_s": t_end - t_revive,
                           "requests_it_received": st["submitted"]}
            survivor = sim_stats_url(stack.sim_urls[1 - victim])
            check = verify(stack, work / "lists", n_prompts, "lists")
            fails = worker_failures(work / "lists", stack.sim_urls[victim])
            failover = {"killed": f"sim{victim} ({SPEEDS[victim]}x)", "produce_exit": rc,
                        "committed_before_kill": committed_before,
                        "running_on_dead_server_at_kill": before["running"],
                        "queued_on_dead_server_at_kill": before["queued"],
                        "completed_by_dead_server": before["completed"],
                        "completed_by_survivor": survivor["completed"],
                        "requests_completed_total": before["completed"] + survivor["completed"],
                        "seconds_kill_to_end": t_end - t_kill, **fails, "check": check, "revival": revival}
            print("failover", json.dumps(failover), flush=True)
            return {"throughput": thr, "failover": failover}
        finally:
            if produce.poll() is None:
                produce.kill()
            stack.kill()


class _StandIn:
    """bench/router.py, the least-connections stand-in, for machines without sglang-router."""

    def __init__(self, urls: list[str]) -> None:
        argv = [sys.executable, "-m", "bench.router", "--port", "0"]
        for u in urls:
            argv += ["--backend", u]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        self.url = line.strip().rsplit(" ", 1)[-1]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def phase_router(args: argparse.Namespace, work: Path, tok: Path, data: Path, policy: str) -> dict[str, Any]:
    sims = [sim_args(per_request_tps=args.per_request_tps * s, time_scale=args.time_scale, seed=args.seed + i)
            for i, s in enumerate(SPEEDS)]
    where = work / f"router-{policy}"
    with Stack(where, sim_args_each=sims, workers=0) as stack:
        router: Any
        if policy == "stand-in":
            router = _StandIn(stack.sim_urls)
        else:
            from demo.smg import Router
            router = Router(stack.sim_urls, where, policy=policy).start()
        try:
            env = {"BUDGETQ_CONCURRENCY": str(args.in_flight // args.workers), "SGLANG_URL": router.url}
            for i in range(args.workers):
                stack.start_worker(f"w{i}", env=env)
            r = stack.client()
            produce = start_produce(stack, where, tok, data, args, "router")
            try:
                used = lambda: int(r.get(DatasetKeys("prompts").used) or 0)  # noqa: E731
                assert router.proc is not None
                pids = {**stack.pids(), "produce": produce.pid, "router": router.proc.pid}
                res = measure(stack.sim_urls, args, pids, used, args.router_warm, args.router_window)
                res["sglang_url"] = router.url
                res["policy"] = policy
                res["requests_per_server"] = [sim_stats_url(u)["submitted"] for u in stack.sim_urls]
                print("router", json.dumps(res), flush=True)
                return res
            finally:
                produce.kill()
        finally:
            router.stop()
            stack.kill()


def default_policies() -> list[str]:
    try:
        from demo.smg import POLICIES, smg_command
        smg_command()
    except RuntimeError as exc:
        print(f"sglang-router is not usable here ({exc}): the stand-in router serves figure 2's router rows",
              file=sys.stderr)
        return ["stand-in"]
    return list(POLICIES)


def table(res: dict[str, Any]) -> str:
    thr, fo, routers = res["lists"]["throughput"], res["lists"]["failover"], res.get("routers") or []
    rows = ["| figure | ceiling (sum of both) | budgetq | ratio | CPU share (cores) |",
            "| --- | --- | --- | --- | --- |"]
    rows.append(f"| 2 servers (1x + 0.5x), SGLANG_URL list: generated tok/s | {thr['ceiling_tok_s']:,.0f} | "
                f"{thr['generated_tok_s']:,.0f} | {thr['ratio']:.4f} | {fmt_cpu(thr['cpu'])} |")
    rows.append(f"| same window: committed tok/s | {thr['ceiling_tok_s']:,.0f} | {thr['committed_tok_s']:,.0f} | "
                f"{thr['committed_ratio']:.4f} | |")
    occ = ", ".join(f"sim{i} {p['occupancy']:.3f}" for i, p in enumerate(thr["per_server"]))
    rows.append(f"| occupancy (mean running / 256) | 1 | {occ} | | |")
    rows.append(f"| cached_tokens / prompt_tokens | | {', '.join(f'{x:.3f}' for x in thr['cached_share'])} | | |")
    for rt in routers:
        name = "stand-in least-connections router" if rt["policy"] == "stand-in" else f"smg --policy {rt['policy']}"
        rows.append(f"| 1 SGLANG_URL -> {name} -> 2 servers: generated tok/s | {rt['ceiling_tok_s']:,.0f} | "
                    f"{rt['generated_tok_s']:,.0f} | {rt['ratio']:.4f} | {fmt_cpu(rt['cpu'])} |")
        occ = ", ".join(f"sim{i} {p['occupancy']:.3f}" for i, p in enumerate(rt["per_server"]))
        rows.append(f"| same: occupancy / cached_tokens share / requests per server | | {occ} / "
                    f"{', '.join(f'{x:.3f}' for x in rt['cached_share'])} / {rt['requests_per_server']} | | |")
    c = fo["check"]
    rows.append(f"| failover: {fo['killed']} killed | {c['prompts']} prompts | {c['unique_ids']} unique in output, "
                f"{c['duplicates']} duplicates, {c['failed']} failed, Redis used == tokens on disk: "
                f"{c['redis_used'] == c['tokens_on_disk']} | {'ok' if c['ok'] else 'FAILED'} | |")
    rows.append(f"| failover: GPU work redone | | {fo['running_on_dead_server_at_kill']} running + "
                f"{fo['queued_on_dead_server_at_kill']} queued on the dead server; failed attempts per sample: "
                f"{fo['samples_by_failed_attempts']} | | |")
    rv = fo.get("revival")
    if rv:
        rows.append(f"| failover: killed server restarted on its port {rv['revived_after_s']:.0f} s later | > 0 "
                    f"requests | {rv['requests_it_received']} requests in the {rv['watched_s']:.0f} s until the run "
                    f"ended | {'ok' if rv['requests_it_received'] else 'NOT FOUND AGAIN'} | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--in-flight", type=int, default=512)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--per-request-tps", type=float, default=30.0)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--warm", type=float, default=20.0)
    ap.add_argument("--window", type=float, default=40.0)
    ap.add_argument("--router-warm", type=float, default=15.0)
    ap.add_argument("--router-window", type=float, default=20.0)
    ap.add_argument("--kill", choices=["slow", "fast"], default="slow")
    ap.add_argument("--no-router", action="store_true")
    ap.add_argument("--policies", nargs="+", default=None,
                    choices=["cache_aware", "round_robin", "power_of_two", "stand-in"],
                    help="router phases to run (default: each smg policy; the stand-in without sglang-router)")
    ap.add_argument("--revive-after", type=float, default=5.0,
                    help="restart the killed server on its port after this many seconds (0: never)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    rate = 256 * args.per_request_tps * sum(SPEEDS) * args.time_scale / 3800  # requests/s at the ceiling
    n_prompts = int(rate * (args.warm + args.window) * 1.1) + args.in_flight + 300
    n_router = int(rate * (args.router_warm + args.router_window) * 1.3) + args.in_flight
    with scratch("servers") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = write_prompts(work / "prompts.jsonl", n_prompts, system=SYSTEM)
        res: dict[str, Any] = {"args": vars(args), "prompts": n_prompts}
        res["lists"] = phase_lists(args, work, tok, data, n_prompts)
        if not args.no_router:
            data_r = write_prompts(work / "prompts-router.jsonl", n_router, system=SYSTEM)
            res["routers"] = [phase_router(args, work, tok, data_r, policy)
                              for policy in (args.policies or default_policies())]
    save_results("servers", res)
    print(table(res))


if __name__ == "__main__":
    main()
