"""The test chat templates (tests/families.py) and the parsers agree: what a family's template renders for a
regenerated turn is, parsed back with that family's parser, the same reasoning, answer and tool calls.

This is the property the exports rely on (a record's fields, rendered through the template, give back the text the
model produced). Templates that drop reasoning when they render a turn (DeepSeek-R1 and V3.1 drop it from every
assistant turn; gpt-oss keeps the analysis only before a tool call) are lossy there, which is checked too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from producer.settings import skip_special_tokens_default
from render.chat import Renderer, load_tokenizer
from tests.families import FAMILIES, build_family_tokenizer
from worker.reasoning import parse_turn, skip_special_tokens_for

PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGS = {"city": "Paris"}
MARKERS = {"qwen3": "<think>", "qwen3-thinking": "</think>", "glm45": "<arg_key>", "kimi": "◁think▷",
           "kimi_k2": "<|tool_calls_section_begin|>", "gpt-oss": "<|channel|>", "deepseek-r1": "<｜tool▁sep｜>",
           "deepseek-v3": "</think>", "none": "<tool_call>"}


def _call(family: str) -> dict[str, Any]:
    arguments: Any = ARGS if family == "glm45" else json.dumps(ARGS)  # GLM's template iterates an object
    return {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}


def _generated(tok: Any, family: str, turn: dict[str, Any], end: str) -> tuple[str, bool]:
    """The completion the template implies for `turn`: whole conversation minus the prompt, minus the end."""
    rendered = Renderer(tok).render(PROMPT)
    prompt = tok.decode(rendered.input_ids, skip_special_tokens=False)
    whole = tok.apply_chat_template([*PROMPT, turn], tokenize=False)
    assert whole.startswith(prompt), family
    text = whole[len(prompt):]
    assert text.endswith(end), (family, text)
    return text[:len(text) - len(end)], rendered.opens_think


@pytest.mark.parametrize(("family", "end"), [("qwen3", "<|im_end|>\n"), ("qwen3-thinking", "<|im_end|>\n"),
                                             ("glm45", ""), ("kimi_k2", "<|im_end|>")])
def test_reasoning_and_a_tool_call_render_and_parse_back(tmp_path: Path, family: str, end: str) -> None:
    tok = load_tokenizer(build_family_tokenizer(tmp_path / family, family))
    turn = {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
            "tool_calls": [_call(family)]}
    text, opens = _generated(tok, family, turn, end)
    parsed = parse_turn(family, text, opens_think=opens, finish_reason="stop", call_id_seed="s")
    assert (parsed.reasoning, parsed.content, parsed.tool_call_errors) == ("I need the weather tool.", "", 0)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls] == [
        ("get_weather", ARGS)]
    if family == "kimi_k2":  # the id the model wrote, which this template renders back
        assert parsed.tool_calls[0]["id"] == "functions.get_weather:0"


@pytest.mark.parametrize(("family", "end"), [("qwen3", "<|im_end|>\n"), ("glm45", ""), ("kimi_k2", "<|im_end|>")])
def test_an_answer_renders_and_parses_back(tmp_path: Path, family: str, end: str) -> None:
    tok = load_tokenizer(build_family_tokenizer(tmp_path / family, family))
    turn = {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Easy."}
    text, opens = _generated(tok, family, turn, end)
    parsed = parse_turn(family, text, opens_think=opens, finish_reason="stop")
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("Easy.", "It is sunny.", [])


def test_kimi_reasoning_inline_parses_back(tmp_path: Path) -> None:
    tok = load_tokenizer(build_family_tokenizer(tmp_path / "kimi", "kimi"))
    text, opens = _generated(tok, "kimi", {"role": "assistant", "content": "◁think▷Easy.◁/think▷It is sunny."},
                             "<|im_end|>")
    parsed = parse_turn("kimi", text, opens_think=opens, finish_reason="stop")
    assert (parsed.reasoning, parsed.content) == ("Easy.", "It is sunny.")


def test_harmony_call_after_analysis_renders_and_parses_back(tmp_path: Path) -> None:
    tok = load_tokenizer(build_family_tokenizer(tmp_path / "gpt-oss", "gpt-oss"))
    turn = {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
            "tool_calls": [_call("gpt-oss")]}
    text, opens = _generated(tok, "gpt-oss", turn, "<|call|>")  # <|call|> is an EOS: /generate trims it
    assert text.startswith("<|channel|>analysis<|message|>")  # the prompt ended with <|start|>assistant
    parsed = parse_turn("gpt-oss", text, opens_think=opens, finish_reason="stop", call_id_seed="s")
    assert (parsed.reasoning, parsed.content, parsed.tool_call_errors) == ("I need the weather tool.", "", 0)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("family", ["deepseek-r1", "deepseek-v3", "gpt-oss"])
def test_lossy_templates_drop_the_reasoning_of_an_answer(tmp_path: Path, family: str) -> None:
    tok = load_tokenizer(build_family_tokenizer(tmp_path / family, family))
    whole = tok.apply_chat_template([*PROMPT, {"role": "assistant", "content": "It is sunny.",
                                               "reasoning_content": "Easy."}], tokenize=False)
    assert "It is sunny." in whole and "Easy." not in whole


def test_earlier_reasoning_is_dropped_by_qwen3(tmp_path: Path) -> None:
    tok = load_tokenizer(build_family_tokenizer(tmp_path / "qwen3", "qwen3"))
    conversation = [*PROMPT, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Old thought."},
                    {"role": "user", "content": "And tomorrow?"}]
    text = tok.decode(Renderer(tok).render(conversation).input_ids, skip_special_tokens=False)
    assert "Old thought." not in text and "Sunny." in text


@pytest.mark.parametrize("family", FAMILIES)
def test_markers_survive_decoding_unless_the_parser_needs_special_tokens(tmp_path: Path, family: str) -> None:
    """The run's skip_special_tokens, decided from its tokenizer, keeps every marker the parser reads: false where
    one is a special token (harmony's, Kimi-K2's call section, as in the real tokenizers), true (SGLang's default)
    where the markers survive decoding anyway."""
    marker = MARKERS[family]
    tok = load_tokenizer(build_family_tokenizer(tmp_path / family, family))
    ids = tok.encode(f"a{marker}b", add_special_tokens=False)
    kept = marker in tok.decode(ids, skip_special_tokens=True)
    skip = skip_special_tokens_default(family, tok)
    assert kept is skip
    assert marker in tok.decode(ids, skip_special_tokens=skip)
    assert skip is (family not in ("gpt-oss", "kimi_k2"))
    assert skip_special_tokens_for(family) is (family != "gpt-oss")  # the worker's rule, without a tokenizer
