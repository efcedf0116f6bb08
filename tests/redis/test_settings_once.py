"""A dataset's settings are resolved once and read as they are (docs/decisions.md, "A dataset's settings are one
frozen value"): the values a run is built from are read-only, the servers' context check makes new ones instead
of editing them, and the chunks a run enqueues carry exactly what ``resolve`` made, generation by generation."""
from __future__ import annotations

import json
from dataclasses import FrozenInstanceError, fields
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.generations import split_key
from producer.launch import apply_server_context
from producer.prepare import Inputs, load_inputs
from producer.session.attach import RunOptions
from producer.session.loop import Producer
from render.modeldir import Context
from tests.producers import run_settings
from tests.rq_jobs import job_payloads

DS = "prompts"
#: Prompts of growing length: the servers' context check below drops the longest.
QUESTIONS = {f"p{i}": "Why? " * (1 + 6 * i) for i in range(4)}


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's hybrid template, so that ``enable_thinking`` is a template kwarg a mix can draw."""
    from demo.tokenizer import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("hybrid"), thinking="hybrid")


def inputs_for(tmp_path: Path, tokenizer: Path) -> Inputs:
    path = tmp_path / f"{DS}.jsonl"
    path.write_text("".join(json.dumps({"id": pid, "messages": [{"role": "user", "content": text}]}) + "\n"
                            for pid, text in QUESTIONS.items()))
    args = [str(path), "--tokenizer", str(tokenizer), "--max-tokens", "16", "--order", "file", "--reasoning-parser",
            "qwen3", "--turns", "last", "--generations", "3", "--temperature", "0.2,0.5,0.8", "--seed", "7",
            "--template-kwargs-mix", "enable_thinking=true,false"]
    return load_inputs(run_settings(*args), echo=lambda m: None, warn=lambda m: None)


def _read_only(value: Any) -> list[str]:
    """The fields of dataclass ``value`` that can be assigned (none, for a frozen one)."""
    open_fields = []
    for f in fields(value):
        try:
            setattr(value, f.name, getattr(value, f.name))
        except FrozenInstanceError:
            continue
        open_fields.append(f"{type(value).__name__}.{f.name}")
    return open_fields


def test_the_values_a_run_is_built_from_are_read_only(tmp_path: Path, hybrid_dir: Path) -> None:
    inputs = inputs_for(tmp_path, hybrid_dir)
    [p] = inputs.prepared
    prompt = next(iter(p.prompts.values()))
    options = RunOptions(out_dir=tmp_path / "out", budgets={DS: None})
    values = [inputs, p, p.settings, prompt, options, options.job, p.settings.generations]
    assert [name for v in values for name in _read_only(v)] == []
    # One value for every dataset and step: the inputs' settings are the dataset's, its mix's renderers with them.
    assert p.settings is inputs.settings and p.settings.variants is not None
    assert p.settings.tokenizer == str(hybrid_dir)


def test_the_servers_context_makes_new_values_and_leaves_the_checked_ones(tmp_path: Path,
                                                                          hybrid_dir: Path) -> None:
    inputs = inputs_for(tmp_path, hybrid_dir)
    [p] = inputs.prepared
    longest = max(p.prompts.values(), key=lambda prompt: prompt.length)
    limit = Context(longest.length + 16 - 1, "SGLang server test: context_length")
    before = (list(p.prompts), list(p.over_context))
    [q], dropped = apply_server_context(inputs.prepared, limit, 16)
    assert dropped == {DS: 1}
    assert (list(p.prompts), list(p.over_context)) == before, "the checked value was edited"
    assert list(q.prompts) == [pid for pid in p.prompts if pid != longest.sample.id]
    [problem] = q.over_context[len(p.over_context):]
    assert problem.line == longest.sample.line and "servers' context" in str(problem)
    assert q.settings is p.settings


def test_the_chunks_carry_exactly_the_resolved_settings(r: "redis.Redis", tmp_path: Path,
                                                        hybrid_dir: Path) -> None:
    inputs = inputs_for(tmp_path, hybrid_dir)
    [p] = inputs.prepared
    settings, variants = p.settings, p.settings.variants
    assert variants is not None
    options = RunOptions(out_dir=tmp_path / "out", budgets={DS: None}, chunk_size=4)
    producer = Producer(r, inputs.prepared, options, echo=lambda m: None)
    producer.attach()
    producer.run(detach=True)
    payloads = job_payloads(r)
    sent = {s["id"]: (chunk, s) for chunk in payloads for s in chunk["samples"]}
    assert sorted(sent) == sorted(p.keys())
    drawn = set()
    for key, (chunk, sample) in sent.items():
        pid, generation = split_key(key)
        assert chunk["sampling_params"] == settings.chunk_params
        assert {**chunk["sampling_params"], **sample.get("sampling_params", {})} == {**settings.chunk_params,
                                                     **(settings.generations.overrides(pid, generation) or {})}
        name = variants.name(pid, generation)
        drawn.add(name)
        assert sample["chat_template_kwargs"] == variants.kwargs(name)
        assert sample["input_ids"] == list(p.prompts[pid].renderings[name][0])
    assert len(drawn) == 2, "the mix drew one variant for every sample: the test proves less than it says"
    assert {s.get("sampling_params", c["sampling_params"])["temperature"] for c, s in sent.values()} == {0.2, 0.5, 0.8}
    run_json = json.loads((tmp_path / "out" / DS / "run.json").read_text())
    assert run_json["tokenizer_path"] == str(hybrid_dir.resolve())
