"""The parity corpus: per family, realistic completions and what SGLang 0.5.23's parsers make of them.

Expected values were worked out by reading sglang/srt/parser/reasoning_parser.py, harmony_parser.py and the
function-call detectors (sglang/srt/function_call/). Two differences apply everywhere and are not repeated per
case: budgetq strips whitespace around reasoning and content (SGLang returns them as generated; the chat templates
strip them when they render a turn back), and tool-call ids are deterministic (SGLang: a random uuid).
A case where budgetq differs from SGLang on purpose says why in its `why` field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.families import FAMILIES, build_family_tokenizer
from worker.reasoning import PARSERS, ParsedTurn, parse_turn, skip_special_tokens_for, split_reasoning
from worker.toolcalls import call_id

SEED = "ds\0sample-1"


def fn(name: str, arguments: dict[str, Any], index: int = 0, id_: str | None = None) -> dict[str, Any]:
    return {"id": id_ or call_id(SEED, index), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    reasoning: str | None
    content: str
    opens_think: bool = False
    finish: str = "stop"
    truncated: bool = False
    unclosed: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)
    errors: int = 0
    why: str = ""  # where budgetq differs from SGLang, and why


def check(parser: str, case: Case) -> None:
    got = parse_turn(parser, case.text, opens_think=case.opens_think, finish_reason=case.finish, call_id_seed=SEED)
    assert got == ParsedTurn(case.reasoning, case.content, case.truncated, case.unclosed, case.calls,
                             case.errors), case.name


def test_interface() -> None:
    assert PARSERS == ("qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi", "kimi_k2",
                       "gpt-oss", "none")
    assert [p for p in PARSERS if not skip_special_tokens_for(p)] == ["gpt-oss"]
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        parse_turn("qwen", "x", opens_think=False, finish_reason="stop")


def test_old_split_unchanged() -> None:
    split = split_reasoning("a</think>b", start="<think>", end="</think>", opens_think=True, finish_reason="stop")
    assert (split.reasoning, split.content, split.reasoning_truncated) == ("a", "b", False)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_tokenizer_builds(tmp_path: Path, family: str) -> None:
    from producer.render import Renderer, load_tokenizer
    tok = load_tokenizer(build_family_tokenizer(tmp_path / family, family))
    rendered = Renderer(tok).render([{"role": "user", "content": "Hi"}])
    assert rendered.input_ids
    assert rendered.opens_think is (family == "qwen3-thinking")
