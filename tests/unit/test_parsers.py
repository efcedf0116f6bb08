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

from budget.record import OTHER_VERSION, VERSION
from tests.families import FAMILIES, build_family_tokenizer
from worker.reasoning import PARSERS, ParsedTurn, call_id, parse_turn, skip_special_tokens_for

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


def test_a_chunk_naming_an_unknown_parser_is_refused_before_generating() -> None:
    from worker.rqworker import run_chunk
    chunk: Any = {"v": VERSION, "dataset": "ds", "chunk": "c", "sampling_params": {}, "think": None, "samples": [],
                  "reasoning_parser": "qwen4"}
    with pytest.raises(ValueError, match="reasoning_parser 'qwen4' is not one this worker knows"):
        run_chunk(chunk)


@pytest.mark.parametrize("version", [None, 1, 2, 3, VERSION + 1])
def test_a_chunk_of_another_version_is_refused_before_generating(version: int | None) -> None:
    from worker.rqworker import run_chunk
    chunk: Any = {"v": version, "dataset": "ds", "chunk": "c", "sampling_params": {}, "think": None,
                  "samples": [], "reasoning_parser": "qwen3"}
    with pytest.raises(ValueError, match=f"version {version!r}, this worker runs {VERSION}: {OTHER_VERSION}"):
        run_chunk(chunk)


def test_a_multi_turn_sample_without_a_conversation_block_is_refused() -> None:
    from worker.rqworker import run_chunk
    chunk: Any = {"v": VERSION, "dataset": "ds", "chunk": "c", "sampling_params": {}, "think": None,
                  "reasoning_parser": "qwen3", "samples": [{"id": "a", "input_ids": [1], "opens_think": False,
                                                            "messages": [], "turns": 2}]}
    with pytest.raises(ValueError, match="multi-turn samples without a conversation block"):
        run_chunk(chunk)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_tokenizer_builds(tmp_path: Path, family: str) -> None:
    from render.chat import Renderer, load_tokenizer
    tok = load_tokenizer(build_family_tokenizer(tmp_path / family, family))
    rendered = Renderer(tok).render([{"role": "user", "content": "Hi"}])
    assert rendered.input_ids
    assert rendered.opens_think is (family == "qwen3-thinking")


W = {"city": "Paris"}
QW = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QW2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
QBAD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'

QWEN3 = [
    Case("thinking", "<think>\nLet me add.\n</think>\n\n2 + 2 = 4.", "Let me add.", "2 + 2 = 4."),
    Case("thinking off (the prompt closed an empty block)", "2 + 2 = 4.", "", "2 + 2 = 4."),
    Case("empty block written by the model", "<think>\n\n</think>\n\nHi!", "", "Hi!"),
    Case("truncated in reasoning", "<think>\nFirst, I", "First, I", "", finish="length", truncated=True,
         unclosed=True),
    Case("unclosed at EOS", "<think>\nThe answer is 4.", "The answer is 4.", "", unclosed=True,
         why="SGLang puts it all in reasoning too (sgl-project/sglang#37645) but says nothing: budgetq flags it"),
    Case("tool call after thinking", f"<think>\nNeed the weather.\n</think>\n\n{QW}", "Need the weather.", "",
         calls=[fn("get_weather", W)]),
    Case("tool call ends reasoning without </think>", f"<think>\nNeed the weather.\n{QW}", "Need the weather.", "",
         calls=[fn("get_weather", W)]),
    Case("tool call without thinking", QW, "", "", calls=[fn("get_weather", W)]),
    Case("text before the call", f"Let me check.\n{QW}", "", "Let me check.", calls=[fn("get_weather", W)]),
    Case("two calls", f"<think>\nBoth.\n</think>\n\n{QW}\n{QW2}", "Both.", "",
         calls=[fn("get_weather", W), fn("get_time", {"tz": "CET"}, 1)]),
    Case("repeated opening tags", "<think><think>\nhmm\n</think>\n\nok", "hmm", "ok"),
    Case("opening tag late", "Okay. <think>hmm</think>ok", "Okay. hmm", "ok",
         why="SGLang keeps the literal '<think>' inside the reasoning ('Okay. <think>hmm'); budgetq removes it, "
             "or the template would render a nested tag"),
    Case("malformed call", f"<think>\nx\n</think>\n\n{QBAD}", "x", QBAD, errors=1,
         why="SGLang logs and drops the call and its text; budgetq keeps the text and counts it"),
    Case("call cut off", '<tool_call>\n{"name": "get_wea', "", '<tool_call>\n{"name": "get_wea', finish="length",
         errors=1),
    Case("end tag without an opening one", "hmm</think>ok", "", "hmm</think>ok"),
    Case("arguments written as a JSON string", '<tool_call>\n{"name": "get_weather", "arguments": '
         '"{\\"city\\": \\"Paris\\"}"}\n</tool_call>', "", "", calls=[fn("get_weather", W)],
         why="SGLang would json.dumps the string again (arguments '\"{...}\"'); budgetq reads the object"),
    Case("arguments that are not an object", '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
         "", '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>', errors=1,
         why="OpenAI's arguments are a JSON object; SGLang passes '[1]' on"),
    Case("the prompt opened <think>", "Let me add.\n</think>\n\n4", "Let me add.", "4", opens_think=True),
    Case("thinking on but the model wrote no tag", "The answer is 4.", "", "The answer is 4.",
         why="SGLang forces reasoning when the template's enable_thinking defaults on, so this would be all "
             "reasoning; budgetq forces it only when the prompt it rendered ends inside <think> (opens_think)"),
]

QWEN3_THINKING = [
    Case("prompt opened <think>", "Let me add.\n</think>\n\n4", "Let me add.", "4", opens_think=True),
    Case("forced even when the prompt did not open it", "Let me add.\n</think>\n\n4", "Let me add.", "4"),
    Case("model repeats the tag", "<think>\nhmm\n</think>\n\nok", "hmm", "ok", opens_think=True),
    Case("truncated", "I need to", "I need to", "", opens_think=True, finish="length", truncated=True,
         unclosed=True),
    Case("unclosed at EOS", "The answer is 4.", "The answer is 4.", "", opens_think=True, unclosed=True),
    Case("tool call after thinking", f"Need the weather.\n</think>\n\n{QW}", "Need the weather.", "",
         opens_think=True, calls=[fn("get_weather", W)]),
    Case("tool call without </think>", f"Need the weather.\n{QW}", "Need the weather.", "", opens_think=True,
         calls=[fn("get_weather", W)]),
    Case("empty reasoning", "\n</think>\n\n4", "", "4", opens_think=True),
    Case("malformed call", f"x\n</think>\n\n{QBAD}", "x", QBAD, opens_think=True, errors=1,
         why="the call's text is kept and counted (SGLang drops it)"),
    Case("two calls", f"x\n</think>\n\n{QW}\n{QW2}", "x", "", opens_think=True,
         calls=[fn("get_weather", W), fn("get_time", {"tz": "CET"}, 1)]),
    Case("text between calls kept", f"x\n</think>\n\n{QW}\nand\n{QW2}", "x", "and", opens_think=True,
         calls=[fn("get_weather", W), fn("get_time", {"tz": "CET"}, 1)],
         why="SGLang keeps only the text before the first call; budgetq keeps all text that is not a call"),
    Case("repeated tags", "<think><think>hmm</think>ok", "hmm", "ok", opens_think=True),
]

DSW = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
       '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DSBAD = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": Paris}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DS31W = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
         "<｜tool▁calls▁end｜>")

DEEPSEEK_R1 = [
    Case("older template: no <think> in the prompt", "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.",
         "The answer is 4."),
    Case("R1-0528 writes the tag", "<think>\nLet me think.\n</think>\n\n4", "Let me think.", "4"),
    Case("the prompt opened <think>", "Let me think.\n</think>\n\n4", "Let me think.", "4", opens_think=True),
    Case("truncated", "Let me", "Let me", "", finish="length", truncated=True, unclosed=True),
    Case("unclosed at EOS", "The answer is 4.", "The answer is 4.", "", unclosed=True),
    Case("tool call after thinking", f"Need the weather.\n</think>\n\n{DSW}", "Need the weather.", "",
         calls=[fn("get_weather", W)]),
    Case("tool call before </think> stays reasoning", f"Need the weather.\n{DSW}", f"Need the weather.\n{DSW}", "",
         unclosed=True),  # DeepSeekR1Detector has no tool start token: parity
    Case("repeated tags", "<think><think>x</think>y", "x", "y"),
    Case("malformed call", f"x</think>{DSBAD}", "x", DSBAD, errors=1, why="kept and counted (SGLang drops it)"),
    Case("text before the call", f"x</think>Checking.{DSW}", "x", "Checking.", calls=[fn("get_weather", W)]),
    Case("empty reasoning", "</think>4", "", "4"),
    Case("V3.1-style call", f"x</think>{DS31W}", "x", "", calls=[fn("get_weather", W)]),
]

DEEPSEEK_V3 = [
    Case("thinking on: the prompt ends with <think>", "hmm</think>The answer.", "hmm", "The answer.",
         opens_think=True),
    Case("thinking off: the prompt ends with </think>", "The answer.", "", "The answer."),
    Case("thinking on, truncated", "hm", "hm", "", opens_think=True, finish="length", truncated=True,
         unclosed=True),
    Case("thinking on, unclosed at EOS", "hm", "hm", "", opens_think=True, unclosed=True),
    Case("thinking off, a stray </think> stays text", "a</think>b", "", "a</think>b"),
    Case("V3.1 tool call without thinking", DS31W, "", "", calls=[fn("get_weather", W)]),
    Case("V3.1 tool call after thinking", f"Need it.</think>{DS31W}", "Need it.", "", opens_think=True,
         calls=[fn("get_weather", W)]),
    Case("<tool_call> ends reasoning (Qwen3Detector subclass)", f"hmm{QW}", "hmm", QW, opens_think=True),
    Case("malformed V3.1 call", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{city}"
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{city}<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>", errors=1),
    Case("repeated tags", "<think><think>x</think>y", "x", "y", opens_think=True),
    Case("thinking on, the model writes the tag itself", "<think>x</think>y", "x", "y"),
    Case("V3 call format", f"x</think>{DSW}", "x", "", opens_think=True, calls=[fn("get_weather", W)]),
]

GW = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
GLM45 = [
    Case("thinking", "\n<think>Let me see.</think>\nIt is 4.", "Let me see.", "It is 4."),
    Case("thinking off (<think></think> in the prompt)", "\nIt is 4.", "", "It is 4."),
    Case("tool call after thinking", f"\n<think>Need the weather.</think>\n{GW}", "Need the weather.", "",
         calls=[fn("get_weather", W)]),
    Case("tool call ends reasoning without </think>", f"\n<think>Need the weather.\n{GW}", "Need the weather.", "",
         calls=[fn("get_weather", W)]),
    Case("tool call without thinking", f"\n{GW}", "", "", calls=[fn("get_weather", W)]),
    Case("values typed from their text", "<tool_call>book\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
         "<arg_key>refundable</arg_key>\n<arg_value>true</arg_value>\n<arg_key>price</arg_key>\n"
         "<arg_value>3.5</arg_value>\n<arg_key>who</arg_key>\n<arg_value>{\"name\": \"Ann\"}</arg_value>\n"
         "<arg_key>note</arg_key>\n<arg_value>window seat</arg_value>\n</tool_call>", "", "",
         calls=[fn("book", {"days": 3, "refundable": True, "price": 3.5, "who": {"name": "Ann"},
                            "note": "window seat"})],
         why="workers do not see the request's tool schemas, so '3' is 3 even if the schema says string "
             "(SGLang without a schema entry does the same); the GLM template renders 3 and '3' alike"),
    Case("two calls", f"{GW}\n<tool_call>get_time\n</tool_call>", "", "",
         calls=[fn("get_weather", W), fn("get_time", {}, 1)]),
    Case("call without a newline", "<tool_call>get_time</tool_call>", "", "", calls=[fn("get_time", {})],
         why="SGLang's regex needs a newline after the name and drops this call; it is a complete call"),
    Case("truncated in reasoning", "\n<think>Let", "Let", "", finish="length", truncated=True, unclosed=True),
    Case("unclosed at EOS", "\n<think>It is 4.", "It is 4.", "", unclosed=True),
    Case("Hermes JSON inside GLM's tags is not a GLM call", '<tool_call>{"name": "get_weather"}</tool_call>', "",
         '<tool_call>{"name": "get_weather"}</tool_call>', errors=1,
         why="kept and counted (SGLang drops it)"),
    Case("repeated tags", "<think><think>x</think>y", "x", "y"),
    Case("literal backslash-n separators", "<tool_call>get_weather\\n<arg_key>city</arg_key>\\n"
         "<arg_value>Paris</arg_value>\\n</tool_call>", "", "", calls=[fn("get_weather", W)]),
    Case("the prompt opened <think>", "hmm</think>\nok", "hmm", "ok", opens_think=True),
]

KIMI = [
    Case("thinking", "◁think▷Let me see.◁/think▷It is 4.", "Let me see.", "It is 4."),
    Case("no thinking", "It is 4.", "", "It is 4."),
    Case("truncated", "◁think▷Let", "Let", "", finish="length", truncated=True, unclosed=True),
    Case("unclosed at EOS", "◁think▷It is 4.", "It is 4.", "", unclosed=True),
    Case("repeated tags", "◁think▷◁think▷x◁/think▷y", "x", "y"),
    Case("<think> is not Kimi's tag", "<think>x</think>y", "", "<think>x</think>y"),
    Case("the prompt opened the block", "hmm◁/think▷answer", "hmm", "answer", opens_think=True,
         why="KimiDetector never forces reasoning, so SGLang would return it all as content; budgetq knows the "
             "prompt opened the block"),
    Case("no tool-call format", QW, "", QW),
    Case("multi-line reasoning", "◁think▷\nStep 1.\nStep 2.\n◁/think▷\n\nDone.", "Step 1.\nStep 2.", "Done."),
    Case("end tag without an opening one", "x◁/think▷y", "", "x◁/think▷y"),
    Case("empty block", "◁think▷◁/think▷y", "", "y"),
    Case("opening tag late", "So ◁think▷x◁/think▷y", "So x", "y", why="the literal tag is removed (see qwen3)"),
]

KB, KE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KW = '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
KT = '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|>'
KIMI_K2 = [
    Case("thinking", "<think>hmm</think>It is 4.", "hmm", "It is 4."),
    Case("no thinking", "It is 4.", "", "It is 4."),
    Case("tool call after thinking", f"<think>Need the weather.</think>{KB}{KW}{KE}", "Need the weather.", "",
         calls=[fn("get_weather", W, id_="functions.get_weather:0")]),
    Case("call section ends reasoning without </think>", f"<think>Need the weather.{KB}{KW}{KE}",
         "Need the weather.", "", calls=[fn("get_weather", W, id_="functions.get_weather:0")]),
    Case("two calls", f"{KB}{KW}{KT}{KE}", "", "",
         calls=[fn("get_weather", W, id_="functions.get_weather:0"), fn("get_time", {"tz": "CET"},
                                                                         id_="functions.get_time:1")]),
    Case("the model's own counter is the id", f"{KB}{KW.replace(':0', ':2')}{KE}", "", "",
         calls=[fn("get_weather", W, id_="functions.get_weather:2")],
         why="SGLang renumbers from the calls in the request's history; workers do not see the history, and the "
             "Kimi template renders the id back, so the model's own id is kept"),
    Case("text before the section", f"Let me check.{KB}{KW}{KE}", "", "Let me check.",
         calls=[fn("get_weather", W, id_="functions.get_weather:0")]),
    Case("bare counter id", f"{KB}<|tool_call_begin|>3<|tool_call_argument_begin|>{{}}<|tool_call_end|>{KE}", "",
         f"{KB}<|tool_call_begin|>3<|tool_call_argument_begin|>{{}}<|tool_call_end|>{KE}", errors=1,
         why="SGLang guesses the name from the request's tools, which workers do not have"),
    Case("malformed arguments", f"{KB}<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         f'{{"city": }}<|tool_call_end|>{KE}', "",
         f'{KB}<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{{"city": }}<|tool_call_end|>'
         f"{KE}", errors=1, why="SGLang passes the invalid JSON on as arguments; budgetq keeps it as text"),
    Case("truncated in reasoning", "<think>hm", "hm", "", finish="length", truncated=True, unclosed=True),
    Case("unclosed at EOS", "<think>hm", "hm", "", unclosed=True),
    Case("section never closed", f"{KB}{KW}", "", "", calls=[fn("get_weather", W, id_="functions.get_weather:0")]),
    Case("repeated tags", "<think><think>x</think>y", "x", "y"),
]

HA = "<|channel|>analysis<|message|>"
HCALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
GPT_OSS = [
    Case("analysis then final", f"{HA}User asks 2+2.<|end|><|start|>assistant<|channel|>final<|message|>4",
         "User asks 2+2.", "4"),
    Case("final only", "<|channel|>final<|message|>4", "", "4"),
    Case("truncated in analysis", f"{HA}Let me", "Let me", "", finish="length", truncated=True, unclosed=True),
    Case("analysis never closed at EOS", f"{HA}hmm", "hmm", "", unclosed=True),
    Case("tool call after analysis, <|call|> trimmed as EOS", f'{HA}Need the weather.<|end|>{HCALL}{{"city":"Paris"}}',
         "Need the weather.", "", calls=[fn("get_weather", W)],
         why="<|call|> is an EOS token that /generate trims; SGLang's harmony parser then holds the block as "
             "incomplete and loses the call; budgetq knows the finish reason was stop"),
    Case("tool call with its <|call|>", f'{HA}x<|end|>{HCALL}{{"city":"Paris"}}<|call|>', "x", "",
         calls=[fn("get_weather", W)]),
    Case("recipient in the role header", ' to=functions.get_weather<|channel|>commentary json<|message|>'
         '{"city": "Paris"}', "", "", calls=[fn("get_weather", W)]),
    Case("commentary preamble then a call", "<|channel|>commentary<|message|>Checking the weather.<|end|>"
         f'{HCALL}{{"city": "Paris"}}', "", "Checking the weather.", calls=[fn("get_weather", W)]),
    Case("malformed arguments", f"{HCALL}{{city: Paris}}", "", "{city: Paris}", errors=1,
         why="kept and counted (SGLang drops it)"),
    Case("call cut off by length", f'{HCALL}{{"city": "Pa', "", '{"city": "Pa', finish="length", errors=1),
    Case("markers deleted by skip_special_tokens", "analysisUser asks.assistantfinal4", "User asks.", "4"),
    Case("no markers at all", "4", "", "4",
         why="SGLang's harmony parser waits for a marker and returns nothing; budgetq keeps the text"),
    Case("final with its <|return|>", f"{HA}x<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
         "x", "4"),
]

NONE = [
    Case("plain", "Hello!", None, "Hello!"),
    Case("think tags are text", "<think>x</think>y", None, "<think>x</think>y"),
    Case("tool calls are text", QW, None, QW),
]

CORPUS = {"qwen3": QWEN3, "qwen3-thinking": QWEN3_THINKING, "deepseek-r1": DEEPSEEK_R1, "deepseek-v3": DEEPSEEK_V3,
          "glm45": GLM45, "kimi": KIMI, "kimi_k2": KIMI_K2, "gpt-oss": GPT_OSS, "none": NONE}


def test_corpus_covers_every_parser() -> None:
    assert sorted(CORPUS) == sorted(PARSERS)
    assert all(len(cases) >= 12 for parser, cases in CORPUS.items() if parser != "none")


@pytest.mark.parametrize(("parser", "case"), [(p, c) for p, cases in CORPUS.items() for c in cases],
                         ids=[f"{p}-{c.name}" for p, cases in CORPUS.items() for c in cases])
def test_parity(parser: str, case: Case) -> None:
    check(parser, case)


PIECES = ("<think>", "</think>", "◁think▷", "◁/think▷", "<tool_call>", "</tool_call>", "\n", "\\n", " ", "{", "}",
          '"name"', '"arguments"', ":", ",", '"get_weather"', "<arg_key>", "</arg_key>", "<arg_value>",
          "</arg_value>", "city", "Paris", "3", "[", "]", "'", "(", KB, KE, "<|tool_call_begin|>",
          "<|tool_call_argument_begin|>", "<|tool_call_end|>", "functions.get_weather:0", "<|start|>", "<|channel|>",
          "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>", "analysis", "final", "commentary",
          " to=functions.f", "json", "assistantfinal", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
          "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "function", "```json\n", "\n```", "1e999",
          "None", "\x00", "é")


@pytest.mark.parametrize("parser", PARSERS)
def test_no_completion_makes_a_parser_raise(parser: str) -> None:
    """A parser runs on every response a worker commits: whatever the model wrote, it returns a turn, and the
    text it did not turn into reasoning or calls is still there."""
    import random
    rng = random.Random(parser)
    for _ in range(1500):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
        got = parse_turn(parser, text, opens_think=rng.random() < 0.5,
                         finish_reason=rng.choice(("stop", "length")), call_id_seed="s")
        assert isinstance(got.content, str) and got.tool_call_errors >= 0
        for call in got.tool_calls:
            assert isinstance(json.loads(call["function"]["arguments"]), dict), (parser, text)
