"""The "chats" dataset of the multi-turn tests: three conversations of one, two and three user turns (the last
with an old answer that is dropped), and simulator options that answer each turn at once with a fixed length."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from producer.prepare import Inputs
    from producer.session.attach import RunOptions

DS = "chats"
SYSTEM = {"role": "system", "content": "Be brief."}
MESSAGES: dict[str, list[dict[str, Any]]] = {
    "one": [{"role": "user", "content": "Only one question here."}],
    "two": [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi, how can I help?"},
            {"role": "user", "content": "Tell me a story about a cat."}],
    "three": [{"role": "user", "content": "First question."}, {"role": "assistant", "content": "First answer."},
              {"role": "user", "content": "Second question."}, {"role": "assistant", "content": "Second answer."},
              {"role": "user", "content": "Third question."},
              {"role": "assistant", "content": "The old answer, dropped."}],
}


def write_dataset(directory: Path) -> Path:
    path = directory / f"{DS}.jsonl"
    path.write_text("".join(json.dumps({"id": sid, "messages": m}) + "\n" for sid, m in MESSAGES.items()))
    return path


#: sglang-sim options: 12-token answers (no reasoning), no prefill or prefix-cache time, 2000 tokens/s each.
SIM_ARGS = ("--tokens-per-second-per-request", "2000", "--prefix-cache-pages", "0", "--prefill-tokens-per-second", "0",
            "--length-dist", "fixed", "--mean-tokens", "12", "--reasoning-fraction", "0")


def options(tmp_path: Path, inputs: "Inputs", **kw: Any) -> "RunOptions":
    """produce's run options for the chats dataset as the producer tests attach it (chunks of 2, no budget)."""
    from producer.session.attach import RunOptions
    return RunOptions(out_dir=tmp_path / "out", conversation=inputs.conversation(),
                      **{"chunk_size": 2, "budgets": {DS: None}, **kw})


def turn(sid: str, i: int, tokens: int) -> dict[str, Any]:
    """A committed turn's record as commit_turn takes it (the fields the collector and the audits read)."""
    return {"response": f"answer {i} of {sid}", "completion_tokens": tokens, "finish_reason": "stop",
            "output_ids": list(range(tokens)), "prompt_tokens": 5}
