"""Tiny tokenizers with chat templates that reproduce each model family's behaviour that matters to budgetq.

Nothing is downloaded: each family gets the demo's byte-level BPE (demo/tokenizer.py) plus the family's markers as
added tokens, special or not as in the real tokenizer, and a chat template written here that keeps what the
parsers and exports depend on (a sketch of the real template, not a copy):

- ``qwen3``: Qwen3's hybrid template (the demo's "hybrid"): the model writes ``<think>`` itself; reasoning of turns
  before the last user query is dropped; ``enable_thinking=False`` closes an empty block in the prompt.
- ``qwen3-thinking``: the generation prompt ends with ``<think>\\n`` (Qwen3-Thinking-2507).
- ``deepseek-r1``: the older R1 template: no ``<think>`` in the prompt although the model thinks first;
  earlier turns' reasoning dropped (``content.split('</think>')[-1]``); DeepSeek-V3 tool-call tokens.
- ``deepseek-v3``: DeepSeek-V3.1's template: the ``thinking`` kwarg ends the prompt with ``<think>`` or ``</think>``;
  V3.1 tool calls (``NAME<｜tool▁sep｜>{json}``).
- ``glm45``: GLM-4.5: ``[gMASK]<sop>``, ``<|user|>``/``<|assistant|>`` special tokens, ``<arg_key>`` tool calls,
  ``enable_thinking=False`` renders ``<think></think>`` after the generation prompt; earlier reasoning dropped.
- ``kimi``: Kimi-VL-Thinking: ``◁think▷``/``◁/think▷``.
- ``kimi_k2``: Kimi-K2-Thinking: ``<think>`` and the ``<|tool_calls_section_begin|>`` call section (special
  tokens, as in the real tokenizer), ids ``functions.NAME:IDX`` rendered back.
- ``gpt-oss``: harmony: ``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|end|>``, ``<|return|>``, ``<|call|>``,
  ``<|constrain|>`` are special tokens (``skip_special_tokens=true`` deletes them), the generation prompt is
  ``<|start|>assistant``, ``<|return|>`` and ``<|call|>`` both end a completion (generation_config.json).
- ``none``: ChatML without thinking (the demo's "none").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Final

from tokenizers import AddedToken

from demo.tokenizer import (
    BOS_TOKEN,
    DEFAULT_CORPUS,
    IM_END,
    PAD_TOKEN,
    THINK_TOKENS,
    TOOL_TOKENS,
    _train,
    chat_template,
)

FAMILIES: Final = ("qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi", "kimi_k2", "gpt-oss",
                   "none")

_DS_BOS, _DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
_DS_TOOL_TOKENS: Final = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                          "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                          "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
_DS_ROLES: Final = ("<｜User｜>", "<｜Assistant｜>")

_DEEPSEEK_R1: Final = r"""{{- bos_token }}
{%- for message in messages if message.role == 'system' %}{{- message.content }}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<｜User｜>' + message.content }}
    {%- elif message.role == 'assistant' %}
        {%- set content = (message.content or '').split('</think>')[-1] %}
        {{- '<｜Assistant｜>' + content }}
        {%- if message.tool_calls %}
            {{- '<｜tool▁calls▁begin｜>' }}
            {%- for tc in message.tool_calls %}
                {%- set args = tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson %}
                {{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tc.function.name + '\n```json\n' + args + '\n```<｜tool▁call▁end｜>' }}
            {%- endfor %}
            {{- '<｜tool▁calls▁end｜>' }}
        {%- endif %}
        {{- '<｜end▁of▁sentence｜>' }}
    {%- elif message.role == 'tool' %}
        {{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}
"""

_DEEPSEEK_V31: Final = r"""{{- bos_token }}
{%- for message in messages if message.role == 'system' %}{{- message.content }}{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {{- '<｜User｜>' + message.content }}
    {%- elif message.role == 'assistant' %}
        {{- '<｜Assistant｜></think>' + (message.content or '').split('</think>')[-1] }}
        {%- if message.tool_calls %}
            {{- '<｜tool▁calls▁begin｜>' }}
            {%- for tc in message.tool_calls %}
                {%- set args = tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson %}
                {{- '<｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' + args + '<｜tool▁call▁end｜>' }}
            {%- endfor %}
            {{- '<｜tool▁calls▁end｜>' }}
        {%- endif %}
        {{- '<｜end▁of▁sentence｜>' }}
    {%- elif message.role == 'tool' %}
        {{- '<｜tool▁output▁begin｜>' + message.content + '<｜tool▁output▁end｜>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<｜Assistant｜>' + ('<think>' if thinking is defined and thinking else '</think>') }}
{%- endif %}
"""

_GLM_TOKENS: Final = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
_GLM_TEXT_TOKENS: Final = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_GLM45: Final = r"""[gMASK]<sop>
{%- if tools %}
    {{- '<|system|>\n# Tools\n\nYou may call one or more functions.\n<tools>\n' }}
    {%- for tool in tools %}{{- tool | tojson }}{{- '\n' }}{%- endfor %}
    {{- '</tools>\n\nFor each function call, output the function name and arguments within the following XML format:'
        '\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...</tool_call>' }}
{%- endif %}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user_index = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- set content = m.content if m.content is string else '' %}
    {%- if m.role == 'user' %}
        {{- '<|user|>\n' + content }}
    {%- elif m.role == 'system' %}
        {{- '<|system|>\n' + content }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user_index and reasoning %}
            {{- '<|assistant|>\n<think>' + reasoning.strip() + '</think>' }}
        {%- else %}
            {{- '<|assistant|>\n<think></think>' }}
        {%- endif %}
        {{- '\n' + content.strip() }}
        {%- for tc in m.tool_calls or [] %}
            {{- '\n<tool_call>' + tc.function.name + '\n' }}
            {%- if tc.function.arguments is not mapping %}
                {{- raise_exception('GLM-4.5 renders tool-call arguments from an object, not a JSON string') }}
            {%- endif %}
            {%- for k, v in tc.function.arguments.items() %}
                {{- '<arg_key>' + k + '</arg_key>\n<arg_value>' + (v if v is string else v | tojson) + '</arg_value>\n' }}
            {%- endfor %}
            {{- '</tool_call>' }}
        {%- endfor %}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|observation|>' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' + ('\n<think></think>' if enable_thinking is defined and not enable_thinking else '') }}
{%- endif %}
"""

_KIMI_ROLE_TOKENS: Final = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
_KIMI_THINK: Final = ("◁think▷", "◁/think▷")
_KIMI_VL: Final = r"""{%- for m in messages %}
    {%- if m.role == 'user' %}{{- '<|im_user|>user<|im_middle|>' + m.content + '<|im_end|>' }}
    {%- elif m.role == 'system' %}{{- '<|im_system|>system<|im_middle|>' + m.content + '<|im_end|>' }}
    {%- elif m.role == 'assistant' %}{{- '<|im_assistant|>assistant<|im_middle|>' + (m.content or '') + '<|im_end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}
"""

_KIMI_K2_TOOL_TOKENS: Final = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                               "<|tool_call_argument_begin|>", "<|tool_call_end|>")
_KIMI_K2: Final = r"""{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user_index = loop.index0 %}{%- endif %}{%- endfor %}
{%- if tools %}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' }}{%- endif %}
{%- for m in messages %}
    {%- set content = m.content if m.content is string else '' %}
    {%- if m.role == 'user' %}{{- '<|im_user|>user<|im_middle|>' + content + '<|im_end|>' }}
    {%- elif m.role == 'system' %}{{- '<|im_system|>system<|im_middle|>' + content + '<|im_end|>' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_assistant|>assistant<|im_middle|>' }}
        {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
        {%- if loop.index0 > ns.last_user_index %}{{- '<think>' + reasoning + '</think>' }}
        {%- else %}{{- '<think></think>' }}{%- endif %}
        {{- content }}
        {%- if m.tool_calls %}
            {{- '<|tool_calls_section_begin|>' }}
            {%- for tc in m.tool_calls %}
                {%- set args = tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson %}
                {{- '<|tool_call_begin|>' + tc.id + '<|tool_call_argument_begin|>' + args + '<|tool_call_end|>' }}
            {%- endfor %}
            {{- '<|tool_calls_section_end|>' }}
        {%- endif %}
        {{- '<|im_end|>' }}
    {%- elif m.role == 'tool' %}
        {{- '<|im_system|>tool<|im_middle|>## Return of ' + m.tool_call_id + '\n' + content + '<|im_end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_assistant|>assistant<|im_middle|>' }}{%- endif %}
"""

HARMONY_TOKENS: Final = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
                         "<|call|>")
_HARMONY: Final = r"""{{- '<|start|>system<|message|>You are a helpful assistant.\nReasoning: medium\n\n'
    '# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}
{%- if tools %}
    {{- '<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n' }}
    {%- for tool in tools %}{{- '// ' + (tool.function.description or '') + '\ntype ' + tool.function.name + ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\n' }}{%- endfor %}
    {{- '} // namespace functions<|end|>' }}
{%- endif %}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user_index = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- set content = m.content if m.content is string else '' %}
    {%- if m.role == 'system' %}{{- '<|start|>developer<|message|># Instructions\n\n' + content + '<|end|>' }}
    {%- elif m.role == 'user' %}{{- '<|start|>user<|message|>' + content + '<|end|>' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = m.reasoning_content if m.reasoning_content is string else (m.thinking if m.thinking is string else '') %}
        {%- if m.tool_calls %}
            {%- if reasoning and loop.index0 > ns.last_user_index %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' }}{%- endif %}
            {%- if content %}{{- '<|start|>assistant<|channel|>commentary<|message|>' + content + '<|end|>' }}{%- endif %}
            {%- for tc in m.tool_calls %}
                {%- set args = tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson %}
                {{- '<|start|>assistant<|channel|>commentary to=functions.' + tc.function.name + ' <|constrain|>json<|message|>' + args + '<|call|>' }}
            {%- endfor %}
        {%- else %}
            {{- '<|start|>assistant<|channel|>final<|message|>' + content + '<|end|>' }}
        {%- endif %}
    {%- elif m.role == 'tool' %}
        {{- '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>commentary<|message|>' + content + '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""


def _spec(family: str) -> tuple[str, tuple[str, ...], tuple[str, ...], str, list[str]]:
    """(template, special added tokens, plain added tokens, eos token, extra eos tokens for generation_config)."""
    if family == "qwen3":
        return chat_template("hybrid"), (), TOOL_TOKENS + THINK_TOKENS, IM_END, []
    if family == "qwen3-thinking":
        return chat_template("open"), (), TOOL_TOKENS + THINK_TOKENS, IM_END, []
    if family == "none":
        return chat_template("none"), (), TOOL_TOKENS, IM_END, []
    if family == "deepseek-r1":
        return _DEEPSEEK_R1, (_DS_BOS, _DS_EOS), _DS_ROLES + THINK_TOKENS + _DS_TOOL_TOKENS, _DS_EOS, []
    if family == "deepseek-v3":
        return _DEEPSEEK_V31, (_DS_BOS, _DS_EOS), _DS_ROLES + THINK_TOKENS + _DS_TOOL_TOKENS, _DS_EOS, []
    if family == "glm45":
        # GLM stops at the next role token: <|user|> and <|observation|> are eos ids too.
        return (_GLM45, _GLM_TOKENS, THINK_TOKENS + TOOL_TOKENS + _GLM_TEXT_TOKENS, PAD_TOKEN,
                ["<|user|>", "<|observation|>"])
    if family == "kimi":
        return _KIMI_VL, _KIMI_ROLE_TOKENS, _KIMI_THINK, IM_END, []
    if family == "kimi_k2":
        # The call-section markers are special tokens, as in Kimi-K2's own tokenizer: skip_special_tokens=true
        # deletes them, so a run sends false (producer.settings.skip_special_tokens_default, issue 25), as SGLang's
        # chat path does whenever tools are declared.
        return _KIMI_K2, _KIMI_ROLE_TOKENS + _KIMI_K2_TOOL_TOKENS, THINK_TOKENS, IM_END, []
    if family == "gpt-oss":
        return _HARMONY, HARMONY_TOKENS, (), "<|return|>", ["<|call|>"]
    raise ValueError(f"family must be one of {', '.join(FAMILIES)}, not {family!r}")


def build_family_tokenizer(directory: Path, family: str, *, vocab_size: int = 2000) -> Path:
    """Write a tokenizer directory for `family` (a reasoning-parser name, one of FAMILIES); return it.

    Loads offline with ``AutoTokenizer.from_pretrained``; byte-for-byte deterministic like the demo's.
    """
    template, special, plain, eos, extra_eos = _spec(family)
    tokenizer = _train(DEFAULT_CORPUS, vocab_size, plain)
    if special:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _DS_BOS if family.startswith("deepseek") else BOS_TOKEN,
        "eos_token": eos,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config_text = json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
    (directory / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    if extra_eos:
        ids = [tokenizer.token_to_id(t) for t in (eos, *extra_eos)]
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}) + "\n",
                                                          encoding="utf-8")
    return directory
