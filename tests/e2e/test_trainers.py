"""The consumer test: SpecForge's and speculators' own data preprocessing read budgetq's exports of a multi-turn,
tool-calling, reasoning run (produce -> real rq workers -> sglang-sim in a family's format, with its test
tokenizer), and train on exactly what the model generated (issue 25).

For each family and each (trainer, export) pair the trainer's rows are compared with budgetq's ``tokens`` export
(every regenerated turn: the prompt ids the worker sent, checked by digest, + the server's ``output_ids``):

- every turn becomes exactly one training row: none dropped, none duplicated, nothing else;
- the row's ids are that turn's prompt ids then its output ids, then only the end-of-turn text the trainer's
  template writes after the EOS (ChatML's ``"\\n"``);
- the loss mask is 0 on the prompt and 1 from the first output id to the row's end: the output ids, and that
  end-of-turn text (both trainers supervise their template's whole end of turn).

The trainers' code runs in a subprocess (tests/trainers/drive.py), installed from PyPI without its dependencies,
with the CPU torch wheel installed apart (scripts/bootstrap.sh, BUDGETQ_TEST_DEPS=1), on that subprocess's path
only. One stand-in, named there: the vLLM ``/render`` endpoint speculators tokenizes with (the tokenizer's chat
template on the same messages, as vLLM applies it). speculators' ArrowDataset and CollateFn read the hidden
states a vLLM server extracts for these rows: not run here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.families import build_family_tokenizer
from tests.procs import produce_cmd, read_jsonl

HERE = Path(__file__).resolve().parents[1]
#: Where scripts/bootstrap.sh installs the CPU torch the trainers' data code imports (the same default).
TORCH_DIR = Path(os.environ.get("BUDGETQ_TRAINER_TORCH") or Path(os.environ.get("XDG_CACHE_HOME") or
                 Path.home() / ".cache") / "budgetq" / "trainer-torch-2.13.0+cpu")

_INSTALLED = (importlib.util.find_spec("specforge") is not None and importlib.util.find_spec("speculators") is not None
              and (TORCH_DIR / ".complete-with-deps").is_file())
#: Skipped by hand without them; in CI (CI=true, where `make test` installs them) their absence is a failure.
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    not _INSTALLED and os.environ.get("CI") != "true",
    reason="the trainers' data code and its torch are installed by scripts/bootstrap.sh with BUDGETQ_TEST_DEPS=1")]

GLAIVE = HERE.parent / "demo" / "data" / "glaive_fc.jsonl"  # function definitions, tool results, several users
#: family -> SpecForge's registered chat template whose assistant header ends where the family's generation
#: prompt ends (qwen3-thinking's prompt opens <think>: qwen3-next-thinking's header includes it).
SPECFORGE_TEMPLATE = {"qwen3": "qwen3-thinking", "qwen3-thinking": "qwen3-next-thinking",
                      "kimi_k2": "kimi-k2-thinking"}
EXPORTS = [("specforge", "openai-messages"), ("specforge", "sharegpt"), ("specforge", "tokens"),
           ("speculators", "openai-messages"), ("speculators", "sharegpt"), ("speculators", "tokens")]


def with_tools_field(dest: Path) -> Path:
    """glaive_fc with its function moved from the system prompt to the record's ``tools`` (OpenAI shape, a JSON
    schema), as a tool-use dataset ships them: every prompt is rendered with them, and both trainers pass a row's
    ``tools`` to the chat template (SpecForge's parsers, speculators' render request), so the export's check
    must too. Each function has other properties: a row's tools differ from its neighbours'."""
    lines = []
    for rec in read_jsonl(GLAIVE):
        system, *rest = rec["messages"]
        fn = json.loads(system["content"][system["content"].index("-\n") + 2:])
        params = fn["parameters"]
        tools = [{"type": "function", "function": {
            "name": fn["name"], "description": fn["description"],
            "parameters": {"type": "object", "properties": {k: {"type": "string", "description": v}
                                                            for k, v in params.items()},
                           "required": list(params)[:1]}}}]
        lines.append(json.dumps({**rec, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                     *rest], "tools": tools}))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("\n".join(lines) + "\n")
    return dest


def produce(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*produce_cmd(), *args], capture_output=True, text=True, timeout=180)


def drive(trainer: str, export: Path, tok_dir: Path, template: str) -> list[dict[str, list[int]]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TORCH_DIR), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "HF_DATASETS_CACHE": str(export.parent / "hf-cache")}
    done = subprocess.run([sys.executable, str(HERE / "trainers" / "drive.py"), trainer, str(export), str(tok_dir),
                           template], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def mismatches(rows: list[dict[str, list[int]]], turns: list[tuple[list[int], list[int]]], tok: Any) -> list[str]:
    """What is not exact: each turn (prompt ids, output ids) must be one row of its own (see the module's doc). A
    row is a turn's when it is the turn's ids then only whitespace (a later turn's row starts with an earlier
    turn's ids too, as its history); identical turns (a dataset's duplicate prompts) are identical rows."""
    problems = []
    left = list(rows)
    for prompt, output in turns:
        want = prompt + output
        row = next((x for x in left if x["input_ids"][:len(want)] == want
                    and not tok.decode(x["input_ids"][len(want):]).strip()), None)
        if row is None:
            problems.append(f"turn {tok.decode(output)[:60]!r}: no row")
            continue
        left.remove(row)
        mask = row["loss_mask"]
        if mask != [0] * len(prompt) + [1] * (len(mask) - len(prompt)):
            problems.append(f"turn {tok.decode(output)[:60]!r}: loss on "
                            f"{tok.decode([i for i, m in zip(row['input_ids'], mask, strict=True) if m])!r}")
    problems += [f"a row no turn made: {tok.decode(row['input_ids'])[-80:]!r}" for row in left]
    return problems


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tools", ["system", "tools"])
@pytest.mark.parametrize("family", list(SPECFORGE_TEMPLATE))
def test_trainers_train_on_exactly_what_the_model_generated(
        family: str, tools: str, redis_url: str, r: "redis.Redis", tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    """``tools``: the functions in the system prompt (glaive_fc as it is), or in the record's ``tools``."""
    from transformers import AutoTokenizer
    tok_dir = build_family_tokenizer(tmp_path / "tok", family)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "60", "--seed", "11", "--reasoning-style", family,
                      "--tokenizer", str(tok_dir))
    workers(sim.url).start("w0")
    out = tmp_path / "out"
    source = GLAIVE if tools == "system" else with_tools_field(tmp_path / "data" / "glaive_fc.jsonl")
    res = produce([str(source), "--tokenizer", str(tok_dir), "--reasoning-parser", family, "--max-tokens", "300",
                   "--max-samples", "24", "--skip-invalid", "--out", str(out), "--redis-url", redis_url])
    assert res.returncode == 0, res.stderr
    recs = read_jsonl(out / "glaive_fc" / "raw_responses.jsonl")
    assert any(len(x["turns"]) > 1 for x in recs) and any(t["tool_calls"] for x in recs for t in x["turns"])
    assert any(t["reasoning"] for x in recs for t in x["turns"])
    assert all(bool(x.get("tools")) == (tools == "tools") for x in recs)

    def export(fmt: str, trainer: str) -> Path:
        dest = tmp_path / trainer / f"{fmt}.jsonl"
        extra = [] if fmt == "tokens" else ["--for", trainer, "--reasoning", "field"]
        done = produce(["export", "glaive_fc", "--out", str(out), "--format", fmt, "--tokenizer", str(tok_dir),
                        "--dest", str(dest), *extra])
        assert done.returncode == 0, done.stderr
        return dest

    tokens = read_jsonl(export("tokens", "budgetq"))
    turns = [(row["input_ids"][:row["loss_mask"].index(1)], row["input_ids"][row["loss_mask"].index(1):])
             for row in tokens]
    assert len(turns) > len({row["id"] for row in tokens}) > 0  # multi-turn: more turns than conversations
    table = {}
    for trainer, fmt in EXPORTS:
        rows = drive(trainer, export(fmt, trainer), tok_dir, SPECFORGE_TEMPLATE[family])
        problems = mismatches(rows, turns, tok)
        table[f"{trainer} {fmt}"] = f"{len(turns) - len([p for p in problems if p.startswith('turn')])}/{len(turns)}"
        assert not problems, (trainer, fmt, problems[:5])
    print(family, table)
