"""The demo fixtures: the tokenizer builds byte-identically (how fast: bench/local_speed.py); the committed datasets match their generator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tokenizers import Tokenizer

from demo import sample_data, tokenizer
from demo.sample_data import DATA_DIR, write_sample_data
from demo.tokenizer import THINK_TOKENS, build_tokenizer


@pytest.mark.parametrize("thinking", ["open", "hybrid", "none"])
def test_build_is_deterministic(tmp_path: Path, thinking: str) -> None:
    first = build_tokenizer(tmp_path / "a", thinking=thinking)
    second = build_tokenizer(tmp_path / "b", thinking=thinking)
    names = sorted(p.name for p in first.iterdir())
    assert names == ["tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes()


def test_think_tokens_only_in_thinking_variants(tmp_path: Path) -> None:
    for thinking, expected in (("open", True), ("hybrid", True), ("none", False)):
        vocab = Tokenizer.from_file(str(build_tokenizer(tmp_path / thinking, thinking=thinking) / "tokenizer.json"))
        assert all((vocab.token_to_id(t) is not None) is expected for t in THINK_TOKENS)
        template = json.loads((tmp_path / thinking / "tokenizer_config.json").read_text())["chat_template"]
        assert ("<think>" in template) is expected


def test_any_text_encodes(tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(build_tokenizer(tmp_path) / "tokenizer.json"))
    text = "naïve café — 東京 🚀 \x00\t"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_unknown_variant(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="thinking must be one of open, hybrid, none"):
        build_tokenizer(tmp_path, thinking="sometimes")


def test_cli(tmp_path: Path) -> None:
    result = CliRunner().invoke(tokenizer.main, [str(tmp_path / "tok"), "--thinking", "hybrid"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    result = CliRunner().invoke(sample_data.main, [str(tmp_path / "data")])
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "data").glob("*.jsonl"))) == 3


def test_committed_sample_data_matches_generator(tmp_path: Path) -> None:
    paths = write_sample_data(tmp_path)
    assert [p.name for p in paths] == ["glaive_fc.jsonl", "code_instruct.jsonl", "agent_traces.jsonl"]
    for path in paths:
        assert (DATA_DIR / path.name).read_bytes() == path.read_bytes(), "regenerate: python -m demo.sample_data"
    assert sum(p.stat().st_size for p in paths) < 150_000


def test_sample_data_shapes() -> None:
    datasets: dict[str, list[dict[str, Any]]] = {}
    for name in ("glaive_fc.jsonl", "code_instruct.jsonl", "agent_traces.jsonl"):
        records = [json.loads(line) for line in (DATA_DIR / name).read_text().splitlines()]
        ids = [r["id"] for r in records]
        assert len({json.dumps(i) for i in ids}) == len(ids)
        assert {type(i) for i in ids} == {str, int}
        datasets[name] = records
    assert all(r["messages"][0]["role"] == "system" for r in datasets["glaive_fc.jsonl"])
    assert sum("tool_calls" in m for r in datasets["glaive_fc.jsonl"] for m in r["messages"]) == 40
    assert all(isinstance(r["prompt"], str) for r in datasets["code_instruct.jsonl"])
    assert all(r["conversations"][-1]["from"] == "gpt" for r in datasets["agent_traces.jsonl"])
