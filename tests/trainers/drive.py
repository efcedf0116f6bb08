"""Run a trainer's own data preprocessing on one budgetq export and print the rows it would train on.

``python tests/trainers/drive.py specforge|speculators EXPORT TOKENIZER_DIR [SPECFORGE_TEMPLATE]`` prints one JSON
line per training row the trainer produced: ``{"input_ids": [...], "loss_mask": [...]}``. Run by
tests/e2e/test_trainers.py in a subprocess whose path starts with the CPU torch that scripts/bootstrap.sh installs
apart (--target), so no budgetq process ever imports torch.

The trainers' code is theirs, installed from PyPI without its dependencies (scripts/bootstrap.sh):

- SpecForge: ``specforge.data.prompt_builder.prepare_prompt_tasks`` (-> ``build_eagle3_dataset`` ->
  ``preprocess_conversations`` -> its parser), as its online trainer reads a JSONL file; rows whose first record
  holds ``input_ids``/``loss_mask`` take its pre-tokenized path.
- speculators: ``speculators.data_generation.preprocessing.load_and_preprocess_dataset``.

Stand-ins, for what cannot run here:

- the vLLM ``/render`` endpoint speculators tokenizes conversations with: the tokenizer's own chat template on
  the same messages, after vLLM's own step of parsing a tool call's JSON ``arguments`` string into an object
  (vllm/entrypoints/chat_utils.py ``_postprocess_messages``).
- speculators' package ``__init__`` is not executed (its model classes import the training stack, hs_connectors
  and more): the package is registered bare and only its data modules are imported.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from typing import Any


def _rows(input_ids: Any, loss_mask: Any) -> dict[str, list[int]]:
    def flat(x: Any) -> list[int]:
        x = x.tolist() if hasattr(x, "tolist") else list(x)
        return [int(v) for v in (x[0] if x and isinstance(x[0], list) else x)]
    return {"input_ids": flat(input_ids), "loss_mask": flat(loss_mask)}


def specforge(export: str, tok_dir: str, template: str) -> list[dict[str, list[int]]]:
    from specforge.data.prompt_builder import prepare_prompt_tasks
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tasks = prepare_prompt_tasks(export, tok, chat_template=template, max_length=32768, is_preformatted=False,
                                 train_only_last_turn=True, cache_dir=None, cache_key=None, num_proc=1)
    return [_rows(t["payload"]["input_ids"], t["payload"]["loss_mask"]) for t in tasks]


def _render_standin(tok: Any) -> Any:
    def render_conversation(_endpoint: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                            tools: Any = None, truncate_prompt_tokens: int | None = None,
                            truncation_side: str = "right", **_kw: Any) -> list[int]:
        prepared = []
        for m in messages:
            m = dict(m)
            if isinstance(m.get("content"), list):  # text parts, as vLLM joins them for a string template
                m["content"] = "".join(p.get("text", "") for p in m["content"])
            if m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    c = json.loads(c) if isinstance(c, str) else dict(c)
                    fn = dict(c.get("function") or {})
                    if isinstance(fn.get("arguments"), str):
                        try:
                            fn["arguments"] = json.loads(fn["arguments"])
                        except ValueError:
                            pass
                    calls.append({**c, "function": fn})
                m["tool_calls"] = calls
            prepared.append(m)
        ids = tok.apply_chat_template(prepared, tools=tools, add_generation_prompt=add_generation_prompt,
                                      tokenize=True, return_dict=False)
        return list(ids)[:truncate_prompt_tokens] if truncate_prompt_tokens else list(ids)
    return render_conversation


def speculators(export: str, tok_dir: str) -> list[dict[str, list[int]]]:
    spec = importlib.util.find_spec("speculators")
    assert spec is not None and spec.submodule_search_locations, "speculators is not installed"
    package = types.ModuleType("speculators")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["speculators"] = package
    from speculators.data_generation import preprocessing
    from transformers import AutoTokenizer
    preprocessing.render_conversation = _render_standin(AutoTokenizer.from_pretrained(tok_dir))
    dataset, _processor = preprocessing.load_and_preprocess_dataset(
        tok_dir, [export], seq_length=32768, build_dataset_num_proc=1, render_endpoint="http://standin",
        skip_token_freq=True)
    return [_rows(dataset[i]["input_ids"], dataset[i]["loss_mask"]) for i in range(len(dataset))]


def main(argv: list[str]) -> None:
    trainer, export, tok_dir = argv[:3]
    rows = specforge(export, tok_dir, argv[3]) if trainer == "specforge" else speculators(export, tok_dir)
    out = sys.stdout
    for row in rows:
        out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
