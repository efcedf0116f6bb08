"""Benchmark (4): the producer: 100,000 prompts validated, rendered and enqueued, vs rendering alone.

    python -m bench.producer_rate         # ~3 minutes (plus ~1 minute the first time: tokenizer training)

A realistic tokenizer: byte-level BPE with a 32K vocabulary, trained here with the ``tokenizers`` library
(demo/tokenizer.py's trainer and its Qwen-style chat template) on this Python's standard library sources
(code, comments, docstrings); cached in /tmp/budgetq-bench-cache between runs. A realistic dataset: 100,000
chat prompts (system + user, user only, and multi-turn), their text cut from the same sources.

In one command:
1. rendering alone: a child process loads the tokenizer and calls ``Renderer.render_many`` on the same
   conversations in batches of 256, exactly as producer/prepare.py does; only the render calls are timed
   (wall and CPU); it runs before and after produce, and the baseline is the mean of the two;
2. produce: ``produce prompts=FILE --tokenizer DIR --max-tokens 4096 --turns last --detach`` against a private
   redis-server, timed from process start to exit (interpreter start, imports, reading, validation,
   rendering, Redis checks, enqueue); its peak RSS and CPU come from wait4; Redis ``used_memory`` before and
   after gives the bytes per queued prompt.
Ratio = produce's prompts/s / rendering's prompts/s; also rendering's CPU seconds / produce's CPU seconds (the
same comparison, less sensitive to other work on the shared machine).

``--turns last`` by default, because that is the work the baseline does: each conversation rendered once, whole.
``--turns all`` (produce's default since issue 14) checks each multi-turn conversation whole (its template
rendered to text only, to check every turn's shape: ``Renderer.check_many``), renders turn 0's prompt, and puts
its messages in the payload for the workers (docs/performance.md, figure 4; before issue 28 the check was a whole
render, ids and all). ``--check-cost N`` prints only what that costs, per conversation, on N of the dataset's
multi-turn conversations (docs/multiturn.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import cpu_seconds, save_results, scratch
from demo.stack import Stack, produce_cmd

CACHE = Path("/tmp/budgetq-bench-cache")


def corpus_files(limit_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    out, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > limit_bytes:
            break
        out.append(p)
        total += size
    return out


def texts(limit_bytes: int) -> list[str]:
    return [p.read_text(errors="replace") for p in corpus_files(limit_bytes)]


def tokenizer(vocab: int, corpus_bytes: int) -> tuple[Path, float]:
    """The 32K tokenizer (trained once, then cached); returns (directory, seconds spent training now)."""
    key = hashlib.sha256(f"{sys.version}-{vocab}-{corpus_bytes}-v1".encode()).hexdigest()[:12]
    directory = CACHE / f"tok-{vocab}-{key}"
    if (directory / "tokenizer_config.json").exists():
        return directory, 0.0
    from demo.tokenizer import build_tokenizer
    t0 = time.perf_counter()
    tmp = directory.with_suffix(".tmp")
    build_tokenizer(tmp, thinking="open", vocab_size=vocab, corpus=texts(corpus_bytes))
    tmp.rename(directory)
    return directory, time.perf_counter() - t0


SYSTEMS = [
    "You are a helpful assistant.",
    "You are an expert Python developer. Answer with working code and a short explanation of the design.",
    "You are a careful code reviewer. Point out bugs, unclear names and missing tests, most important first, "
    "and suggest a fix for each. Keep the tone friendly and the answer short.",
]
ASKS = ["Explain what this code does:", "Find the bug in this function:", "Write unit tests for:",
        "Refactor this for readability:", "Summarize this module in three sentences:", "Add type hints to:"]


def write_dataset(path: Path, n: int, seed: int = 0) -> dict[str, Any]:
    """n chat prompts: 50% system + user, 35% user only, 15% multi-turn; user text 200-2,400 chars of code."""
    rng = random.Random(seed)
    pool = "\n".join(texts(4_000_000))
    chars = 0
    with open(path, "w") as fh:
        for i in range(n):
            start = rng.randrange(0, len(pool) - 3000)
            snippet = pool[start:start + rng.randint(200, 2400)]
            user = f"{rng.choice(ASKS)}\n```python\n{snippet}\n```"
            kind = rng.random()
            if kind < 0.5:
                messages = [{"role": "system", "content": rng.choice(SYSTEMS)}, {"role": "user", "content": user}]
            elif kind < 0.85:
                messages = [{"role": "user", "content": user}]
            else:
                messages = [{"role": "user", "content": user},
                            {"role": "assistant", "content": "Here is what it does: " + snippet[:300]},
                            {"role": "user", "content": "Now make it faster, and explain why it is faster."}]
            chars += sum(len(m["content"]) for m in messages)
            fh.write(json.dumps({"id": f"p{i}", "messages": messages}) + "\n")
    return {"prompts": n, "bytes": path.stat().st_size, "mean_chars": chars / n}


def render_only(data: Path, tok: Path) -> dict[str, Any]:
    """The child process's job: the render calls produce makes, timed alone."""
    from render.chat import Renderer, load_tokenizer
    conversations = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    t0 = time.perf_counter()
    renderer = Renderer(load_tokenizer(tok))
    t_load = time.perf_counter() - t0
    t1, c1 = time.perf_counter(), time.process_time()
    n_tokens = 0
    for i in range(0, len(conversations), 256):
        for r in renderer.render_many(conversations[i:i + 256]):
            n_tokens += len(r.input_ids)
    t_render, c_render = time.perf_counter() - t1, time.process_time() - c1
    return {"prompts": len(conversations), "render_s": t_render, "render_cpu_s": c_render,
            "tokenizer_load_s": t_load, "prompt_tokens": n_tokens, "prompts_per_s": len(conversations) / t_render}


def check_cost(data: Path, tok: Path, n: int, rounds: int = 3) -> dict[str, Any]:
    """CPU ms per multi-turn conversation of ``data`` (its first ``n``), in batches of 256 as produce makes them:
    rendered whole (the check before issue 28), checked whole (text only: the check now), turn 0 rendered (what
    is sent); ``rounds`` rounds, the three interleaved in each; median and every round."""
    import statistics

    from budget.record import plan
    from render.chat import Renderer, load_tokenizer
    renderer = Renderer(load_tokenizer(tok))
    with open(data) as fh:
        convs = [m for m in (json.loads(line)["messages"] for line in fh) if len(plan(m)) > 1][:n]
    firsts = [plan(m)[0].context for m in convs]

    def cpu_ms(fn: Any, items: list[Any]) -> float:
        c0 = time.process_time()
        for i in range(0, len(items), 256):
            fn(items[i:i + 256])
        return (time.process_time() - c0) / len(items) * 1000

    runs: dict[str, list[float]] = {"render whole": [], "check whole": [], "render turn 0": []}
    for _ in range(rounds):
        runs["render whole"].append(cpu_ms(renderer.render_many, convs))
        runs["check whole"].append(cpu_ms(renderer.check_many, convs))
        runs["render turn 0"].append(cpu_ms(renderer.render_many, firsts))
    return {"conversations": len(convs), **{k: {"median_ms": statistics.median(v), "ms": v} for k, v in runs.items()}}


def run_child(argv: list[str], env: dict[str, str] | None = None, watch: list[int] | None = None
              ) -> tuple[int, float, Any, list[tuple[float, str]], dict[int, float]]:
    """Run a child; returns (exit code, wall s, rusage, timestamped stderr lines, CPU s of ``watch`` pids)."""
    watch = watch or []
    c0 = {p: cpu_seconds(p) for p in watch}
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append((time.perf_counter() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join(5)
    lines.append((wall, "stdout: " + out.strip()[-2000:]))
    return proc.returncode, wall, usage, lines, {p: cpu_seconds(p) - c0[p] for p in watch}


# Where produce's time goes: the nearest enclosing frame that matches (leaf upward) names the activity.
PRODUCE_CATEGORIES = [
    ("imports (transformers, rq, ...)", ("(<frozen importlib",)),
    ("enqueue: zlib of each payload (level 1, in threads)", ("ChunkJob.to_dict (producer/session/loop.py",
                                                             "_WorkItem.run (concurrent/futures/thread.py")),
    ("enqueue: RQ Job.to_dict (RQ's own fields)", ("Job.to_dict (rq/job.py",)),
    ("enqueue: JSON of each payload (orjson)", ("ChunkSerializer.dumps (producer/session/loop.py",
                                                 "JSONSerializer.dumps (rq/serializers.py")),
    ("enqueue: RQ job objects, pipeline, MULTI/EXEC", ("enqueue_chunks (producer/session/loop.py",)),
    ("enqueue: Items, batches", ("Producer._refill (producer/session/loop.py", "Producer._batches (producer/session/loop.py")),
    ("render: chat template (jinja)", ("render_jinja_template (transformers",)),
    ("render: tokenize (tokenizers + transformers glue)", ("TokenizersBackend", "PreTrainedTokenizerBase.__call__")),
    ("render: think-tail decode", ("_opens_think (render/chat.py",)),
    ("render: other", ("Renderer.render_many (render/chat.py", "Renderer._apply (render/chat.py")),
    ("tokenizer load", ("load_tokenizer (render/chat.py",)),
    ("settings fingerprint", ("fingerprint (render/chat.py",)),
    ("read + validate", ("(producer/inputs/reader.py", "(producer/inputs/records.py")),
    ("prepare: select, to arrays", ("prepare (producer/prepare.py",)),
    ("attach (Redis checks, reconcile)", ("(producer/session/attach.py", "check_redis (producer/launch.py")),
]


def categorize(text: str) -> dict[str, float]:
    import collections
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        label = "other (startup, click)"
        for frame in reversed(stack.split(";")):
            hit = next((lab for lab, needles in PRODUCE_CATEGORIES if any(x in frame for x in needles)), None)
            if hit:
                label = hit
                break
        counts[label] += int(n)
    return {k: round(v / total, 4) for k, v in counts.most_common()}


def profile_produce(data: Path, tok: Path, work: Path, n: int, turns: str) -> dict[str, Any] | None:
    """produce --detach on the first n prompts under py-spy (when installed)."""
    import shutil
    if shutil.which("py-spy") is None:
        return None
    subset = work / "subset.jsonl"
    with open(data) as src, open(subset, "w") as dst:
        for i, line in enumerate(src):
            if i >= n:
                break
            dst.write(line)
    raw = work / "produce-profile.txt"
    with Stack(work / "profile-stack", workers=0, sim_count=0) as stack:
        subprocess.run(["py-spy", "record", "--rate", "200", "--format", "raw", "-o", str(raw), "--",
                        *produce_cmd(), f"prompts={subset}", "--tokenizer", str(tok), "--max-tokens", "4096",
                        "--turns", turns, "--out", str(work / "out-profile"), "--redis-url", stack.redis_url,
                        "--detach", "--quiet"],
                       check=True, capture_output=True)
    shutil.copy(raw, Path(__file__).resolve().parent / "results" / "producer-profile.txt")
    return {"prompts": n, "shares": categorize(raw.read_text())}


def serialization_options(data: Path, tok: Path, chunks: int = 20, size: int = 64) -> dict[str, Any]:
    """What one chunk job's payload costs to serialize: RQ's own way (json + zlib level 6 in Job.save, what
    produce did before), cheaper choices, and what produce does now, on real rendered chunks."""
    import zlib

    import orjson

    from render.chat import Renderer, load_tokenizer
    renderer = Renderer(load_tokenizer(tok))
    convs = []
    with open(data) as fh:
        for i, line in enumerate(fh):
            if i >= chunks * size:
                break
            convs.append(json.loads(line)["messages"])
    payloads: list[dict[str, Any]] = []
    for c in range(chunks):
        rendered = renderer.render_many(convs[c * size:(c + 1) * size])
        payloads.append({"v": 1, "dataset": "prompts", "chunk": f"bq-prompts-{c:07d}",
                         "sampling_params": {"max_new_tokens": 4096}, "think": {"start": "<think>", "end": "</think>"},
                         "samples": [{"id": f"p{c * size + j}", "input_ids": r.input_ids, "opens_think": r.opens_think}
                                     for j, r in enumerate(rendered)]})
    # What produce holds after prepare: each sample's ids as an array('i'); it writes them with
    # producer.session.loop's serializer and zlib level (the zlib part runs in threads there).
    from array import array

    from producer.session.loop import ZLIB_LEVEL, ChunkSerializer, wire_ids
    held = [{**p, "samples": [{**x, "input_ids": array("i", x["input_ids"])} for x in p["samples"]]}
            for p in payloads]
    out: dict[str, Any] = {"chunks": chunks, "samples_per_chunk": size}
    variants = {
        "json + zlib level 6 (RQ's Job.save, before)": lambda p: zlib.compress(json.dumps(p).encode(), 6),
        "json + zlib level 1": lambda p: zlib.compress(json.dumps(p).encode(), 1),
        "orjson + zlib level 1": lambda p: zlib.compress(orjson.dumps(p), 1),
        "orjson, uncompressed": lambda p: orjson.dumps(p),
        "produce now: orjson from the arrays + zlib level 1": lambda p: zlib.compress(ChunkSerializer.dumps(
            {**p, "samples": [{**x, "input_ids": wire_ids(x["input_ids"])} for x in p["samples"]]}), ZLIB_LEVEL),
    }
    for label, fn in variants.items():
        source = held if label.startswith("produce now") else payloads
        t0 = time.perf_counter()
        sizes = [len(fn(p)) for p in source]
        dt = time.perf_counter() - t0
        out[label] = {"ms_per_chunk": dt / chunks * 1000, "us_per_sample": dt / chunks / size * 1e6,
                      "bytes_per_sample": sum(sizes) / chunks / size}
    return out


def render_child(data: Path, tok: Path) -> dict[str, Any]:
    rc, wall, usage, lines, _ = run_child([sys.executable, "-m", "bench.producer_rate", "--render-only", str(data),
                                           str(tok)])
    if rc != 0:
        raise RuntimeError("render-only child failed: " + "\n".join(x for _, x in lines[-20:]))
    out: dict[str, Any] = json.loads(lines[-1][1].removeprefix("stdout: "))
    out.update({"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024,
                "cpu_share_of_render": out["render_cpu_s"] / out["render_s"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--corpus-bytes", type=int, default=12_000_000)
    ap.add_argument("--profile-prompts", type=int, default=20_000,
                    help="profile produce with py-spy on this many prompts (0: skip)")
    ap.add_argument("--turns", choices=["last", "all"], default="last",
                    help="produce --turns: last is the baseline's work; all renders turn 0 and checks the whole (see above)")
    ap.add_argument("--check-cost", type=int, metavar="N", default=0,
                    help="print only the CPU cost of the --turns all check on N multi-turn conversations")
    ap.add_argument("--render-only", nargs=2, metavar=("DATA", "TOKENIZER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.render_only:
        print(json.dumps(render_only(Path(args.render_only[0]), Path(args.render_only[1]))))
        return
    tok, train_s = tokenizer(args.vocab, args.corpus_bytes)
    if args.check_cost:
        with scratch("producer") as work:
            write_dataset(work / "prompts.jsonl", args.prompts)
            print(json.dumps(check_cost(work / "prompts.jsonl", tok, args.check_cost)))
        return
    from tokenizers import Tokenizer
    vocab_size = Tokenizer.from_file(str(tok / "tokenizer.json")).get_vocab_size()
    with scratch("producer") as work:
        data = work / "prompts.jsonl"
        ds = write_dataset(data, args.prompts)
        print("dataset", json.dumps(ds), "tokenizer", tok, f"vocab {vocab_size}", f"trained {train_s:.1f}s", flush=True)
        renders = [render_child(data, tok)]
        print("render", json.dumps(renders[-1]), flush=True)
        with Stack(work / "stack", workers=0, sim_count=0) as stack:
            r = stack.client()
            mem0 = int(r.info("memory")["used_memory"])
            rc, wall_p, ru_p, lines_p, redis_cpu = run_child(
                [*produce_cmd(), f"prompts={data}", "--tokenizer", str(tok), "--max-tokens", "4096",
                 "--turns", args.turns, "--out", str(work / "out"), "--redis-url", stack.redis_url, "--detach"],
                watch=[stack.pids()["redis"]])
            if rc != 0:
                raise RuntimeError("produce failed: " + "\n".join(x for _, x in lines_p[-20:]))
            mem1 = int(r.info("memory")["used_memory"])
            queued = int(r.llen("rq:queue:budgetq"))
            sample_job = r.lindex("rq:queue:budgetq", 0)
            job_bytes = (int(r.memory_usage(b"rq:job:" + sample_job, samples=0) or 0)
                         if isinstance(sample_job, bytes) else 0)
            ready = next((t for t, x in lines_p if "samples ready" in x), None)
            stack.stop()
        renders.append(render_child(data, tok))  # again after produce: the machine is shared
        print("render", json.dumps(renders[-1]), flush=True)
        prof = profile_produce(data, tok, work, args.profile_prompts, args.turns) if args.profile_prompts else None
        print("profile", json.dumps(prof), flush=True)
        ser = serialization_options(data, tok)
        print("serialization", json.dumps(ser), flush=True)
    produce = {"wall_s": wall_p, "prompts_per_s": args.prompts / wall_p, "peak_rss_mb": ru_p.ru_maxrss / 1024,
               "cpu_s": ru_p.ru_utime + ru_p.ru_stime, "cpu_share": (ru_p.ru_utime + ru_p.ru_stime) / wall_p,
               "s_to_samples_ready": ready, "s_enqueue_after_ready": (wall_p - ready) if ready else None,
               "redis_cpu_share": list(redis_cpu.values())[0] / wall_p, "queued_chunks": queued,
               "redis_bytes_total": mem1 - mem0, "redis_bytes_per_prompt": (mem1 - mem0) / args.prompts,
               "redis_bytes_per_prompt_token": (mem1 - mem0) / max(1, renders[0]["prompt_tokens"]),
               "redis_bytes_one_chunk_job": job_bytes, "stderr": [x for _, x in lines_p][-6:]}
    render = {"prompts_per_s": sum(r["prompts_per_s"] for r in renders) / len(renders),
              "render_s": sum(r["render_s"] for r in renders) / len(renders),
              "render_cpu_s": sum(r["render_cpu_s"] for r in renders) / len(renders),
              "cpu_share_of_render": sum(r["cpu_share_of_render"] for r in renders) / len(renders),
              "peak_rss_mb": max(r["peak_rss_mb"] for r in renders), "prompt_tokens": renders[0]["prompt_tokens"],
              "runs": renders}
    ratio = produce["prompts_per_s"] / render["prompts_per_s"]
    # The same work per CPU second: less sensitive to other work on the machine than wall-clock rates.
    ratio_cpu = render["render_cpu_s"] / produce["cpu_s"]
    res = {"args": vars(args), "dataset": ds, "tokenizer": {"vocab": vocab_size, "trained_s": train_s},
           "render_only": render, "produce": produce, "ratio": ratio, "ratio_cpu": ratio_cpu, "produce_profile": prof,
           "serialization": ser}
    save_results("producer_rate", res)
    print("produce", json.dumps(produce), flush=True)
    print(f"| figure | rendering alone | produce --turns {args.turns} --detach | ratio |\n| --- | --- | --- | --- |")
    each = " and ".join(f"{r['render_s']:.1f} s" for r in renders)
    print(f"| prompts/s ({args.prompts:,} prompts, {render['prompt_tokens'] / args.prompts:.0f} tokens mean) | "
          f"{render['prompts_per_s']:,.0f} (before and after produce: {each}) | {produce['prompts_per_s']:,.0f} "
          f"({wall_p:.1f} s: {ready or 0:.1f} s to rendered, then enqueue) | {ratio:.3f} |")
    print(f"| CPU seconds for the same prompts | {render['render_cpu_s']:.1f} s | {produce['cpu_s']:.1f} s | "
          f"{ratio_cpu:.3f} |")
    print(f"| CPU share (cores) | render child {render['cpu_share_of_render']:.2f} | "
          f"produce {produce['cpu_share']:.2f}, "
          f"redis {produce['redis_cpu_share']:.2f} | |")
    print(f"| peak RSS | {render['peak_rss_mb']:.0f} MB | {produce['peak_rss_mb']:.0f} MB | |")
    print(f"| Redis bytes per queued prompt | | {produce['redis_bytes_per_prompt']:,.0f} "
          f"({produce['redis_bytes_per_prompt_token']:.1f} per prompt token) | |")


if __name__ == "__main__":
    main()
