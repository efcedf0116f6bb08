"""Model-family outputs with a real tokenizer: the text each family writes, and its real token ids.

``--reasoning-style FAMILY`` (a reasoning-parser name: qwen3, qwen3-thinking, deepseek-r1, deepseek-v3, glm45, kimi,
kimi_k2, gpt-oss) makes the simulator answer in that family's format, markers and tool calls included, and
``--tokenizer DIR`` (a tokenizer directory, e.g. tests/families.py ``build_family_tokenizer``) makes its
``output_ids`` the real ids of that text: the text is written first, tokenized once when the request arrives
(so the natural length is the tokenized length plus the EOS), and a request cut short returns a prefix of those
ids, decoded. ``text`` is the decode of the ids, honouring ``skip_special_tokens`` as SGLang's detokenizer does:
special tokens left out when true, kept when false; the ids always hold them, and never the EOS in the text.

The formats are the ones the families' chat templates render back for the regenerated turn (so an export can be
checked against the ids exactly):

- qwen3: ``<think>\\nR\\n</think>\\n\\nA``; qwen3-thinking and deepseek-r1 (the prompt opened the block, or the
  model thinks from its first token): ``R\\n</think>\\n\\nA``; deepseek-v3 (thinking off): ``A``;
- glm45: ``\\n<think>R</think>\\nA``; kimi: ``◁think▷\\nR\\n◁/think▷\\n\\nA``; kimi_k2: ``<think>R</think>A``;
- gpt-oss: ``<|channel|>analysis<|message|>R<|end|><|start|>assistant<|channel|>final<|message|>A``, EOS
  ``<|return|>``.

A prompt that declares functions (``"name": "..."`` in the decoded prompt) gets a call to the first one in about
half of its answers, in the family's call format (Hermes ``<tool_call>`` JSON for Qwen3, GLM-4.5's
``<arg_key>``/``<arg_value>``, Kimi-K2's call section, DeepSeek's call tokens, harmony's commentary channel ending
with ``<|call|>``). The tokenizer is imported here only: the simulator is not a worker.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Sequence

FAMILY_STYLES: Final = ("qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi", "kimi_k2",
                        "gpt-oss")
# A function the prompt declares: JSON tool definitions, or harmony's TypeScript-like namespace.
_FUNCTION = re.compile(r'"name":\s*"([A-Za-z_][\w.-]*)"|\ntype ([A-Za-z_]\w*) = \(')
_PROPERTY = re.compile(r'"properties":\s*\{\s*"([A-Za-z_]\w*)"')
# The EOS each family ends a turn with (a token of its tokenizer), and the one it ends a tool-call turn with.
_EOS: Final[dict[str, tuple[str | None, str | None]]] = {
    "glm45": ("<|user|>", "<|observation|>"),  # GLM stops at the next role token
    "gpt-oss": ("<|return|>", "<|call|>"),
}


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


def family_text(style: str, reasoning: str, answer: str, call: Call | None) -> str:
    """What a model of ``style`` generates (without its EOS)."""
    args = json.dumps(call.arguments, ensure_ascii=False) if call else ""
    if style in ("qwen3", "qwen3-thinking", "deepseek-r1"):
        head = "<think>\n" if style == "qwen3" else ""
        if call is None:
            return f"{head}{reasoning}\n</think>\n\n{answer}"
        if style == "deepseek-r1":
            return (f"{reasoning}\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                    f"{call.name}\n```json\n{args}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
        return f'{head}{reasoning}\n</think>\n\n<tool_call>\n{{"name": "{call.name}", "arguments": {args}}}\n</tool_call>'
    if style == "deepseek-v3":
        if call is None:
            return answer
        return (f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{call.name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"
                "<｜tool▁calls▁end｜>")
    if style == "glm45":
        if call is None:
            return f"\n<think>{reasoning}</think>\n{answer}"
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in call.arguments.items())
        return f"\n<think>{reasoning}</think>\n\n<tool_call>{call.name}\n{pairs}</tool_call>"
    if style == "kimi":
        return f"\u25c1think\u25b7\n{reasoning}\n\u25c1/think\u25b7\n\n{answer}"
    if style == "kimi_k2":
        if call is None:
            return f"<think>{reasoning}</think>{answer}"
        return (f"<think>{reasoning}</think><|tool_calls_section_begin|><|tool_call_begin|>functions.{call.name}:0"
                f"<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>")
    if style == "gpt-oss":
        analysis = f"<|channel|>analysis<|message|>{reasoning}<|end|>"
        if call is None:
            return f"{analysis}<|start|>assistant<|channel|>final<|message|>{answer}"
        return f"{analysis}<|start|>assistant<|channel|>commentary to=functions.{call.name} <|constrain|>json<|message|>{args}"
    raise ValueError(f"unknown family style {style!r}")


class SimTokenizer:
    """A tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``) loaded with the ``tokenizers``
    library: encode the generated text, decode ids with or without special tokens, and the family's EOS ids."""

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer
        directory = Path(directory)
        self.tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_id = self.token_id(eos) if isinstance(eos, str) else None
        sample = " ".join(f"w{i}ord" for i in range(50))
        self.tokens_per_word = max(1.0, len(self.encode(sample)) / 50)

    def token_id(self, token: str) -> int | None:
        value = self.tok.token_to_id(token)
        return int(value) if value is not None else None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def eos_for(self, style: str, call: bool) -> int | None:
        plain, tool = _EOS.get(style, (None, None))
        name = tool if call else plain
        found = self.token_id(name) if name else None
        return found if found is not None else self.eos_id


def find_call(prompt_text: str, words: list[str], wants: bool) -> Call | None:
    """A call to the first function the prompt declares, when ``wants`` (the request's draw) says so."""
    if not wants:
        return None
    found = _FUNCTION.search(prompt_text)
    if found is None:
        return None
    prop = _PROPERTY.search(prompt_text)
    return Call(found.group(1) or found.group(2), {prop.group(1) if prop else "query": " ".join(words[:2]) or "x"})
