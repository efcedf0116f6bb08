"""Benchmark: the producer's local steps against the library work under them, in one run (no server, no Redis).

    python -m bench.local_speed            # ~1 minute on the shared 2-core machine
    python -m bench.local_speed --repeats 7 --lines 200000

Three figures, each a ratio of budgetq's time to a baseline timed in the same run on the same input, so the
machine's load (shared with other work) cancels out; each side is timed ``--repeats`` times, alternating, and the
best of each is kept (the run least disturbed by other work):

1. reading: ``read_dataset`` on a JSONL file of ``--lines`` chat records (system, user, assistant: the shape
   tests/unit/test_reader.py reads) / ``json.loads`` of each line of the same file. What budgetq adds is the
   record checks, the message building and the duplicate index.
2. rendering: ``Renderer.render_many`` on the 350 demo conversations (demo/sample_data.py, the shapes
   tests/unit/test_render.py renders) / the tokenizer's own ``apply_chat_template(..., tokenize=True)`` on the
   same conversations. Also the cost per conversation at 10x the conversations / at 1x, which stays near 1.0
   unless something in the path grows faster than the batch (the "accidental quadratic path").
3. the demo tokenizer: ``build_tokenizer`` (train the 2K BPE, write the directory) / loading the directory it
   wrote with ``AutoTokenizer.from_pretrained``, which is what every test and demo run does next.

Targets (docs/performance.md, "The producer's local steps"): reading ≤ 10, rendering ≤ 1.5, 10x/1x ≤ 1.5,
tokenizer ≤ 10. Writes bench/results/local_speed.json and prints markdown rows.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.harness import save_results

#: Loose on purpose: each guards against a step becoming a multiple slower (an accidental quadratic path, a
#: per-line regex compiled again), as the timed tests it replaces did, not against a few percent.
TARGETS = {"reading": 10.0, "rendering": 1.5, "rendering_10x_per_conversation": 1.5, "tokenizer": 10.0}


def best_of(repeats: int, *runs: Callable[[], object]) -> list[float]:
    """The shortest wall time of each run over ``repeats`` rounds, the runs alternating within a round."""
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            started = time.perf_counter()
            run()
            best[i] = min(best[i], time.perf_counter() - started)
    return best


def reading(directory: Path, lines: int, repeats: int) -> dict[str, Any]:
    from producer.inputs.reader import read_dataset
    path = directory / "big.jsonl"
    with path.open("w") as f:
        for i in range(lines):
            f.write(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": f"question {i}"},
                                             {"role": "assistant", "content": "old"}]}) + "\n")

    def baseline() -> None:
        with path.open("rb") as fh:
            for line in fh:
                json.loads(line)

    def budgetq() -> None:
        result = read_dataset("big", path)
        assert len(result.samples) == lines and not result.invalid

    base, ours = best_of(repeats, baseline, budgetq)
    return {"lines": lines, "baseline_s": round(base, 3), "budgetq_s": round(ours, 3), "ratio": round(ours / base, 2)}


def conversations() -> list[list[dict[str, Any]]]:
    """The demo records in the message shapes the producer builds from them (tests/unit/test_render.py's)."""
    from demo.sample_data import agent_traces_records, code_instruct_records, glaive_fc_records
    out: list[list[dict[str, Any]]] = [r["messages"] for r in glaive_fc_records()]
    out += [[{"role": "user", "content": r["prompt"]}] for r in code_instruct_records()]
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    for record in agent_traces_records():
        out.append([{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"][:-1]])
    return out


def rendering(directory: Path, repeats: int) -> dict[str, Any]:
    from demo.tokenizer import build_tokenizer
    from render.chat import Renderer, load_tokenizer
    tokenizer = load_tokenizer(build_tokenizer(directory / "tok"))
    renderer = Renderer(tokenizer)
    batch = conversations()
    ten = batch * 10

    def baseline() -> None:
        tokenizer.apply_chat_template(batch, add_generation_prompt=True, tokenize=True)

    base, ours, ours_ten = best_of(repeats, baseline, lambda: renderer.render_many(batch),
                                   lambda: renderer.render_many(ten))
    return {"conversations": len(batch), "baseline_s": round(base, 4), "budgetq_s": round(ours, 4),
            "ratio": round(ours / base, 2), "budgetq_10x_s": round(ours_ten, 4),
            "per_conversation_10x_over_1x": round(ours_ten / 10 / ours, 2)}


def tokenizer_build(directory: Path, repeats: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from demo.tokenizer import build_tokenizer
    built = build_tokenizer(directory / "load")
    rounds = iter(range(1_000_000))
    base, ours = best_of(repeats, lambda: AutoTokenizer.from_pretrained(str(built)),
                         lambda: build_tokenizer(directory / f"build{next(rounds)}"))
    return {"baseline_s": round(base, 4), "budgetq_s": round(ours, 4), "ratio": round(ours / base, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=100_000, help="JSONL lines read (default %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="rounds per figure; the best is kept (default %(default)s)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bq-local-speed-") as tmp:
        directory = Path(tmp)
        figures = {"reading": reading(directory, args.lines, args.repeats),
                   "rendering": rendering(directory, args.repeats),
                   "tokenizer": tokenizer_build(directory, args.repeats)}
    ratios = {"reading": figures["reading"]["ratio"], "rendering": figures["rendering"]["ratio"],
              "rendering_10x_per_conversation": figures["rendering"]["per_conversation_10x_over_1x"],
              "tokenizer": figures["tokenizer"]["ratio"]}
    met = {name: ratios[name] <= target for name, target in TARGETS.items()}
    path = save_results("local_speed", {"args": vars(args), "figures": figures, "targets": TARGETS, "met": met})
    r, g, t = figures["reading"], figures["rendering"], figures["tokenizer"]
    print("| figure | target | baseline | budgetq | ratio |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| reading {r['lines']:,} JSONL lines: read_dataset / json.loads per line | ≤ {TARGETS['reading']} "
          f"| {r['baseline_s']} s | {r['budgetq_s']} s | **{r['ratio']}** |")
    print(f"| rendering {g['conversations']} demo conversations: render_many / apply_chat_template "
          f"| ≤ {TARGETS['rendering']} | {g['baseline_s']} s | {g['budgetq_s']} s | **{g['ratio']}** |")
    print(f"| rendering, per conversation at 10x / at 1x | ≤ {TARGETS['rendering_10x_per_conversation']} "
          f"| {g['budgetq_s']} s | {g['budgetq_10x_s']} s | **{g['per_conversation_10x_over_1x']}** |")
    print(f"| demo tokenizer: build_tokenizer / AutoTokenizer.from_pretrained of it | ≤ {TARGETS['tokenizer']} "
          f"| {t['baseline_s']} s | {t['budgetq_s']} s | **{t['ratio']}** |")
    print(f"met: {met}; {path}")


if __name__ == "__main__":
    main()
