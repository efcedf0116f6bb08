"""Split a response into reasoning and answer using the thinking markers the producer found in the template.

SGLang returns only what the model generated. When the rendered prompt already ends with an open ``<think>``
(Qwen3-Thinking, QwQ, DeepSeek-R1 templates) the text holds ``reasoning</think>answer`` and the opening tag is
in the prompt, not the text: treating that text as plain answer would lose the reasoning or mis-split it.
A response cut off by ``length`` before ``</think>`` keeps all its text as reasoning and says so
(``reasoning_truncated``): training data is never silently emptied.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the template has no thinking markers
    content: str
    reasoning_truncated: bool


def split_reasoning(text: str, *, start: str | None, end: str | None, opens_think: bool,
                    finish_reason: str) -> Split:
    if not start or not end:
        return Split(None, text, False)
    if opens_think:
        body, sep, answer = text.partition(end)
        if sep:
            return Split(body.strip(), answer.strip(), False)
        return Split(text.strip(), "", finish_reason == "length")
    stripped = text.lstrip()
    if stripped.startswith(start):
        body, sep, answer = stripped[len(start):].partition(end)
        if sep:
            return Split(body.strip(), answer.strip(), False)
        return Split(body.strip(), "", finish_reason == "length")
    return Split("", text.strip(), False)
