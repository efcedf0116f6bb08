"""Split a response into reasoning, answer and tool calls, per model family, as SGLang's parsers do.

``parse_turn(parser, ...)`` parses with the chunk's ``reasoning_parser`` (``--reasoning-parser`` of ``produce``,
the word a user passes to ``sglang.launch_server --reasoning-parser``). Reasoning is split as sglang 0.5.23
``sglang/srt/parser/reasoning_parser.py`` splits it, tool calls parsed as its ``sglang/srt/function_call/``
detectors parse them (worker/toolcalls.py, worker/harmony.py).

SGLang applies its parser on the chat-completions path and guesses whether the prompt opened a thinking block
("force_reasoning", from the template and request kwargs). budgetq calls raw ``/generate`` and knows: the producer
renders the prompt and tells, per sample, whether it ends inside an open thinking tag (``opens_think``,
render/chat.py ``Renderer._opens_think``). Where that is better it is used (``_FORCED`` below says where);
docs/models.md lists every difference from SGLang.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Mapping

from budget.payload import REASONING_PARSERS
from worker.harmony import parse_harmony
from worker.toolcalls import HERMES_START, KIMI_SECTION_BEGIN, parse_tool_calls

PARSERS: Final[tuple[str, ...]] = REASONING_PARSERS  # SGLang's names; budget/payload.py holds the list


@dataclass(frozen=True)
class ParsedTurn:
    reasoning: str | None  # None: parser "none" (the model does not think)
    content: str
    reasoning_truncated: bool  # finish_reason == "length" while still inside reasoning
    reasoning_unclosed: bool  # the reasoning block never closed (whatever the finish reason)
    tool_calls: list[dict[str, Any]]  # OpenAI shape: {"id", "type": "function", "function": {"name", "arguments"}}
    tool_call_errors: int  # calls that looked like calls but did not parse (their text stays in content)


@dataclass(frozen=True)
class _Family:
    start: str
    end: str
    tool_start: str | None  # a tool call that ends reasoning even without the end tag
    tool_format: str | None  # worker/toolcalls.py FORMATS key


_FAMILIES: Final[dict[str, _Family]] = {
    # Qwen3Detector: <tool_call> ends reasoning; the qwen25/hermes tool parser.
    "qwen3": _Family("<think>", "</think>", HERMES_START, "hermes"),
    "qwen3-thinking": _Family("<think>", "</think>", HERMES_START, "hermes"),
    # DeepSeekR1Detector has no tool start; the deepseekv3 tool parser.
    "deepseek-r1": _Family("<think>", "</think>", None, "deepseek"),
    # _DeepSeekV3Detector subclasses Qwen3Detector, so <tool_call> ends its reasoning too (kept for parity).
    "deepseek-v3": _Family("<think>", "</think>", HERMES_START, "deepseek"),
    "glm45": _Family("<think>", "</think>", HERMES_START, "glm45"),
    # KimiDetector (Kimi-VL-Thinking): no tool format.
    "kimi": _Family("\u25c1think\u25b7", "\u25c1/think\u25b7", None, None),
    "kimi_k2": _Family("<think>", "</think>", KIMI_SECTION_BEGIN, "kimi_k2"),
}

#: Parsers for which reasoning starts at the first generated token whatever the prompt: SGLang forces reasoning
#: for them unconditionally (DeepSeekR1Detector hard-codes it; ReasoningParser forces qwen3-thinking, and
#: gpt-oss, whose harmony channels worker/harmony.py reads). Older R1 templates put no <think> in the prompt yet the model thinks first, so opens_think would be
#: wrong there. For every other parser reasoning is forced exactly when budgetq's rendered prompt ends inside an
#: open thinking tag (opens_think): SGLang approximates that from the template's toggle and the request's
#: chat_template_kwargs (qwen3/glm45/kimi_k2 default to "thinking on", so a reply without any tag would be all
#: reasoning there), while budgetq reads the prompt it actually sent.
_FORCED: Final = frozenset({"qwen3-thinking", "deepseek-r1"})


#: The special tokens that end a turn in each family's template: its EOS and the other stop ids of its
#: generation_config (Qwen3: both ChatML ends; GLM-4.5: the next role tokens it stops at; Kimi: ``<|im_end|>``
#: and ``[EOS]``). With ``skip_special_tokens`` false the text keeps every special token; SGLang trims only the
#: stop token it matched, and its parsers take out only their own markers (KimiK2Detector's tool-call tokens), so
#: one the model wrote without stopping on it (not a stop id of the server) would reach the answer, and a trainer
#: rendering the turn would write the template's end of turn after it again. None is ever a parser's marker
#: (producer/parsers.py ``PARSER_TEXT_MARKERS``, tests/unit/test_end_tokens.py); harmony's ``<|return|>`` and
#: ``<|call|>`` are gpt-oss's markers, read by worker/harmony.py. ``none``: the family is unknown, so every family's.
_FAMILY_ENDS: Final[dict[str, tuple[str, ...]]] = {
    "qwen3": ("<|im_end|>", "<|endoftext|>"),
    "qwen3-thinking": ("<|im_end|>", "<|endoftext|>"),
    "deepseek-r1": ("<\uff5cend\u2581of\u2581sentence\uff5c>",),
    "deepseek-v3": ("<\uff5cend\u2581of\u2581sentence\uff5c>",),
    "glm45": ("<|endoftext|>", "<|user|>", "<|observation|>"),
    "kimi": ("<|im_end|>", "[EOS]"),
    "kimi_k2": ("<|im_end|>", "[EOS]"),
    "gpt-oss": ("<|endoftext|>",),
}
END_OF_TURN_TOKENS: Final[Mapping[str, tuple[str, ...]]] = {
    **_FAMILY_ENDS, "none": tuple(dict.fromkeys(t for ends in _FAMILY_ENDS.values() for t in ends))}


def strip_end_of_turn(parser: str, text: str) -> str:
    """``text`` without the family's end-of-turn special tokens (END_OF_TURN_TOKENS), wherever they are."""
    for token in END_OF_TURN_TOKENS[parser]:
        text = text.replace(token, "")
    return text


def skip_special_tokens_for(parser: str) -> bool:
    """The ``skip_special_tokens`` a parser needs: False for gpt-oss, whose harmony markers are special tokens
    (SGLang's chat path sets the same for gpt-oss); True, SGLang's default, for the others, whose markers are
    added tokens that are not special (they survive decoding)."""
    return parser != "gpt-oss"


def _strip_start(text: str, start: str) -> str:
    """The opening tag(s) removed: SGLang strips repeated ones at the start; budgetq also lets whitespace sit
    between them and removes a tag found later (SGLang would leave "<think>" inside the reasoning text)."""
    return text.replace(start, "")


def parse_turn(parser: str, text: str, *, opens_think: bool, finish_reason: str,
               call_id_seed: str | None = None, special_tokens: bool = False) -> ParsedTurn:
    """Parse one generated turn with `parser` (one of PARSERS).

    `call_id_seed` names the sample (tool-call ids are derived from it and the call's index, so a rerun gets the
    same ids); without it the text itself seeds them. Reasoning and content are stripped of surrounding
    whitespace (SGLang returns them as generated; the chat templates strip them when they render them back).
    `special_tokens`: the text keeps special tokens (the request sent ``skip_special_tokens`` false), so the
    family's end-of-turn tokens are taken out of every parsed field (END_OF_TURN_TOKENS); with true SGLang
    deleted them all, and such a string in the text is text the model wrote, kept.
    """
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}: expected one of {', '.join(PARSERS)}")
    seed = text if call_id_seed is None else call_id_seed
    if special_tokens:
        text = strip_end_of_turn(parser, text)
    if parser == "none":
        return ParsedTurn(None, text.strip(), False, False, [], 0)
    if parser == "gpt-oss":
        turn = parse_harmony(text, finish_reason=finish_reason, seed=seed)
        return ParsedTurn(turn.reasoning, turn.content, turn.reasoning_unclosed and finish_reason == "length",
                          turn.reasoning_unclosed, turn.tool_calls, turn.tool_call_errors)
    family = _FAMILIES[parser]
    forced = parser in _FORCED or opens_think
    reasoning, answer, unclosed = _split(text, family, forced=forced)
    calls = parse_tool_calls(family.tool_format, answer, seed)
    return ParsedTurn(reasoning.strip(), calls.content.strip(),
                      unclosed and finish_reason == "length", unclosed, calls.calls, calls.errors)


def _split(text: str, family: _Family, *, forced: bool) -> tuple[str, str, bool]:
    """(reasoning, answer, unclosed), as BaseReasoningFormatDetector.detect_and_parse splits a whole text."""
    start = text.find(family.start)
    if not forced and start == -1:
        return "", text, False
    # Not forced and the tag comes late: SGLang keeps the text before it in the reasoning; so does budgetq.
    end = text.find(family.end)
    if end == -1:
        tool = text.find(family.tool_start) if family.tool_start else -1
        if tool != -1:
            return _strip_start(text[:tool], family.start), text[tool:], False
        # Never closed: everything is reasoning (SGLang too, sgl-project/sglang#37645), and flagged.
        return _strip_start(text, family.start), "", True
    return _strip_start(text[:end], family.start), text[end + len(family.end):], False
