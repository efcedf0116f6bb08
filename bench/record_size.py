"""Benchmark: the file-size cost of record version 2's token ids (bytes per raw_responses.jsonl line).

    python -m bench.record_size                      # synthetic: lognormal lengths, mean 3.8K tokens
    python -m bench.record_size --records out/NAME/raw_responses.jsonl   # a real output file (version 2)

Bytes, not time: the figures do not depend on the machine's load. For each record, the line as written (version
2: ``output_ids`` kept, the prompt as a 64-hex digest) is compared with the same line without ``output_ids``
(``null``) and with the prompt ids stored instead of the digest, so the three choices of docs/export.md ("What a
record costs") are measured on the same records.

Synthetic records: completion length lognormal (sigma 0.8, mean ``--mean``), prompt length lognormal (mean
``--prompt-mean``); ~4 characters of text per token (English and code on a 150K BPE vocabulary); token ids drawn
Zipf-like over a 151,643-id vocabulary (frequent tokens have low ids in a BPE vocabulary, since merges are learnt
in frequency order), or uniformly (``--ids uniform``: every id as wide as a Qwen-size vocabulary's, the upper
bound); reasoning + content
repeat the response's text, as the parse does. ``--seed`` fixes everything.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import string
from pathlib import Path
from typing import Any, Iterator

from budget import record

VOCAB = 151_643


def _uniform_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _zipf_ids(rng: random.Random, n: int) -> list[int]:
    # Inverse-CDF of a continuous Zipf (s = 1.1) over ranks 1..VOCAB: cheap and deterministic.
    s = 1.1
    top = VOCAB ** (1 - s)
    return [min(VOCAB - 1, int((1 - rng.random() * (1 - top)) ** (1 / (1 - s)))) for _ in range(n)]


def _text(rng: random.Random, tokens: int) -> str:
    letters = string.ascii_lowercase
    words = []
    size = 0
    while size < 4 * tokens:
        w = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:4 * tokens]


def synthetic(n: int, mean: float, prompt_mean: float, seed: int,
              ids: str = "zipf") -> Iterator[tuple[dict[str, Any], list[int]]]:
    rng = random.Random(seed)
    draw = _uniform_ids if ids == "uniform" else _zipf_ids
    sigma = 0.8
    for i in range(n):
        length = max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))
        prompt_len = max(1, round(rng.lognormvariate(math.log(prompt_mean) - sigma * sigma / 2, sigma)))
        prompt_ids = draw(rng, prompt_len)
        think = int(length * 0.6)
        reasoning, content = _text(rng, think), _text(rng, length - think)
        turn = record.make_turn(response=f"{reasoning}\n</think>\n\n{content}", reasoning=reasoning,
                                content=content, reasoning_truncated=False, reasoning_unclosed=False,
                                tool_calls=[], prompt_tokens=prompt_len, cached_tokens=0,
                                completion_tokens=length, finish_reason="stop", prompt_ids=prompt_ids,
                                output_ids=draw(rng, length - 1) + [151645])
        messages = [{"role": "user", "content": _text(rng, prompt_len)}]
        rec = record.make_record(sample_id=f"s{i:06d}", dataset="synthetic", turns=[turn], reasoning_parser="qwen3",
                                 sampling_params={"max_new_tokens": 16384, "skip_special_tokens": True},
                                 messages=messages)
        yield rec, prompt_ids


def from_file(path: Path) -> Iterator[tuple[dict[str, Any], list[int] | None]]:
    with open(path, "rb") as fh:
        for raw in fh:
            if raw.endswith(b"\n"):
                rec = json.loads(raw)
                if rec.get("record_version") == record.RECORD_VERSION:
                    yield rec, None


def line_bytes(rec: dict[str, Any]) -> int:
    return len((json.dumps(record.ordered(rec), ensure_ascii=False) + "\n").encode())


def measure(records: Iterator[tuple[dict[str, Any], list[int] | None]]) -> dict[str, Any]:
    kept, without, with_prompt, tokens, prompt_tokens = [], [], [], [], []
    for rec, prompt_ids in records:
        turn = rec["turns"][0]
        kept.append(line_bytes(rec))
        bare = {**rec, "turns": [{**turn, "output_ids": None}]}
        without.append(line_bytes(bare))
        if prompt_ids is not None:
            stored = {**rec, "turns": [{**turn, "prompt_ids_sha256": None, "prompt_ids": prompt_ids}]}
            with_prompt.append(line_bytes(stored))
        tokens.append(turn["completion_tokens"])
        prompt_tokens.append(turn["prompt_tokens"])
    n = len(kept)
    out: dict[str, Any] = {
        "records": n, "completion_tokens_mean": round(statistics.fmean(tokens), 1),
        "prompt_tokens_mean": round(statistics.fmean(prompt_tokens), 1),
        "bytes_per_record_without_output_ids": round(statistics.fmean(without)),
        "bytes_per_record_with_output_ids": round(statistics.fmean(kept)),
        "output_ids_bytes_per_token": round((sum(kept) - sum(without)) / sum(tokens), 2),
        "output_ids_increase": round(sum(kept) / sum(without) - 1, 3),
    }
    if with_prompt:
        out["bytes_per_record_storing_prompt_ids_too"] = round(statistics.fmean(with_prompt))
        out["prompt_ids_increase_over_v2"] = round(sum(with_prompt) / sum(kept) - 1, 3)
    out["digest_bytes_per_record"] = len(', "prompt_ids_sha256": ""') + 64
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=Path, default=None, help="a raw_responses.jsonl to measure instead")
    p.add_argument("-n", type=int, default=2000, help="synthetic records (default %(default)s)")
    p.add_argument("--mean", type=float, default=3800.0, help="mean completion tokens (default %(default)s)")
    p.add_argument("--prompt-mean", type=float, default=1000.0, help="mean prompt tokens (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ids", choices=("zipf", "uniform"), default="zipf",
                   help="synthetic id distribution: zipf (low ids frequent, as in BPE) or uniform (the upper bound: "
                        "every id as wide as the vocabulary's; default %(default)s)")
    args = p.parse_args()
    source = from_file(args.records) if args.records else synthetic(args.n, args.mean, args.prompt_mean, args.seed, args.ids)
    print(json.dumps(measure(source), indent=2))


if __name__ == "__main__":
    main()
