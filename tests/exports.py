"""An export's input written by hand: a dataset directory (run.json and raw_responses.jsonl) for the export tests."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from render.chat import Renderer


def write_dataset(root: Path, tok: Any, recs: list[dict[str, Any]]) -> Path:
    out = root / "out" / "ds"
    out.mkdir(parents=True, exist_ok=True)
    settings = {"chat_template_kwargs": {}, "sampling_params": {"max_new_tokens": 64},
                "think": ["<think>", "</think>"], "reasoning_parser": "qwen3", "tokenizer": Renderer(tok).fingerprint()}
    (out / "run.json").write_text(json.dumps(settings) + "\n", encoding="utf-8")
    (out / "raw_responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return out
