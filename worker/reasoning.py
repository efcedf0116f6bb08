"""Split a response into reasoning, answer and tool calls, per model family, as SGLang's parsers do.

``parse_turn(parser, ...)`` parses with the chunk's ``reasoning_parser`` (``--reasoning-parser`` of ``produce``,
the word a user passes to ``sglang.launch_server --reasoning-parser``). Reasoning is split as sglang 0.5.23
``sglang/srt/parser/reasoning_parser.py`` splits it, tool calls parsed as its ``sglang/srt/function_call/``
detectors parse them (the two sections below).

SGLang applies its parser on the chat-completions path and guesses whether the prompt opened a thinking block
("force_reasoning", from the template and request kwargs). budgetq calls raw ``/generate`` and knows: the producer
renders the prompt and tells, per sample, whether it ends inside an open thinking tag (``opens_think``,
render/chat.py ``Renderer._opens_think``). Where that is better it is used (``_FORCED`` below says where);
docs/models.md lists every difference from SGLang.

**Tool calls** of a regenerated turn are parsed into OpenAI-shape ``tool_calls`` (``parse_tool_calls``). Each
family writes calls its own way (formats read from sglang 0.5.23, ``sglang/srt/function_call/``):

- ``hermes`` (Qwen2.5/Qwen3, ``qwen25_detector.py`` / ``hermes_detector.py``):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``glm45`` (``glm4_moe_detector.py``):
  ``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>``;
- ``kimi_k2`` (``kimik2_detector.py``): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>``;
- ``deepseek`` (``deepseekv3_detector.py``, ``deepseekv31_detector.py``): inside
  ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``, V3/R1 write ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json
  \\n{...}\\n```<｜tool▁call▁end｜>`` and V3.1 ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.

(gpt-oss calls are harmony ``commentary`` messages, parsed with the channels: next section.)

Where budgetq differs from SGLang, on purpose (docs/models.md lists them):

- A call that looks like a call but does not parse stays in ``content`` as text and is counted
  (``errors``); SGLang logs and drops it. Training data never loses text silently.
- SGLang keeps only the text before the first call as content; budgetq removes just the calls that parsed and
  keeps any text between or after them.
- The worker does not know the request's tool list (the producer renders it into the prompt), so every name is
  accepted (SGLang drops calls to unknown tools unless ``SGLANG_FORWARD_UNKNOWN_TOOLS``) and GLM argument values
  are typed from their text alone (``"42"`` -> 42), as SGLang does for an argument missing from the schema.
- Ids are deterministic: ``call_`` + 24 hex of sha256(seed, index), the seed naming the sample (SGLang draws a
  random uuid); Kimi-K2 keeps the model's own ``functions.NAME:IDX``, which its template renders back.

**gpt-oss (harmony)** completions (``parse_harmony``): the ``analysis`` channel is reasoning, ``final`` the
answer, a ``commentary`` message addressed ``to=functions.NAME`` a tool call.

Read from sglang 0.5.23 ``sglang/srt/parser/harmony_parser.py`` (HarmonyParser, CanonicalStrategy, TextStrategy)
and ``function_call/gpt_oss_detector.py``. A completion kept with its special tokens
(``skip_special_tokens=false``, which SGLang's chat path forces for gpt-oss) reads::

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...

(the prompt ends with ``<|start|>assistant``). ``<|return|>`` and ``<|call|>`` are end-of-sequence tokens, so
``/generate`` trims them from ``text``: a completion that ends a final answer or a tool call ends without its
terminator. Where budgetq differs from SGLang, on purpose:

- A commentary tool call whose ``<|call|>`` was trimmed (it is the EOS) still counts as a call when the finish
  reason is ``stop``: SGLang's canonical strategy wants the terminator and holds such a block back as incomplete,
  losing it; budgetq knows the finish reason. Cut off by ``length`` it is an unparsed call (counted, kept as text).
- An ``analysis`` block never closed is flagged ``reasoning_unclosed`` (SGLang streams it as reasoning and says
  nothing); a completion with no harmony markers at all is answer text (SGLang's parser waits for a marker and
  returns nothing).
- Several answer parts (a commentary preamble, then the final message) are joined by a blank line, each stripped.
- The text fallback (markers deleted by ``skip_special_tokens=true``: "analysis...assistantfinal...") is parsed as
  SGLang's TextStrategy does, so such a completion still splits; its tool calls cannot be recovered (the markers
  that framed them are gone).
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Final, Mapping

from budget.record import REASONING_PARSERS

#: tool-call format -> the text that starts a call; also what ends reasoning early for qwen3/glm45/kimi_k2.
HERMES_START: Final = "<tool_call>"
KIMI_SECTION_BEGIN: Final = "<|tool_calls_section_begin|>"
KIMI_SECTION_END: Final = "<|tool_calls_section_end|>"
DS_CALLS_BEGIN: Final = "<｜tool▁calls▁begin｜>"
DS_CALLS_END: Final = "<｜tool▁calls▁end｜>"

PARSERS: Final[tuple[str, ...]] = REASONING_PARSERS  # SGLang's names; budget/record.py holds the list


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
    tool_format: str | None  # a FORMATS key (below)


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
#: gpt-oss, whose harmony channels ``parse_harmony`` reads). Older R1 templates put no <think> in the prompt yet the
#: model thinks first, so opens_think would be wrong there. For every other parser reasoning is forced exactly when
#: budgetq's rendered prompt ends inside an open thinking tag (opens_think): SGLang approximates that from the
#: template's toggle and the request's chat_template_kwargs (qwen3/glm45/kimi_k2 default to "thinking on", so a
#: reply without any tag would be all reasoning there), while budgetq reads the prompt it actually sent.
_FORCED: Final = frozenset({"qwen3-thinking", "deepseek-r1"})


#: The special tokens that end a turn in each family's template: its EOS and the other stop ids of its
#: generation_config (Qwen3: both ChatML ends; GLM-4.5: the next role tokens it stops at; Kimi: ``<|im_end|>``
#: and ``[EOS]``). With ``skip_special_tokens`` false the text keeps every special token; SGLang trims only the
#: stop token it matched, and its parsers take out only their own markers (KimiK2Detector's tool-call tokens), so
#: one the model wrote without stopping on it (not a stop id of the server) would reach the answer, and a trainer
#: rendering the turn would write the template's end of turn after it again. None is ever a parser's marker
#: (producer/settings.py ``PARSER_TEXT_MARKERS``, tests/unit/test_end_tokens.py); harmony's ``<|return|>`` and
#: ``<|call|>`` are gpt-oss's markers, read by ``parse_harmony``. ``none``: the family is unknown, so every family's.
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


# -- tool calls --------------------------------------------------------------------------------------------------------
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>(?:\\n|\s)*<arg_value>(.*?)</arg_value>", re.DOTALL)
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[^\s<|]+)\s*<\|tool_call_argument_begin\|>\s*(?P<args>.*?)\s*"
    r"<\|tool_call_end\|>", re.DOTALL)
_KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w.\-]+):(?P<index>\d+)$")
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_DETAIL = re.compile(r"^function<｜tool▁sep｜>(.*?)\n```json\n(.*)\n```$", re.DOTALL)  # V3 / R1
_DS31_DETAIL = re.compile(r"^(.*?)<｜tool▁sep｜>(.*)$", re.DOTALL)  # V3.1: NAME<｜tool▁sep｜>{json}
_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")


@dataclass
class ToolCallResult:
    """The calls found in a turn's answer, the answer with them taken out, and the calls that did not parse."""

    content: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    errors: int = 0


def call_id(seed: str, index: int) -> str:
    """A deterministic OpenAI-style id: the same sample and index always get the same id on a rerun."""
    return "call_" + hashlib.sha256(f"{seed}\0{index}".encode()).hexdigest()[:24]


def _call(name: str, arguments: Any, id_: str) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}


def _remove(text: str, spans: list[tuple[int, int]]) -> str:
    out, last = [], 0
    for start, end in spans:
        out.append(text[last:start])
        last = end
    out.append(text[last:])
    return "".join(out)


def _object(arguments: Any) -> dict[str, Any] | None:
    """Arguments as the JSON object OpenAI's shape needs. SGLang's parse_base_json json.dumps whatever it finds;
    an object written as a JSON string is taken as that object, anything else (a list, a number) is not a call."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None


def _hermes(text: str, seed: str) -> ToolCallResult:
    if HERMES_START not in text:
        return ToolCallResult(text)
    result = ToolCallResult(text)
    spans: list[tuple[int, int]] = []
    for match in _HERMES_BLOCK.finditer(text):
        try:
            obj = json.loads(match.group(1).strip())
        except ValueError:
            obj = None
        name = obj.get("name") if isinstance(obj, dict) else None
        arguments = _object(obj.get("parameters") or obj.get("arguments", {})) if isinstance(obj, dict) else None
        if not isinstance(name, str) or not name or arguments is None:
            result.errors += 1
            continue
        result.calls.append(_call(name, arguments, call_id(seed, len(result.calls))))
        spans.append(match.span())
    # A <tool_call> never closed (truncated or malformed) looked like a call and did not parse.
    result.errors += text.count(HERMES_START) - len(_HERMES_BLOCK.findall(text))
    result.content = _remove(text, spans)
    return result


def glm_value(raw: str) -> Any:
    """An argument value as SGLang's ``parse_arguments`` types it when the schema is unknown: JSON, JSON inside a
    JSON string, a Python literal, else the text itself."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return json.loads(json.loads('{"tmp": "' + raw + '"}')["tmp"])
    except (ValueError, KeyError, TypeError):
        pass
    try:
        value = ast.literal_eval(raw)
        json.dumps(value)  # sets, bytes, complex: not JSON, keep the text
        return value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return raw


def _glm(text: str, seed: str) -> ToolCallResult:
    if HERMES_START not in text:
        return ToolCallResult(text)
    result = ToolCallResult(text)
    spans: list[tuple[int, int]] = []
    for match in _HERMES_BLOCK.finditer(text):
        body = match.group(1)
        name, _, args = _glm_split(body)
        name = name.strip()
        leftover = re.sub(r"(?:\\n|\s)+", "", _GLM_ARG.sub("", args))
        if not _NAME.match(name) or leftover:
            result.errors += 1
            continue
        arguments = {key.strip(): glm_value(value) for key, value in _GLM_ARG.findall(args)}
        result.calls.append(_call(name, arguments, call_id(seed, len(result.calls))))
        spans.append(match.span())
    result.errors += text.count(HERMES_START) - len(_HERMES_BLOCK.findall(text))
    result.content = _remove(text, spans)
    return result


def _glm_split(body: str) -> tuple[str, str, str]:
    """NAME, separator, arguments: the name ends at the first newline (or a literal backslash-n, as SGLang's
    regex allows); a call with no arguments may have no newline at all (SGLang skips that one)."""
    match = re.search(r"\\n|\n", body)
    if match is None:
        return (body, "", "") if "<arg_key>" not in body else ("", "", body)
    return body[:match.start()], match.group(), body[match.end():]


def _kimi_k2(text: str, seed: str) -> ToolCallResult:
    begin = text.find(KIMI_SECTION_BEGIN)
    if begin == -1:
        return ToolCallResult(text)
    end = text.find(KIMI_SECTION_END, begin)
    section_end = len(text) if end == -1 else end + len(KIMI_SECTION_END)
    inner_start, inner_end = begin + len(KIMI_SECTION_BEGIN), (len(text) if end == -1 else end)
    section = text[inner_start:inner_end]
    result = ToolCallResult(text)
    spans: list[tuple[int, int]] = []
    for match in _KIMI_CALL.finditer(section):
        id_match = _KIMI_ID.match(match.group("id"))
        try:
            arguments = json.loads(match.group("args"))
        except ValueError:
            arguments = None
        if id_match is None or not isinstance(arguments, dict):
            # A bare counter id ("3"): SGLang guesses the name from the request's tools, which workers don't have.
            result.errors += 1
            continue
        # The model's own id, as the Kimi-K2 template renders it back into the next turn's prompt.
        id_ = match.group("id")
        result.calls.append(_call(id_match.group("name"), match.group("args"), id_))
        spans.append(match.span())
    result.errors += section.count("<|tool_call_begin|>") - len(_KIMI_CALL.findall(section))
    rest = _remove(section, spans)
    if rest.strip():  # something in the section did not parse: it stays, inside the section's markers
        result.content = text[:inner_start] + rest + text[inner_end:]
    else:
        result.content = text[:begin] + text[section_end:]
    return result


def _deepseek(text: str, seed: str) -> ToolCallResult:
    if DS_CALLS_BEGIN not in text:
        return ToolCallResult(text)
    result = ToolCallResult(text)
    spans: list[tuple[int, int]] = []
    for match in _DS_CALL.finditer(text):
        detail = _DS_DETAIL.match(match.group(1)) or _DS31_DETAIL.match(match.group(1))
        name = detail.group(1).strip() if detail else ""
        try:
            arguments = json.loads(detail.group(2)) if detail else None
        except ValueError:
            arguments = None
        if not _NAME.match(name) or not isinstance(arguments, dict):
            result.errors += 1
            continue
        result.calls.append(_call(name, arguments, call_id(seed, len(result.calls))))
        spans.append(match.span())
    result.errors += text.count("<｜tool▁call▁begin｜>") - len(_DS_CALL.findall(text))
    content = _remove(text, spans)
    if result.errors == 0:
        content = content.replace(DS_CALLS_BEGIN, "").replace(DS_CALLS_END, "")
    result.content = content
    return result


FORMATS: Final[dict[str, Callable[[str, str], ToolCallResult]]] = {
    "hermes": _hermes, "glm45": _glm, "kimi_k2": _kimi_k2, "deepseek": _deepseek,
}


def parse_tool_calls(fmt: str | None, text: str, seed: str) -> ToolCallResult:
    """Take the calls of format `fmt` (a FORMATS key, or None: no tool calls) out of `text`."""
    if fmt is None:
        return ToolCallResult(text)
    return FORMATS[fmt](text, seed)


# -- gpt-oss (harmony) -------------------------------------------------------------------------------------------------
_MARKER: Final = re.compile(r"(<\|(?:start|channel|message|constrain|end|call|return)\|>)")
_RECIPIENT: Final = re.compile(r"to=([A-Za-z_][\w.\-]*)")
_TEXT_ANALYSIS_FINAL: Final = re.compile(
    r"^\s*(?:assistant)?\s*(analysis|commentary)(.*?)\s*assistantfinal\s*(.*)\s*$", re.IGNORECASE | re.DOTALL)
_TEXT_FINAL: Final = re.compile(r"^\s*assistantfinal\s*(.*)\s*$", re.IGNORECASE | re.DOTALL)
_TEXT_ANALYSIS: Final = re.compile(r"^\s*(?:assistant)?\s*(analysis|commentary)(.*)\s*$", re.IGNORECASE | re.DOTALL)


@dataclass
class HarmonyTurn:
    reasoning: str
    content: str
    reasoning_unclosed: bool = False
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_errors: int = 0


@dataclass
class _Message:
    header: str = ""
    body: str | None = None  # None until <|message|>
    end: str | None = None  # the terminator, None when the text ended first

    @property
    def channel(self) -> str | None:
        if "<|channel|>" not in self.header:
            return None
        words = self.header.split("<|channel|>", 1)[1].replace("<|constrain|>", " ").split()
        return words[0].lower() if words else None

    @property
    def recipient(self) -> str | None:
        match = _RECIPIENT.search(self.header)
        return match.group(1) if match else None


def _messages(text: str) -> tuple[list[_Message], list[str]]:
    """The harmony messages of `text`, and the loose text outside any message."""
    messages: list[_Message] = []
    loose: list[str] = []
    current: _Message | None = None
    for piece in _MARKER.split(text):
        if not piece:
            continue
        if piece == "<|start|>" or (piece == "<|channel|>" and (current is None or current.body is not None)):
            if current is not None:
                messages.append(current)  # a message cut short by the next one
            current = _Message()
            if piece == "<|channel|>":
                current.header = piece
        elif current is None:
            if piece not in ("<|end|>", "<|call|>", "<|return|>", "<|message|>", "<|constrain|>"):
                loose.append(piece)
        elif current.body is None:
            if piece == "<|message|>":
                current.body = ""
            elif piece in ("<|end|>", "<|call|>", "<|return|>"):
                current = None  # a header with no message: nothing to keep
            else:
                current.header += piece
        elif piece in ("<|end|>", "<|call|>", "<|return|>"):
            current.end = piece
            messages.append(current)
            current = None
        else:
            current.body = (current.body or "") + piece
    if current is not None and current.body is not None:
        messages.append(current)
    return messages, loose


def _text_fallback(text: str) -> HarmonyTurn:
    match = _TEXT_ANALYSIS_FINAL.match(text)
    if match:
        channel, middle, final = match.groups()
        if channel.lower() == "analysis":
            return HarmonyTurn(middle.strip(), final.strip())
        return HarmonyTurn("", "\n\n".join(p for p in (middle.strip(), final.strip()) if p))
    match = _TEXT_FINAL.match(text)
    if match:
        return HarmonyTurn("", match.group(1).strip())
    match = _TEXT_ANALYSIS.match(text)
    if match:
        channel, middle = match.groups()
        if channel.lower() == "analysis":
            return HarmonyTurn(middle.strip(), "", reasoning_unclosed=True)
        return HarmonyTurn("", middle.strip())
    return HarmonyTurn("", text.strip())


def parse_harmony(text: str, *, finish_reason: str, seed: str) -> HarmonyTurn:
    """Split a gpt-oss completion into reasoning, answer and tool calls."""
    if "<|channel|>" not in text and "<|start|>" not in text:
        return _text_fallback(text)
    # The prompt ended with "<|start|>assistant": put it back, so a recipient the model wrote before its first
    # <|channel|> (" to=functions.NAME<|channel|>commentary json<|message|>...") stays in that message's header.
    messages, loose = _messages(text if text.startswith("<|start|>") else "<|start|>assistant" + text)
    reasoning: list[str] = []
    content: list[str] = [part.strip() for part in loose]
    turn = HarmonyTurn("", "")
    for index, message in enumerate(messages):
        last = index == len(messages) - 1
        body = message.body or ""
        recipient = message.recipient
        if recipient is not None and recipient.startswith("functions."):
            closed = message.end == "<|call|>" or (last and message.end is None and finish_reason == "stop")
            try:
                arguments = json.loads(body) if body.strip() else {}
            except ValueError:
                arguments = None
            if closed and isinstance(arguments, dict):
                name = recipient.split(".")[-1]
                turn.tool_calls.append({
                    "id": call_id(seed, len(turn.tool_calls)), "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
            else:
                turn.tool_call_errors += 1
                content.append(body.strip())
        elif message.channel == "analysis":
            reasoning.append(body.strip())
            if last and message.end is None:
                turn.reasoning_unclosed = True
        else:  # final, a commentary preamble, or a message without a channel
            content.append(body.strip())
    turn.reasoning = "\n\n".join(part for part in reasoning if part)
    turn.content = "\n\n".join(part for part in content if part)
    return turn
