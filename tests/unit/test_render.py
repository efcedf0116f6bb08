"""render.chat against the three demo tokenizer variants, built once per session in a temp directory."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest

from demo.sample_data import agent_traces_records, code_instruct_records, glaive_fc_records
from demo.tokenizer import BOS_TOKEN, build_tokenizer
from render.chat import (
    Rendered,
    Renderer,
    RenderError,
    ThinkMarkers,
    default_max_context,
    detect_think_markers,
    load_tokenizer,
)

USER: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]
TOOL_CALL: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris and in Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'}},
        ],
    },
    {"role": "tool", "content": '{"temperature": 21}'},
    {"role": "tool", "content": '{"temperature": 18}'},
]


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {v: build_tokenizer(root / v, thinking=v, model_max_length=4096) for v in ("open", "hybrid", "none")}


@pytest.fixture(scope="session")
def tokenizers(tokenizer_dirs: dict[str, Path]) -> dict[str, Any]:
    return {variant: load_tokenizer(path) for variant, path in tokenizer_dirs.items()}


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any attempt to open a connection fails the test, even one whose error the code under test catches: each
    attempt is recorded and the list must be empty at the end."""
    attempts: list[tuple[object, ...]] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield
    assert not attempts, f"network access attempted: {attempts!r}"


def text_of(tokenizer: Any, rendered: Rendered) -> str:
    text = tokenizer.decode(rendered.input_ids, skip_special_tokens=False)
    assert isinstance(text, str)
    return text


@pytest.mark.parametrize("variant", ["open", "hybrid", "none"])
def test_ids_are_a_flat_list_of_ints(tokenizers: dict[str, Any], variant: str) -> None:
    rendered = Renderer(tokenizers[variant]).render(USER)
    assert type(rendered.input_ids) is list
    assert rendered.input_ids and all(type(i) is int for i in rendered.input_ids)


def test_one_bos_only(tokenizers: dict[str, Any]) -> None:
    tokenizer = tokenizers["open"]
    bos = tokenizer.convert_tokens_to_ids(BOS_TOKEN)
    ids = Renderer(tokenizer).render(USER).input_ids
    assert ids[0] == bos and ids.count(bos) == 1
    # The hazard this guards against is real for this tokenizer: re-encoding the rendered text doubles the BOS.
    text = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert tokenizer(text)["input_ids"][:2] == [bos, bos]


@pytest.mark.parametrize(
    ("variant", "kwargs", "ending", "opens"),
    [
        ("open", {}, "<|im_start|>assistant\n<think>\n", True),
        ("hybrid", {}, "<|im_start|>assistant\n", False),
        ("hybrid", {"enable_thinking": True}, "<|im_start|>assistant\n", False),
        ("hybrid", {"enable_thinking": False}, "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("none", {}, "<|im_start|>assistant\n", False),
        ("none", {"enable_thinking": False}, "<|im_start|>assistant\n", False),
    ],
)
def test_generation_prompt_and_opens_think(
    tokenizers: dict[str, Any], variant: str, kwargs: dict[str, Any], ending: str, opens: bool
) -> None:
    rendered = Renderer(tokenizers[variant], chat_template_kwargs=kwargs).render(USER)
    text = text_of(tokenizers[variant], rendered)
    assert text.endswith("What is 2 + 2?<|im_end|>\n" + ending)
    assert rendered.opens_think is opens


def test_chat_template_kwargs_pass_through(tokenizers: dict[str, Any]) -> None:
    thinking = Renderer(tokenizers["hybrid"], chat_template_kwargs={"enable_thinking": True}).render(USER)
    closed = Renderer(tokenizers["hybrid"], chat_template_kwargs={"enable_thinking": False}).render(USER)
    assert closed.input_ids[: len(thinking.input_ids)] == thinking.input_ids
    assert len(closed.input_ids) > len(thinking.input_ids)


def test_detect_think_markers(tokenizers: dict[str, Any]) -> None:
    assert detect_think_markers(tokenizers["open"]) == ThinkMarkers("<think>", "</think>")
    assert detect_think_markers(tokenizers["hybrid"]) == ThinkMarkers("<think>", "</think>")
    assert detect_think_markers(tokenizers["none"]) is None
    assert Renderer(tokenizers["none"]).think is None
    # Not special, as in Qwen3: a completion decoded without special tokens keeps its reasoning markers.
    ids = tokenizers["open"]("<think>x</think>y<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tokenizers["open"].decode(ids, skip_special_tokens=True) == "<think>x</think>y"


def test_think_markers_can_be_given_or_disabled(tokenizers: dict[str, Any]) -> None:
    assert Renderer(tokenizers["open"], think=None).render(USER).opens_think is False
    custom = ThinkMarkers("<|im_start|>", "<|im_end|>")  # any pair of strings works
    assert Renderer(tokenizers["none"], think=custom).render(USER).opens_think is True


@pytest.mark.parametrize("variant", ["open", "hybrid", "none"])
def test_tool_calls_render(tokenizers: dict[str, Any], variant: str) -> None:
    text = text_of(tokenizers[variant], Renderer(tokenizers[variant]).render(TOOL_CALL))
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response>\n'
        '<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    ) in text


def test_tools_kwarg_renders_a_tools_block(tokenizers: dict[str, Any]) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    rendered = Renderer(tokenizers["open"], chat_template_kwargs={"tools": tools}).render(USER)
    text = text_of(tokenizers["open"], rendered)
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert text.count("<|im_start|>system\nYou are terse.\n\n# Tools") == 1


def test_old_reasoning_is_dropped_from_history(tokenizers: dict[str, Any]) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = text_of(tokenizers["hybrid"], Renderer(tokenizers["hybrid"]).render(messages))
    assert "old thoughts" not in text and "<|im_start|>assistant\nHello!<|im_end|>" in text


def test_template_error_is_a_render_error(tokenizers: dict[str, Any]) -> None:
    renderer = Renderer(tokenizers["open"])
    with pytest.raises(RenderError, match="Unexpected message role: narrator"):
        renderer.render([{"role": "user", "content": "Hi"}, {"role": "narrator", "content": "Once upon a time"}])
    with pytest.raises(RenderError, match="No user query found"):
        renderer.render([{"role": "system", "content": "Only a system prompt"}])


@pytest.mark.parametrize("messages", [[], [USER], "hello", [{"role": "user", "content": "a"}, "b"]])
def test_bad_messages(tokenizers: dict[str, Any], messages: Any) -> None:
    with pytest.raises(RenderError, match="non-empty list of message objects"):
        Renderer(tokenizers["open"]).render(messages)


def test_bad_kwargs(tokenizers: dict[str, Any]) -> None:
    with pytest.raises(RenderError, match="may not set add_generation_prompt, tokenize"):
        Renderer(tokenizers["open"], chat_template_kwargs={"tokenize": False, "add_generation_prompt": False})
    with pytest.raises(RenderError, match="JSON"):
        Renderer(tokenizers["open"], chat_template_kwargs={"when": object()})


def test_render_many_matches_render(tokenizers: dict[str, Any]) -> None:
    renderer = Renderer(tokenizers["open"])
    conversations: list[list[dict[str, Any]]] = [USER, TOOL_CALL, [{"role": "user", "content": "x" * 300}]]
    assert renderer.render_many(conversations) == [renderer.render(c) for c in conversations]
    assert renderer.render_many([]) == []
    with pytest.raises(RenderError, match="conversation 1: chat template error: Unexpected message role") as info:
        renderer.render_many([USER, [{"role": "user", "content": "a"}, {"role": "bard", "content": "b"}], USER])
    assert info.value.index == 1


def test_check_raises_what_render_raises_without_encoding(tokenizers: dict[str, Any]) -> None:
    """check/check_many render the template to text only: what renders passes, and what render refuses they refuse
    with the same message, check_many naming the index of the first conversation at fault."""
    renderer = Renderer(tokenizers["open"])
    good: list[list[dict[str, Any]]] = [USER, TOOL_CALL, [{"role": "user", "content": "x" * 300}]]
    renderer.check_many(good)  # they return nothing: passing is not raising
    renderer.check_many([])
    renderer.check(TOOL_CALL, [{"type": "function", "function": {"name": "get_weather"}}])
    bard = [{"role": "user", "content": "a"}, {"role": "bard", "content": "b"}]
    with pytest.raises(RenderError) as rendered:
        renderer.render(bard)
    with pytest.raises(RenderError) as checked:
        renderer.check(bard)
    assert str(checked.value) == str(rendered.value) and "Unexpected message role: bard" in str(checked.value)
    with pytest.raises(RenderError, match="conversation 2: chat template error: Unexpected message role") as info:
        renderer.check_many([USER, TOOL_CALL, bard, USER], [None, [{"type": "function"}], None, None])
    assert info.value.index == 2
    with pytest.raises(RenderError, match="non-empty list of message objects"):
        renderer.check_many([USER, []])


def test_fingerprint(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    first = Renderer(load_tokenizer(tokenizer_dirs["hybrid"])).fingerprint()
    again = load_tokenizer(tokenizer_dirs["hybrid"])
    assert Renderer(again).fingerprint() == first
    assert len(first) == 64 and int(first, 16) >= 0
    # The same build in another place is the same tokenizer.
    rebuilt = build_tokenizer(tmp_path / "elsewhere", thinking="hybrid", model_max_length=4096)
    assert Renderer(load_tokenizer(rebuilt)).fingerprint() == first
    # Template, kwargs, vocabulary: each changes it.
    assert Renderer(again, chat_template_kwargs={"enable_thinking": False}).fingerprint() != first
    # Keyword order is no change; the order inside a value (a tool schema the template prints) is.
    a = Renderer(again, chat_template_kwargs={"x": 1, "tools": [{"a": 1, "b": 2}]}).fingerprint()
    assert Renderer(again, chat_template_kwargs={"tools": [{"a": 1, "b": 2}], "x": 1}).fingerprint() == a
    assert Renderer(again, chat_template_kwargs={"tools": [{"b": 2, "a": 1}], "x": 1}).fingerprint() != a
    assert Renderer(load_tokenizer(tokenizer_dirs["open"])).fingerprint() != first
    assert Renderer(load_tokenizer(tokenizer_dirs["none"])).fingerprint() != first
    other_vocab = build_tokenizer(tmp_path / "vocab", thinking="hybrid", model_max_length=4096, vocab_size=400)
    assert Renderer(load_tokenizer(other_vocab)).fingerprint() != first
    again.chat_template = again.chat_template.replace("<|im_start|>system", "<|im_start|>system ")
    assert Renderer(again).fingerprint() != first


def test_fingerprint_does_not_change_after_rendering(tokenizers: dict[str, Any]) -> None:
    renderer = Renderer(tokenizers["open"])
    before = renderer.fingerprint()
    renderer.render(USER)
    assert Renderer(tokenizers["open"]).fingerprint() == before


def test_load_missing_directory(no_network: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(RenderError, match="tokenizer directory not found: .*no-such-model"):
        load_tokenizer(tmp_path / "no-such-model")
    # a hub id is looked up in the local cache only (tests/redis/test_modeldir.py), never fetched
    with pytest.raises(RenderError, match=f"Qwen/Qwen3-8B: not a local directory, and not in the Hugging Face "
                                          f"cache {tmp_path / 'hub'}"):
        load_tokenizer("Qwen/Qwen3-8B")


def test_load_directory_without_tokenizer(no_network: None, tmp_path: Path) -> None:
    with pytest.raises(RenderError, match=f"cannot load a tokenizer from {tmp_path}"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_without_chat_template(tokenizer_dirs: dict[str, Path], tmp_path: Path) -> None:
    shutil.copy(tokenizer_dirs["open"] / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(RenderError, match=f"the tokenizer in {tmp_path} has no chat_template"):
        load_tokenizer(tmp_path)


def test_default_max_context(tokenizer_dirs: dict[str, Path]) -> None:
    tokenizer = load_tokenizer(tokenizer_dirs["open"])
    assert default_max_context(tokenizer) == 4096
    tokenizer.model_max_length = int(1e30)  # what transformers sets when the config says nothing
    assert default_max_context(tokenizer) is None


def test_sample_datasets_render(tokenizers: dict[str, Any]) -> None:
    """Every demo record renders, in the message shapes the producer will build from it, with the ids a
    one-by-one render gives. Its speed (no accidental quadratic path) is bench/local_speed.py's."""
    renderer = Renderer(tokenizers["open"])
    conversations: list[list[dict[str, Any]]] = [r["messages"] for r in glaive_fc_records()]
    conversations += [[{"role": "user", "content": r["prompt"]}] for r in code_instruct_records()]
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    for record in agent_traces_records():
        turns = record["conversations"]
        assert turns[-1]["from"] == "gpt"
        conversations.append([{"role": roles[t["from"]], "content": t["value"]} for t in turns[:-1]])
    rendered = renderer.render_many(conversations)
    assert len(rendered) == 350 and all(r.opens_think for r in rendered)
    assert [r.input_ids for r in rendered[::25]] == [renderer.render(c).input_ids for c in conversations[::25]]


def test_tool_call_arguments_reach_the_template_as_objects_as_sglang_gives_them() -> None:
    """SGLang's chat serving parses an assistant history message's JSON-string arguments into an object before
    the template sees them; rendering here does the same (a copy: the caller's message is unchanged), and leaves
    a string that is not a JSON object alone."""
    from render.chat import _checked
    call: dict[str, Any] = {"id": "c1", "type": "function",
                            "function": {"name": "f", "arguments": "{\"city\": \"Paris\"}"}}
    bad = {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "", "tool_calls": [call, bad]}]
    out = _checked(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert call["function"]["arguments"] == "{\"city\": \"Paris\"}"  # not changed in place
    assert _checked([{"role": "user", "content": "q"}])[0] == {"role": "user", "content": "q"}
