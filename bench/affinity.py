"""Multi-turn affinity: how much of the prompt the servers find cached, by how requests reach them.

    python -m bench.affinity              # ~2 minutes; results in bench/results/affinity.json

Dataset: C conversations (default 60) of T user turns (default 5). The first user turn of each is long
(~1.5K tokens) and its own; sample k of a conversation holds its first k turns (user, assistant, ..., user),
as agent traces regenerated turn by turn are. So every sample of a conversation shares that conversation's
prefix with the others, and no prefix is shared across conversations (no common system prompt).
Samples are in file order, conversation after conversation, so a chunk holds the turns of a few.

Two simulators of the same speed with their prefix cache on; 2 workers x 16 in flight; an attached
``produce`` on the whole dataset (short answers: the figure is about prompts). Dispatch:
- ``list``: SGLANG_URL lists both servers (budgetq's least-in-flight dispatch);
- ``cache_aware``, ``round_robin``: one SGLANG_URL, SGLang's real router (demo/smg.py) in front of both;
- ``one server``: SGLANG_URL is one server: the most any dispatch could find cached.
Figure: sum of cached_tokens / sum of prompt_tokens over both servers. Counts, so not CPU-sensitive.
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

from bench.harness import save_results, scratch, sim_args, sim_stats_url
from demo.stack import Stack, produce_cmd

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud field metal "
         "paper glass light sound water").split()


def write_conversations(path: Path, conversations: int, turns: int) -> int:
    n = 0
    with open(path, "w") as fh:
        for c in range(conversations):
            first = " ".join(f"{WORDS[(c * 7 + i * 3) % len(WORDS)]}{(c * 31 + i) % 1000}" for i in range(700))
            messages: list[dict[str, str]] = [{"role": "user", "content": f"Conversation {c}. Context: {first}"}]
            for t in range(turns):
                fh.write(json.dumps({"id": f"c{c:03d}-t{t}", "messages": messages}) + "\n")
                n += 1
                messages = messages + [
                    {"role": "assistant", "content": f"Answer {t} of conversation {c}: " + " ".join(
                        f"{WORDS[(c + t + i) % len(WORDS)]}" for i in range(60))},
                    {"role": "user", "content": f"Follow-up {t + 1}: go on with point {t + 1}."}]
    return n


def run(mode: str, args: argparse.Namespace, work: Path, tok: Path, data: Path, n: int) -> dict[str, Any]:
    where = work / mode.replace(" ", "-")
    sims = [sim_args(mean=args.mean_tokens, per_request_tps=args.per_request_tps, time_scale=args.time_scale,
                     seed=args.seed + i) for i in range(2)]
    with Stack(where, sim_args_each=sims, workers=0) as stack:
        router = None
        if mode in ("cache_aware", "round_robin"):
            from demo.smg import Router
            router = Router(stack.sim_urls, where, policy=mode).start()
            url = router.url
        elif mode == "one server":
            url = stack.sim_urls[0]
        else:
            url = ",".join(stack.sim_urls)
        try:
            env = {"BUDGETQ_CONCURRENCY": str(args.concurrency), "SGLANG_URL": url}
            for i in range(2):
                stack.start_worker(f"w{i}", env=env)
            res = subprocess.run([*produce_cmd(), f"convs={data}", "--tokenizer", str(tok), "--max-tokens",
                                  str(args.max_tokens), "--chunk-size", str(args.chunk_size), "--max-context", "65536", "--out",
                                  str(where / "out"), "--redis-url", stack.redis_url],
                                 capture_output=True, text=True, timeout=args.timeout)
            if res.returncode != 0:
                raise RuntimeError(f"{mode}: produce exited {res.returncode}: {res.stderr[-2000:]}")
            lines = (where / "out" / "convs" / "raw_responses.jsonl").read_text().splitlines()
            stats = [sim_stats_url(u) for u in stack.sim_urls]
        finally:
            if router is not None:
                router.stop()
            stack.kill()
    prompt = sum(s["prompt_tokens_total"] for s in stats)
    cached = sum(s["cached_tokens_total"] for s in stats)
    out = {"mode": mode, "records": len(lines), "samples": n, "prompt_tokens": prompt, "cached_tokens": cached,
           "cached_share": cached / max(1, prompt), "requests_per_server": [s["completed"] for s in stats],
           "cached_share_per_server": [s["cached_tokens_total"] / max(1, s["prompt_tokens_total"]) for s in stats]}
    print(mode, json.dumps(out), flush=True)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| dispatch | samples on disk | requests per server | cached_tokens / prompt_tokens |",
           "| --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['mode']} | {r['records']} / {r['samples']} | {r['requests_per_server']} | "
                   f"**{r['cached_share']:.3f}** |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=60)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mean-tokens", type=float, default=40.0)
    ap.add_argument("--per-request-tps", type=float, default=30.0)
    ap.add_argument("--time-scale", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["list", "cache_aware", "round_robin", "one server"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    with scratch("affinity") as work:
        from demo.tokenizer import build_tokenizer
        tok = build_tokenizer(work / "tok", thinking="none")
        data = work / "convs.jsonl"
        n = write_conversations(data, args.conversations, args.turns)
        rows = [run(mode, args, work, tok, data, n) for mode in args.modes]
    save_results("affinity", {"args": vars(args), "rows": rows})
    print(table(rows))


if __name__ == "__main__":
    main()
