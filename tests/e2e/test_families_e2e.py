"""End to end per model family: produce -> real rq workers -> sglang-sim writing that family's text with its test
tokenizer (tests/families.py) -> export; the exports re-render through the family's chat template to the ids the
model saw and produced.

What is checked, per family (docs/export.md, "Which export is exact"):

- every record is version 2 with the server's ids, parsed by the family's parser;
- ``tokens``: ``input_ids`` are the prompt the producer rendered (its digest is the worker's) + the server's
  ``output_ids``, the loss mask 1 exactly on the output ids;
- ``openai-messages``: rendering a finished conversation through the template gives exactly those ids, up to the
  EOS (a template renders its own end of turn, or none: GLM-4.5 ends a turn with the next role token). Where a
  family's template drops what the model wrote (gpt-oss drops the analysis of a final answer, the R1 template drops
  every reasoning), the test asserts that it is dropped, so the documented loss stays true.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from render.chat import _checked
from tests.families import build_family_tokenizer
from tests.procs import produce_cmd, read_jsonl

pytestmark = pytest.mark.e2e

GLAIVE = Path(__file__).resolve().parents[2] / "demo" / "data" / "glaive_fc.jsonl"  # function definitions
#: family -> the export's reasoning mode its template reads back (Kimi-VL's template renders only content).
FAMILIES = {"qwen3": "field", "qwen3-thinking": "field", "glm45": "field", "kimi": "inline", "kimi_k2": "field",
            "gpt-oss": "field", "deepseek-v3": "field", "deepseek-r1": "field"}


def run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*produce_cmd(), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_end_to_end_exports_are_the_ids_the_model_saw_and_produced(
        family: str, redis_url: str, r: "redis.Redis", tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    from transformers import AutoTokenizer
    tok_dir = build_family_tokenizer(tmp_path / "tok", family)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "60", "--seed", "7", "--reasoning-style", family,
                      "--tokenizer", str(tok_dir))
    workers(sim.url).start("w0")
    out = tmp_path / "out"
    # --skip-invalid: a template may refuse a dataset record (arguments that are not a JSON object).
    res = run([str(GLAIVE), "--tokenizer", str(tok_dir), "--reasoning-parser", family, "--max-tokens", "300",
               "--max-samples", "16", "--skip-invalid", "--out", str(out), "--redis-url", redis_url,
               "--turns", "last"])  # one regenerated turn per record, as the checks below read them
    assert res.returncode == 0, res.stderr
    ds = out / "glaive_fc"
    records = {x["id"]: x for x in read_jsonl(ds / "raw_responses.jsonl")}
    assert len(records) == 16
    for rec in records.values():
        turn = rec["turns"][0]
        assert rec["record_version"] == 2 and rec["reasoning_parser"] == family
        assert len(turn["output_ids"]) == turn["completion_tokens"]
        assert rec["sampling_params"]["skip_special_tokens"] is (family not in ("gpt-oss", "kimi_k2"))
    calls = sum(bool(x["turns"][0]["tool_calls"]) for x in records.values())
    errors = sum(x["turns"][0]["tool_call_errors"] for x in records.values())
    if family not in ("kimi", "deepseek-r1"):  # Kimi-VL has no tool format; the R1 template renders no tools
        assert calls > 0, "the function definitions in the prompts get parsed calls"
    assert errors == 0

    mode = FAMILIES[family]
    # --inexact keep: the rows a family's template renders otherwise are kept (marked), so the losses below stay
    # measured here
    for fmt, extra in (("tokens", []),
                       ("openai-messages", ["--reasoning", mode, "--for", "speculators", "--inexact", "keep"])):
        exported = run(["export", "glaive_fc", "--out", str(out), "--format", fmt, "--tokenizer", str(tok_dir),
                        *extra])
        assert exported.returncode == 0, exported.stderr
    rows = {row["id"]: row for row in read_jsonl(ds / "tokens.jsonl")}
    conversations = {c["id"]: c for c in read_jsonl(ds / "openai-messages.jsonl")}
    finished = [sid for sid, rec in records.items() if not rec["incomplete"]]
    assert finished and set(rows) == set(conversations) == set(finished)

    exact = lossy = 0
    for sid in finished:
        rec, row, turn = records[sid], rows[sid], records[sid]["turns"][0]
        # As SGLang's chat serving and budgetq's renderer give them to the template: tool-call arguments as
        # objects (render/chat.py _checked), which GLM-4.5's template requires.
        prompt = tok.apply_chat_template(_checked(rec["messages"]), add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        assert row["input_ids"] == prompt + turn["output_ids"]
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(turn["output_ids"])
        messages = _checked(conversations[sid]["conversations"])  # GLM-4.5 renders arguments from an object
        whole = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        body = row["input_ids"][:-1]  # without the EOS: the template writes its own end of turn
        if whole[:len(body)] == body:
            exact += 1
        else:
            lossy += 1
            # Only where the template drops what the model wrote: gpt-oss's analysis before a final answer,
            # every reasoning under the R1 template.
            assert (family == "gpt-oss" and not turn["tool_calls"]) or family == "deepseek-r1", (
                sid, tok.decode(whole[len(prompt):]), tok.decode(body[len(prompt):]))
    if family == "deepseek-r1":
        assert lossy == len(finished)
    elif family == "gpt-oss":
        assert exact == sum(bool(records[s]["turns"][0]["tool_calls"]) for s in finished)
    else:
        assert exact == len(finished) and lossy == 0
    manifest = json.loads((ds / "manifest.json").read_text())
    assert manifest["record_versions"] == {"2": 16} and manifest["counts"]["tool_calls"] == calls


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3", "glm45"])
def test_tool_turns_splice_the_datasets_results_and_every_turn_re_renders_to_its_prompt(
        family: str, redis_url: str, r: "redis.Redis", tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    """--turns all on function-calling conversations: a regenerated turn that calls the dataset's function gets
    the dataset's tool result (its tool_call_id now the model's call id) and a next turn; one that calls none
    skips the dataset's tool exchange. The tokens export re-renders every turn's prompt from the record and
    checks it id by id against the digest of what the worker sent: none differs."""
    from producer.export.writer import ExportOptions, export_dataset
    from render.chat import load_tokenizer
    tok_dir = build_family_tokenizer(tmp_path / "tok", family)
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "60", "--seed", "11", "--reasoning-style", family,
                      "--tokenizer", str(tok_dir))
    workers(sim.url).start("w0")
    out = tmp_path / "out"
    res = run([str(GLAIVE), "--tokenizer", str(tok_dir), "--reasoning-parser", family, "--max-tokens", "300",
               "--max-samples", "40", "--skip-invalid", "--out", str(out), "--redis-url", redis_url])
    assert res.returncode == 0, res.stderr
    recs = read_jsonl(out / "glaive_fc" / "raw_responses.jsonl")
    spliced = 0
    for rec in recs:
        turns = rec["turns"]
        calls = [c for c in turns[0]["tool_calls"]]
        tools = [m for m in rec["messages"] if m["role"] == "tool"]
        if len(turns) > 1 and tools:
            spliced += 1
            assert calls and all(m.get("tool_call_id") in {c["id"] for c in calls} for m in tools if "tool_call_id" in m)
        assert rec["stopped_by"] in (None, "length", "tool_mismatch", "reasoning_unclosed"), rec
    assert spliced > 0, "some regenerated turns called the dataset's function and went on after its result"
    report = export_dataset(out / "glaive_fc", tmp_path / "tokens.jsonl", ExportOptions(format="tokens"),
                            tokenizer=load_tokenizer(str(tok_dir)))
    assert report.prompt_mismatch == 0 and report.written > len([x for x in recs if not x["incomplete"]])
