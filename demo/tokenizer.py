"""A tiny local tokenizer with a Qwen-style chat template, for the demo and the tests.

There is no model hub on the machines this project runs on, so every tokenizer the demo and the tests use is built
here with the `tokenizers` library and saved as a directory that `transformers.AutoTokenizer.from_pretrained` loads
offline. It is byte-level BPE (any text encodes, like GPT-2/Qwen) trained on a small built-in corpus in a few
milliseconds, and byte-for-byte deterministic: the same arguments always write the same files, so a fingerprint of
the tokenizer is stable across builds.

The `thinking` variant picks the chat template, mirroring the three shapes real reasoning models come in:

- ``open``: the generation prompt ends with ``<|im_start|>assistant\\n<think>\\n`` (Qwen3-Thinking-2507): the model's
  output holds only ``...</think>answer``.
- ``hybrid``: Qwen3's hybrid template: ``enable_thinking=False`` renders a closed empty ``<think>\\n\\n</think>\\n\\n``
  after the generation prompt; true or absent renders nothing there.
- ``none``: no think tags in the template, and none in the vocabulary, so detection says "no thinking".

The template also writes ``bos_token`` first and the tokenizer's post-processor adds BOS when plain text is encoded
with special tokens, like Llama's: re-tokenizing a rendered prompt would double the BOS, which the tests catch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final, Iterable, Literal, cast

import click
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

Thinking = Literal["open", "hybrid", "none"]
THINKING_VARIANTS: Final[tuple[Thinking, ...]] = ("open", "hybrid", "none")

PAD_TOKEN: Final = "<|endoftext|>"
BOS_TOKEN: Final = "<|begin_of_text|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"  # the eos: a chat model stops at the end of its turn
# Trained first, so their ids are 0..3 in every variant.
SPECIAL_TOKENS: Final = (PAD_TOKEN, BOS_TOKEN, IM_START, IM_END)
# Added tokens that are not special, as in Qwen3: they survive decode(skip_special_tokens=True), so a parser can
# still find the reasoning and tool calls in a decoded completion.
TOOL_TOKENS: Final = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
THINK_TOKENS: Final = ("<think>", "</think>")

# A little English and code: enough for common words and indentation to become single tokens.
DEFAULT_CORPUS: Final = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "You are a helpful assistant. Answer the question of the user as well as you can, and explain your reasoning.",
    "Please write a function that returns the sum of a list of numbers. Make sure it handles an empty list.",
    "What is the weather like in Paris today? Can you book a flight from London to New York for next Monday?",
    "The function takes two arguments and returns a new list. It raises an error when the input is not valid.",
    "Summarize the following text in three sentences. Translate this paragraph into French and then German.",
    "I need help with my code: it works on small inputs but it is too slow when the file has a million lines.",
    "First, read the file. Then parse each line, count the words, and print the ten most common ones.",
    "The result of the search is a list of documents, sorted by score, with the title and a short snippet.",
    "Here is the plan: check the inputs, call the tool, read the result, and write a short answer for the user.",
    "def main() -> None:\n    print('hello, world')\n\n\nif __name__ == '__main__':\n    main()\n",
    "import json\nimport os\nfrom pathlib import Path\n\n\ndef load(path: Path) -> dict:\n"
    "    with open(path, encoding='utf-8') as f:\n        return json.load(f)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "for i in range(10):\n    if i % 2 == 0:\n        continue\n    total += i * i\nreturn total\n",
    "function add(a, b) {\n  return a + b;\n}\nconst result = items.map((x) => x * 2).filter(Boolean);\n",
    "SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY count(*) DESC LIMIT 10;",
    "fn main() {\n    let v: Vec<i32> = (0..10).collect();\n    println!(\"{:?}\", v);\n}\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": '
    '{"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}',
    "Let me check step by step. The user wants the total price, so I multiply the quantity by the unit price.",
    "The answer is 42. Because the list is sorted, a binary search finds the item in logarithmic time.",
    "error: expected an integer, found a string. Traceback (most recent call last): File main.py, line 3",
    "What's the weather in Tokyo? Convert the amount from one currency to another. Find a restaurant in Berlin.",
    "Thought: I should search first. Action: search[population of Madrid] Observation: the result of the search.",
    "Please write code that checks whether a string is a palindrome, and include unit tests for the edge cases.",
)

_HEADER: Final = r"""{{- bos_token }}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' and messages[0].content is string %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within ' }}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' }}
    {{- '\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + (messages[0].content if messages[0].content is string else '') + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
        and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'system' %}
    {%- elif message.role == 'assistant' %}
"""

# Qwen3: the reasoning of the turns after the last user query is kept, older reasoning is dropped.
_ASSISTANT_REASONING: Final = r"""        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' }}
            {{- content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
"""

_ASSISTANT_PLAIN: Final = r"""        {{- '<|im_start|>assistant\n' + content }}
"""

_TOOL_CALLS_AND_TOOLS: Final = r"""        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if loop.first and content or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
"""

_GENERATION_PROMPT_TAIL: Final[dict[Thinking, str]] = {
    "open": r"""    {{- '<think>\n' }}
""",
    "hybrid": r"""    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
""",
    "none": "",
}

_FOOTER: Final = "{%- endif %}\n"


def chat_template(thinking: Thinking) -> str:
    """The Jinja chat template of one variant (ChatML with Qwen3's tool and reasoning handling)."""
    if thinking not in THINKING_VARIANTS:
        raise ValueError(f"thinking must be one of {', '.join(THINKING_VARIANTS)}, not {thinking!r}")
    assistant = _ASSISTANT_PLAIN if thinking == "none" else _ASSISTANT_REASONING
    return _HEADER + assistant + _TOOL_CALLS_AND_TOOLS + _GENERATION_PROMPT_TAIL[thinking] + _FOOTER


def _train(corpus: Iterable[str], vocab_size: int, added: tuple[str, ...]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # use_regex splits like GPT-2 before the byte mapping, so merges never cross word boundaries.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte in the alphabet: any text encodes, even characters the corpus never had.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(corpus), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tokenizer


def build_tokenizer(
    directory: Path,
    *,
    thinking: str = "open",
    vocab_size: int = 2000,
    corpus: Iterable[str] | None = None,
    model_max_length: int | None = 32768,
) -> Path:
    """Write a tokenizer directory that `AutoTokenizer.from_pretrained(directory)` loads offline; return it.

    `thinking` is "open", "hybrid" or "none" (see the module docstring). The "none" variant leaves the think tags out
    of the vocabulary as well as out of the template, so marker detection reports no thinking. `model_max_length`
    None leaves it out of tokenizer_config.json, as many real repositories do (transformers then reports
    int(1e30)).
    """
    if thinking not in THINKING_VARIANTS:
        raise ValueError(f"thinking must be one of {', '.join(THINKING_VARIANTS)}, not {thinking!r}")
    variant = cast(Thinking, thinking)
    added = TOOL_TOKENS + (() if variant == "none" else THINK_TOKENS)
    tokenizer = _train(DEFAULT_CORPUS if corpus is None else corpus, vocab_size, added)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template(variant),
    }
    if model_max_length is None:
        del config["model_max_length"]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    config_text = json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n"
    (directory / "tokenizer_config.json").write_text(config_text, encoding="utf-8")
    return directory


@click.command()
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--thinking", type=click.Choice(THINKING_VARIANTS), default="open", show_default=True)
@click.option("--vocab-size", type=click.IntRange(300, 1_000_000), default=2000, show_default=True)
@click.option("--model-max-length", type=click.IntRange(1), default=32768, show_default=True)
def main(directory: Path, thinking: str, vocab_size: int, model_max_length: int) -> None:
    """Build a tiny local tokenizer with a chat template in DIRECTORY.

    Example: python -m demo.tokenizer /tmp/tok --thinking hybrid
    """
    path = build_tokenizer(directory, thinking=thinking, vocab_size=vocab_size, model_max_length=model_max_length)
    click.echo(str(path))


if __name__ == "__main__":
    main()
