"""Tool calls of a regenerated turn, parsed into OpenAI-shape ``tool_calls`` as SGLang's function-call parsers do.

Each family writes calls its own way (formats read from sglang 0.5.23, ``sglang/srt/function_call/``):

- ``hermes`` (Qwen2.5/Qwen3, ``qwen25_detector.py`` / ``hermes_detector.py``):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``glm45`` (``glm4_moe_detector.py``):
  ``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>``;
- ``kimi_k2`` (``kimik2_detector.py``): ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>``;
- ``deepseek`` (``deepseekv3_detector.py``, ``deepseekv31_detector.py``): inside
  ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>``, V3/R1 write ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json
  \\n{...}\\n```<｜tool▁call▁end｜>`` and V3.1 ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.

(gpt-oss calls are harmony ``commentary`` messages: worker/harmony.py parses them with the channels.)

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
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Final

#: tool-call format -> the text that starts a call; also what ends reasoning early for qwen3/glm45/kimi_k2.
HERMES_START: Final = "<tool_call>"
KIMI_SECTION_BEGIN: Final = "<|tool_calls_section_begin|>"
KIMI_SECTION_END: Final = "<|tool_calls_section_end|>"
DS_CALLS_BEGIN: Final = "<｜tool▁calls▁begin｜>"
DS_CALLS_END: Final = "<｜tool▁calls▁end｜>"

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
