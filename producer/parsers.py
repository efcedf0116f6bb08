"""Which reasoning parser a run uses: ``--reasoning-parser NAME``, or ``auto``: detected from the tokenizer.

The names are SGLang's (``sglang.launch_server --reasoning-parser NAME``); the parsing itself runs in the workers
(worker/reasoning.py), the producer only chooses and records the name. Detection reads the chat template(s) and
the vocabulary (added tokens included) for each family's markers, a simplified version of SGLang 0.5.23's
``sglang/srt/parser/template_detection.py`` rules:

==============================================  ==============================
marker                                          parser
==============================================  ==============================
``<|channel|>`` (harmony)                       gpt-oss
``◁think▷``                                     kimi
``<|tool_calls_section_begin|>``                kimi_k2
``<arg_key>`` (GLM-4.5 tool calls)              glm45
``<｜Assistant｜>`` + a ``thinking`` toggle     deepseek-v3
``<｜Assistant｜>`` + ``<think>``               deepseek-r1
``<think>`` + ``<tool_call>``                   qwen3, or qwen3-thinking when the generation prompt opens <think>
no thinking markers                             none
==============================================  ==============================

Several families at once, or ``<think>`` with none of the markers that tell the families apart, is ambiguous: the
producer refuses (exit 2) and names the candidates, because a wrong parser silently files answers under reasoning.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Mapping, Sequence

from render.chat import ThinkMarkers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

AUTO: Final = "auto"
# DeepSeek-V3.1's template switches on a `thinking` variable ("if not thinking is defined", "if thinking"); the word
# alone (a comment, a system prompt) is not enough.
_THINKING_TOGGLE: Final = re.compile(
    r"\bthinking\s+is\s+(?:defined|not\s+defined|true|false)|\bif\s+(?:not\s+)?thinking\b")

#: The markers a parser's thinking block opens and closes with, for the rendered prompt's ``opens_think``; None:
#: the parser does not use it (gpt-oss reasoning is a harmony channel, "none" does not think).
PARSER_MARKERS: Final[Mapping[str, ThinkMarkers | None]] = {
    "qwen3": ThinkMarkers(), "qwen3-thinking": ThinkMarkers(), "deepseek-r1": ThinkMarkers(),
    "deepseek-v3": ThinkMarkers(), "glm45": ThinkMarkers(), "kimi_k2": ThinkMarkers(),
    "kimi": ThinkMarkers("◁think▷", "◁/think▷"), "gpt-oss": None, "none": None,
}


class AmbiguousParser(ValueError):
    """Detection found no single family; the message names the candidates and the option to choose one."""


@dataclass(frozen=True)
class Evidence:
    """What detection looks at: the template text(s) joined, and the vocabulary."""

    template: str
    vocab: frozenset[str]
    opens_think: bool  # a one-user-message prompt, rendered, ends inside an open <think>

    def has(self, marker: str) -> bool:
        return marker in self.template or marker in self.vocab


def evidence(tokenizer: PreTrainedTokenizerBase, opens_think: bool) -> Evidence:
    template = getattr(tokenizer, "chat_template", None) or ""
    text = template if isinstance(template, str) else "\n".join(str(t) for t in dict(template).values())
    return Evidence(text, frozenset(tokenizer.get_vocab()), opens_think)


def detect(ev: Evidence) -> str:
    """The one parser `ev` points to; raises AmbiguousParser naming the candidates otherwise."""
    families: list[str] = []
    if ev.has("<|channel|>"):
        families.append("gpt-oss")
    if ev.has("◁think▷"):
        families.append("kimi")
    if ev.has("<|tool_calls_section_begin|>"):
        families.append("kimi_k2")
    if ev.has("<arg_key>"):
        families.append("glm45")
    if ev.has("<｜Assistant｜>"):
        if _THINKING_TOGGLE.search(ev.template):
            families.append("deepseek-v3")
        elif ev.has("<think>"):
            families.append("deepseek-r1")
    if not families and ev.has("<think>"):
        if ev.has("<tool_call>"):
            families.append("qwen3-thinking" if ev.opens_think else "qwen3")
        else:
            raise AmbiguousParser(
                "cannot tell the reasoning parser from the tokenizer: it has <think> but none of the markers that "
                "tell the families apart (candidates: qwen3, qwen3-thinking, deepseek-r1); give "
                "--reasoning-parser NAME, the name the SGLang server was launched with")
    if len(families) > 1:
        raise AmbiguousParser(
            f"cannot tell the reasoning parser from the tokenizer: it has the markers of {', '.join(families)} "
            "(candidates: " + ", ".join(families) + "); give --reasoning-parser NAME, the name the SGLang server "
            "was launched with")
    return families[0] if families else "none"


def mismatches(parser: str, servers: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Warnings for servers whose recorded ``--reasoning-parser`` differs from the run's (bq:server_info).

    SGLang's own parser only runs on its chat-completions path, which budgetq does not use, so a difference
    changes nothing in the data; it usually means the run names the wrong model family, so it is said.
    """
    out = []
    for entry in servers or []:
        theirs = entry.get("reasoning_parser")
        if theirs is not None and theirs != parser:
            out.append(f"server {entry.get('url', '?')} was launched with --reasoning-parser {theirs}, this run "
                       f"parses with {parser}: check that the run names the model's family")
    return out


#: The text markers each parser reads in a generated turn (worker/reasoning.py): if one of them is a special token
#: of the run's tokenizer, SGLang's detokenizer deletes it under the default skip_special_tokens=true, and the parser
#: no longer sees the thinking block or the tool call.
PARSER_TEXT_MARKERS: Final[Mapping[str, tuple[str, ...]]] = {
    "qwen3": ("<think>", "</think>", "<tool_call>", "</tool_call>"),
    "qwen3-thinking": ("<think>", "</think>", "<tool_call>", "</tool_call>"),
    "deepseek-r1": ("<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"),
    "deepseek-v3": ("<think>", "</think>", "<tool_call>", "</tool_call>", "<｜tool▁calls▁begin｜>",
                    "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"),
    "glm45": ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>"),
    "kimi": ("\u25c1think\u25b7", "\u25c1/think\u25b7"),
    "kimi_k2": ("<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    "gpt-oss": ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"),
    "none": (),
}


def special_markers(parser: str | None, tokenizer: Any) -> list[str]:
    """The markers `parser` reads that are special tokens of `tokenizer` (deleted from the text by
    skip_special_tokens=true)."""
    special = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special.update(str(t.content) for t in decoder.values() if getattr(t, "special", False))
    return [m for m in PARSER_TEXT_MARKERS.get(str(parser), ()) if m in special]


def skip_special_tokens_default(parser: str | None, tokenizer: Any = None) -> bool:
    """The ``skip_special_tokens`` a run sends, decided from its tokenizer: false when a marker the parser reads
    is a special token there (harmony's always; Kimi-K2's tool-call section in the real tokenizer), so that the
    text keeps it; otherwise SGLang's default, true (EOS and other special tokens left out of ``text``). SGLang's
    own chat path sends false whenever tools are declared and for gpt-oss; budgetq asks the tokenizer instead,
    so a family whose markers are plain added tokens keeps the default. Without a tokenizer: the harmony rule
    alone (worker.reasoning.skip_special_tokens_for)."""
    if parser == "gpt-oss":
        return False
    return tokenizer is None or not special_markers(parser, tokenizer)
