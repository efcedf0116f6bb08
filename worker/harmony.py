"""gpt-oss (harmony) completions: the ``analysis`` channel is reasoning, ``final`` the answer, a ``commentary``
message addressed ``to=functions.NAME`` a tool call.

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
  TextStrategy does, so records written before budgetq kept the markers still split; their tool calls cannot be
  recovered (the markers that framed them are gone).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Final

from worker.toolcalls import call_id

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
