"""Export: both formats round-trip to the source records, truncated and failed samples are handled as documented,
token ids are checked against the run, the manifest says what the dataset holds, and files appear atomically."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis
from click.testing import CliRunner, Result

from budget import keys
from budget.ledger import Ledger
from budget.record import make_record as make_v2_record
from budget.record import make_turn, prompt_digest
from budget.runstate import RunState
from demo.run import find_redis_server
from demo.tokenizer import build_tokenizer
from producer.export.writer import (
    CONVERSATION_FORMATS,
    ExportError,
    ExportOptions,
    export_dataset,
    template_hash,
    write_manifest,
)
from render.chat import Renderer, load_tokenizer
from tests.procs import produce

THINK = ("<think>", "</think>")
ROLE_OF = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}
PROMPTS: dict[str, list[dict[str, Any]]] = {
    "plain": [{"role": "user", "content": "What is the weather like in Paris today?"}],
    "tools": [SYSTEM, {"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [CALL]},
              {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "{\"temp\": 21}"}],
    "null-content": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "text-and-call": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "multi-turn": [SYSTEM, {"role": "user", "content": "Write a function that returns the sum of a list."},
                   {"role": "assistant", "content": "def total(xs):\n    return sum(xs)",
                    "reasoning_content": "Easy."},
                   {"role": "user", "content": "Make sure it handles an empty list."}],
}


# -- fixtures and helpers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tok(tokenizer_dir: Path) -> Any:
    return load_tokenizer(tokenizer_dir)  # the demo tokenizer, thinking="open" (see conftest)


def response_of(reasoning: str | None, content: str, reasoning_truncated: bool) -> str:
    """What an "open" template's model returns: the prompt already ends with "<think>\\n"."""
    if reasoning is None:
        return content
    return reasoning if reasoning_truncated else f"{reasoning}\n</think>\n\n{content}"


def make_record(tok: Any, sid: str, prompt: str, *, reasoning: str | None = "Let me think. The user asks.",
                content: str = "It is sunny.", finish: str = "stop", reasoning_truncated: bool = False,
                kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    messages = PROMPTS[prompt]
    response = response_of(reasoning, content, reasoning_truncated)
    prompt_ids = Renderer(tok, chat_template_kwargs=kwargs).render(messages).input_ids
    # The server counts the EOS a "stop" ends with; the text does not hold it.
    completion = len(tok.encode(response, add_special_tokens=False)) + (finish == "stop")
    return {"id": sid, "dataset": "ds", "messages": messages, "response": response, "reasoning": reasoning,
            "content": content, "reasoning_truncated": reasoning_truncated, "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion, "finish_reason": finish, "sampling_params": {"max_new_tokens": 64}}


def to_v2(tok: Any, rec: dict[str, Any], kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record a worker would have written for the flat fields ``rec`` (make_record): the server's ids are
    the response's tokens, plus the EOS on a stop; the prompt digest is of the ids the producer rendered."""
    prompt_ids = Renderer(tok, chat_template_kwargs=kwargs).render(rec["messages"]).input_ids
    output_ids = tok.encode(rec["response"], add_special_tokens=False)
    if rec["finish_reason"] == "stop":
        output_ids.append(tok.convert_tokens_to_ids("<|im_end|>"))
    turn = make_turn(response=rec["response"], reasoning=rec["reasoning"], content=rec["content"],
                     reasoning_truncated=rec["reasoning_truncated"], reasoning_unclosed=False, tool_calls=[],
                     prompt_tokens=len(prompt_ids), cached_tokens=0, completion_tokens=len(output_ids),
                     finish_reason=rec["finish_reason"], prompt_ids=prompt_ids, output_ids=output_ids)
    return make_v2_record(sample_id=rec["id"], dataset=rec["dataset"], turns=[turn], reasoning_parser=None,
                          sampling_params=rec["sampling_params"], messages=rec["messages"])


def standard_records(tok: Any) -> list[dict[str, Any]]:
    return [to_v2(tok, rec) for rec in [
        make_record(tok, "a-plain", "plain"),
        make_record(tok, "b-tools", "tools", content="It is 21 degrees."),
        make_record(tok, "c-null", "null-content", reasoning="Sunny means nice."),
        make_record(tok, "d-text-call", "text-and-call"),
        make_record(tok, "e-multi", "multi-turn", content="def total(xs):\n    return sum(xs) if xs else 0"),
        make_record(tok, "f-no-thinking", "plain", reasoning=""),
        make_record(tok, "g-cut-thinking", "plain", reasoning="I keep thinking and", content="",
                    finish="length", reasoning_truncated=True),
        make_record(tok, "h-cut-answer", "plain", content="It is su", finish="length"),
        make_record(tok, "i-failed-too", "plain"),  # stale: a rerun answered it, failed.jsonl not yet rewritten
    ]]


def write_dataset(root: Path, tok: Any, records: list[dict[str, Any]], *, failed: tuple[str, ...] = (),
                  kwargs: dict[str, Any] | None = None, think: Any = THINK) -> Path:
    out = root / "out" / "ds"
    out.mkdir(parents=True, exist_ok=True)
    settings = {"chat_template_kwargs": kwargs or {}, "sampling_params": {"max_new_tokens": 64},
                "think": None if think is None else list(think),
                "tokenizer": Renderer(tok, chat_template_kwargs=kwargs).fingerprint()}
    (out / "run.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / "raw_responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    if failed:
        lines = "".join(json.dumps({"id": sid, "reason": "HTTP 500", "status": 500, "attempts": 3}) + "\n"
                        for sid in failed)
        (out / "failed.jsonl").write_text(lines, encoding="utf-8")
    return out


@pytest.fixture
def dataset(tmp_path: Path, tok: Any) -> Path:
    return write_dataset(tmp_path, tok, standard_records(tok), failed=("i-failed-too", "z-never-answered"))


def source_turns(path: Path) -> dict[str, dict[str, Any]]:
    """id -> the record, with its one turn's fields on it (what the tests compare)."""
    out = {}
    for rec in read_jsonl(path):
        out[rec["id"]] = {**rec["turns"][0], **rec}
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def split_inline(text: str) -> tuple[str | None, str]:
    """The inverse of the inline rendering, written apart from the library."""
    head = THINK[0] + "\n"
    if not text.startswith(head):
        return None, text
    reasoning, sep, content = text[len(head):].partition(f"\n{THINK[1]}\n\n")
    assert sep, text
    return reasoning, content


def message_from_sharegpt(turn: dict[str, Any]) -> dict[str, Any]:
    """The inverse of the ShareGPT rendering: from/value mapped back, every other key (tool_calls...) as it is."""
    extras = {k: v for k, v in turn.items() if k not in ("from", "value")}
    return {"role": ROLE_OF[turn["from"]], "content": turn["value"], **extras}


def read_back(record: dict[str, Any], fmt: str, reasoning_mode: str
              ) -> tuple[list[dict[str, Any]], str | None, str]:
    """(prompt messages, reasoning, content) of one exported record."""
    if fmt == "openai-messages":
        *prompt, turn = record["conversations"]
        assert turn["role"] == "assistant"
        text, field = turn["content"], turn.get("reasoning_content")
    else:
        *turns, gpt = record["conversations"]
        assert gpt["from"] == "gpt"
        prompt = [message_from_sharegpt(t) for t in turns]
        text, field = gpt["value"], gpt.get("reasoning_content")
    if reasoning_mode == "inline":
        assert field is None
        reasoning, content = split_inline(text)
        return prompt, reasoning, content
    assert THINK[0] not in text and THINK[1] not in text
    return prompt, field, text


def without_null_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ShareGPT values are strings: a null content (a tool-call turn) comes back as "" (templates agree)."""
    return [{**m, "content": "" if m.get("content") is None else m["content"]} for m in messages]


def assert_round_trip(source: Path, exported: Path, fmt: str, reasoning_mode: str) -> None:
    by_id = source_turns(source)
    records = read_jsonl(exported)
    assert records
    for record in records:
        src = by_id[record["id"]]
        prompt, reasoning, content = read_back(record, fmt, reasoning_mode)
        expected_prompt = src["messages"] if fmt == "openai-messages" else without_null_content(src["messages"])
        assert prompt == expected_prompt, record["id"]
        assert content == src["content"], record["id"]
        assert reasoning == (None if reasoning_mode == "drop" else src["reasoning"]), record["id"]


# -- formats and round trip ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", CONVERSATION_FORMATS)
@pytest.mark.parametrize("reasoning", ["inline", "field", "drop"])
def test_round_trip(dataset: Path, tmp_path: Path, fmt: str, reasoning: str) -> None:
    dest = tmp_path / "export" / f"{fmt}.jsonl"
    report = export_dataset(dataset, dest, ExportOptions(fmt, truncated="keep", reasoning=reasoning))
    assert report.path == dest and report.written == 8  # 9 records, one of them listed in failed.jsonl
    assert_round_trip(dataset / "raw_responses.jsonl", dest, fmt, reasoning)


def test_openai_messages_record(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    export_dataset(dataset, dest, ExportOptions("openai-messages", reasoning="field"))
    record = next(r for r in read_jsonl(dest) if r["id"] == "b-tools")
    assert record == {"id": "b-tools", "conversations": [
        *PROMPTS["tools"],
        {"role": "assistant", "content": "It is 21 degrees.", "reasoning_content": "Let me think. The user asks."},
    ]}


def test_sharegpt_record(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    export_dataset(dataset, dest, ExportOptions("sharegpt"))
    record = next(r for r in read_jsonl(dest) if r["id"] == "b-tools")
    assert record == {"id": "b-tools", "conversations": [
        {"from": "system", "value": "You are a helpful assistant."},
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "gpt", "value": "", "tool_calls": [CALL]},
        {"from": "tool", "value": "{\"temp\": 21}", "tool_call_id": "call_1", "name": "get_weather"},
        {"from": "gpt", "value": "<think>\nLet me think. The user asks.\n</think>\n\nIt is 21 degrees."},
    ]}
    text_and_call = next(r for r in read_jsonl(dest) if r["id"] == "d-text-call")
    # Tool calls are a key of the turn, never text the model did not write (issue 25)
    assert text_and_call["conversations"][1] == {"from": "gpt", "value": "Let me check.", "tool_calls": [CALL]}
    multi = next(r for r in read_jsonl(dest) if r["id"] == "e-multi")
    assert multi["conversations"][2] == {"from": "gpt", "value": "def total(xs):\n    return sum(xs)",
                                         "reasoning_content": "Easy."}


@pytest.mark.parametrize("reasoning", ["inline", "field"])
def test_exported_turn_renders_as_the_model_generated_it(dataset: Path, tmp_path: Path, tok: Any,
                                                         reasoning: str) -> None:
    """Through the chat template, prompt + exported turn is exactly rendered prompt + response + end of turn."""
    dest = tmp_path / "x.jsonl"
    export_dataset(dataset, dest, ExportOptions("openai-messages", reasoning=reasoning))
    by_id = source_turns(dataset / "raw_responses.jsonl")
    for record in read_jsonl(dest):
        src = by_id[record["id"]]
        whole = tok.apply_chat_template(record["conversations"], tokenize=False)
        prompt = tok.apply_chat_template(src["messages"], tokenize=False, add_generation_prompt=True)
        assert whole == prompt + src["response"] + "<|im_end|>\n", record["id"]


def test_inline_is_the_think_block_then_the_answer(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    export_dataset(dataset, dest, ExportOptions("openai-messages", truncated="keep"))
    turns = {r["id"]: r["conversations"][-1]["content"] for r in read_jsonl(dest)}
    assert turns["a-plain"] == "<think>\nLet me think. The user asks.\n</think>\n\nIt is sunny."
    assert turns["f-no-thinking"] == "<think>\n\n</think>\n\nIt is sunny."  # "" (did not think) is not None
    assert turns["g-cut-thinking"] == "<think>\nI keep thinking and\n</think>\n\n"


def test_no_think_markers_means_no_think_block(tmp_path: Path, tok: Any) -> None:
    records = [to_v2(tok, make_record(tok, "n", "plain", reasoning=None, content="Plain answer."))]
    ds = write_dataset(tmp_path, tok, records, think=None)
    for mode in ("inline", "field"):
        dest = tmp_path / f"{mode}.jsonl"
        export_dataset(ds, dest, ExportOptions("openai-messages", reasoning=mode))
        assert read_jsonl(dest)[0]["conversations"][-1] == {"role": "assistant", "content": "Plain answer."}


def test_reasoning_drop_keeps_only_the_answer(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    report = export_dataset(dataset, dest, ExportOptions("sharegpt", truncated="keep", reasoning="drop"))
    gpt = {r["id"]: r["conversations"][-1] for r in read_jsonl(dest)}
    assert gpt["a-plain"] == {"from": "gpt", "value": "It is sunny."}
    assert gpt["g-cut-thinking"] == {"from": "gpt", "value": ""}
    assert report.empty_turns == 1  # the sample cut while thinking has no answer left


# -- truncated and failed samples ------------------------------------------------------------------------------


def test_truncated_dropped_by_default(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    report = export_dataset(dataset, dest, ExportOptions("openai-messages"))
    ids = [r["id"] for r in read_jsonl(dest)]
    assert ids == ["a-plain", "b-tools", "c-null", "d-text-call", "e-multi", "f-no-thinking"]
    assert (report.written, report.dropped_truncated, report.skipped_failed) == (6, 2, 2)
    assert all("truncated" not in r for r in read_jsonl(dest))


def test_truncated_kept_and_marked(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    report = export_dataset(dataset, dest, ExportOptions("sharegpt", truncated="keep"))
    marked = {r["id"] for r in read_jsonl(dest) if r.get("truncated") is True}
    assert marked == {"g-cut-thinking", "h-cut-answer"}
    assert (report.written, report.dropped_truncated) == (8, 0)


def test_failed_samples_are_never_exported(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    report = export_dataset(dataset, dest, ExportOptions("openai-messages", truncated="keep"))
    ids = {r["id"] for r in read_jsonl(dest)}
    assert "i-failed-too" not in ids and "z-never-answered" not in ids
    assert report.skipped_failed == 2


# -- token ids -------------------------------------------------------------------------------------------------


def test_token_ids_are_the_servers(dataset: Path, tmp_path: Path, tok: Any) -> None:
    """--token-ids: input_ids are the prompt the producer rendered (checked id by id against the worker's digest),
    output_ids the server's own ids verbatim (EOS of a stop included), never re-encoded text."""
    dest = tmp_path / "x.jsonl"
    report = export_dataset(dataset, dest, ExportOptions("openai-messages", truncated="keep", token_ids=True,
                                                            inexact="keep"), tokenizer=tok)
    # The row whose answer starts with "\n" after the prompt's "<think>\n" renders as one "\n\n" token: a
    # trainer would not train on the ids the model produced, so it is counted and marked (kept here)
    assert (report.inexact, [r["id"] for r in read_jsonl(dest) if r.get("inexact")]) == (1, ["f-no-thinking"])
    revision = json.loads((dataset / "run.json").read_text())["tokenizer"]
    expected_hash = hashlib.sha256(tok.chat_template.encode()).hexdigest()
    assert (report.template_hash, report.tokenizer_revision) == (expected_hash, revision)
    assert (report.written, report.prompt_mismatch, report.no_output_ids) == (8, 0, 0)
    by_id = source_turns(dataset / "raw_responses.jsonl")
    for record in read_jsonl(dest):
        src = by_id[record["id"]]
        assert record["input_ids"] == tok.apply_chat_template(src["messages"], add_generation_prompt=True,
                                                              tokenize=True, return_dict=False)
        assert prompt_digest(record["input_ids"]) == src["prompt_ids_sha256"]
        assert record["output_ids"] == src["output_ids"]
        assert (record["template_hash"], record["tokenizer_revision"]) == (expected_hash, revision)
    assert template_hash(tok) == expected_hash


def test_tokens_format_is_prompt_ids_then_output_ids_with_the_loss_on_the_output(dataset: Path, tmp_path: Path,
                                                                                 tok: Any) -> None:
    dest = tmp_path / "tokens.jsonl"
    report = export_dataset(dataset, dest, ExportOptions("tokens", truncated="keep"), tokenizer=tok)
    assert (report.written, report.prompt_mismatch, report.no_output_ids) == (8, 0, 0)
    by_id = source_turns(dataset / "raw_responses.jsonl")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for row in read_jsonl(dest):
        src = by_id[row["id"]]
        prompt = tok.apply_chat_template(src["messages"], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        assert row["turn"] == 0
        assert row["input_ids"] == prompt + src["output_ids"]
        assert row["loss_mask"] == [0] * len(prompt) + [1] * src["completion_tokens"]
        assert len(src["output_ids"]) == src["completion_tokens"]
        # EOS as the server returned it: the last id of a stop, absent from a cut turn
        assert (row["input_ids"][-1] == im_end) == (src["finish_reason"] == "stop")
        assert row.get("truncated", False) == (src["finish_reason"] == "length")
    # Through the template, the openai-messages export renders to exactly these ids, except where the tokenizer
    # merges across the prompt/answer boundary: "f-no-thinking"'s answer starts with "\n" right after the
    # prompt's "<think>\n", and re-tokenizing the whole text makes one "\n\n" of them. The text is the same;
    # only the tokens row has the ids the model saw and produced (docs/export.md, "Which export is exact").
    conversations = tmp_path / "messages.jsonl"
    export_dataset(dataset, conversations, ExportOptions("openai-messages", reasoning="field"))
    rows = {r["id"]: r for r in read_jsonl(dest)}
    for conversation in read_jsonl(conversations):
        whole = tok.apply_chat_template(conversation["conversations"], tokenize=True, return_dict=False)
        ids = rows[conversation["id"]]["input_ids"]
        assert tok.decode(whole).startswith(tok.decode(ids)), conversation["id"]
        assert (whole[:len(ids)] == ids) == (conversation["id"] != "f-no-thinking"), conversation["id"]
    dropped = export_dataset(dataset, dest, ExportOptions("tokens"), tokenizer=tok)
    assert (dropped.written, dropped.dropped_truncated) == (6, 2)


def test_tokens_format_needs_the_runs_tokenizer(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="tokenizer"):
        export_dataset(dataset, tmp_path / "x.jsonl", ExportOptions("tokens"))


def test_prompt_mismatch_is_reported_not_written(tmp_path: Path, tok: Any) -> None:
    records = standard_records(tok)[:3]
    records[1]["turns"][0]["prompt_ids_sha256"] = prompt_digest([1, 2, 3])  # another prompt, id by id
    ds = write_dataset(tmp_path, tok, records)
    dest = tmp_path / "x.jsonl"
    for fmt in ("sharegpt", "tokens"):
        report = export_dataset(ds, dest, ExportOptions(fmt, token_ids=True), tokenizer=tok)
        assert (report.written, report.prompt_mismatch, report.mismatched_ids) == (2, 1, ["b-tools"])
        assert [r["id"] for r in read_jsonl(dest)] == ["a-plain", "c-null"]


def test_records_without_server_ids_are_left_out_of_token_exports_and_counted(tmp_path: Path, tok: Any) -> None:
    """A turn the server gave no output_ids for is counted, not guessed."""
    bare, full = standard_records(tok)[:3], standard_records(tok)[3:6]
    for rec in bare:
        rec["turns"][0]["output_ids"] = None
    ds = write_dataset(tmp_path, tok, bare + full)
    dest = tmp_path / "x.jsonl"
    report = export_dataset(ds, dest, ExportOptions("tokens"), tokenizer=tok)
    assert (report.written, report.no_output_ids) == (3, 3)
    assert [r["id"] for r in read_jsonl(dest)] == [r["id"] for r in full]
    only_bare = write_dataset(tmp_path / "old", tok, bare)
    dest.write_text("old\n")
    with pytest.raises(ExportError, match=r"raw_responses\.jsonl: none of its 3 records has the server's token ids"):
        export_dataset(only_bare, dest, ExportOptions("openai-messages", token_ids=True), tokenizer=tok)
    assert dest.read_text() == "old\n"
    assert export_dataset(only_bare, dest, ExportOptions("openai-messages")).written == 3  # no ids asked for


def test_token_ids_use_the_runs_template_kwargs(tmp_path: Path) -> None:
    hybrid = load_tokenizer(build_tokenizer(tmp_path / "hybrid", thinking="hybrid"))
    kwargs = {"enable_thinking": False}
    record = to_v2(hybrid, make_record(hybrid, "k", "plain", reasoning="", kwargs=kwargs), kwargs)
    ds = write_dataset(tmp_path, hybrid, [record], kwargs=kwargs)
    dest = tmp_path / "x.jsonl"
    report = export_dataset(ds, dest, ExportOptions("openai-messages", token_ids=True, inexact="keep"),
                            tokenizer=hybrid)
    # Neither trainer renders a row with the run's template kwargs: without enable_thinking=False the template
    # renders another prompt, so the row cannot be exact for them (counted; kept here)
    assert report.prompt_mismatch == 0 and report.inexact == 1
    ids = read_jsonl(dest)[0]["input_ids"]
    assert str(hybrid.decode(ids)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_token_ids_need_the_runs_tokenizer(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    with pytest.raises(ExportError, match="tokenizer"):
        export_dataset(dataset, dest, ExportOptions("sharegpt", token_ids=True))
    other = load_tokenizer(build_tokenizer(tmp_path / "other", thinking="hybrid"))
    with pytest.raises(ExportError, match="not the one the run used"):
        export_dataset(dataset, dest, ExportOptions("sharegpt", token_ids=True), tokenizer=other)
    assert not dest.exists()


# -- manifest --------------------------------------------------------------------------------------------------


def test_manifest(dataset: Path, tok: Any) -> None:
    # What /get_server_info answers holds every server argument, api_key included: only the kept keys are written.
    server = {"url": "http://gpu1:30000", "version": "0.5.4", "model_path": "Qwen/Qwen3-8B", "tp_size": 2,
              "api_key": "secret", "internal_states": [{"last_gen_throughput": 1.0}]}
    path = write_manifest(dataset, servers=[server], extra={"budget": 10_000_000, "mode": "drain"})
    assert path == dataset / "manifest.json"
    manifest = json.loads(path.read_text())
    records = read_jsonl(dataset / "raw_responses.jsonl")
    lengths = sorted(r["completion_tokens"] for r in records)
    run = json.loads((dataset / "run.json").read_text())
    assert manifest["dataset"] == "ds"
    assert manifest["counts"] == {"samples": 9, "failed": 2, "truncated": 2, "reasoning_truncated": 1,
                                  "reasoning_unclosed": 0, "tool_calls": 0, "tool_call_errors": 0}
    assert manifest["reasoning_parser"] is None  # the fixture's run.json names none
    assert manifest["record_versions"] == {"2": 9}
    assert manifest["tokens"] == {"prompt": sum(r["turns"][0]["prompt_tokens"] for r in records),
                                  "completion": sum(lengths)}
    assert manifest["finish_reasons"] == {"length": 2, "stop": 7}
    assert manifest["completion_length"] == {"mean": round(sum(lengths) / 9, 2), "p50": lengths[4],
                                             "p95": lengths[8], "max": lengths[8]}
    assert manifest["sampling_params"] == {"max_new_tokens": 64} and manifest["settings"] == run
    assert manifest["server"] == {"version": "0.5.4", "model_path": "Qwen/Qwen3-8B", "tp_size": 2}
    assert manifest["servers"] == [{"url": "http://gpu1:30000", **manifest["server"]}]
    assert manifest["extra"] == {"budget": 10_000_000, "mode": "drain"}
    assert manifest["budgetq_version"] == metadata.version("budgetq")
    assert manifest["created"].endswith("Z")


def test_export_refreshes_the_manifest_and_keeps_what_only_the_caller_knew(dataset: Path, tmp_path: Path) -> None:
    write_manifest(dataset, servers=[{"url": "http://gpu1:30000", "version": "0.5.4"}], extra={"budget": 1000})
    report = export_dataset(dataset, tmp_path / "x.jsonl", ExportOptions("sharegpt"))
    manifest = json.loads(report.manifest.read_text())
    assert manifest["counts"]["samples"] == 9
    assert (manifest["server"], manifest["extra"]) == ({"version": "0.5.4"}, {"budget": 1000})
    export_dataset(dataset, tmp_path / "x.jsonl", ExportOptions("sharegpt"), extra={"budget": 2000})
    assert json.loads(report.manifest.read_text())["extra"] == {"budget": 2000}


def test_manifest_of_an_empty_dataset(tmp_path: Path, tok: Any) -> None:
    ds = write_dataset(tmp_path, tok, [])
    manifest = json.loads(write_manifest(ds).read_text())
    assert manifest["counts"]["samples"] == 0
    assert manifest["completion_length"] == {"mean": None, "p50": None, "p95": None, "max": None}
    assert "server" not in manifest and "extra" not in manifest


# -- files -----------------------------------------------------------------------------------------------------


def test_dest_is_replaced_atomically(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    dest.write_text("old\n")
    export_dataset(dataset, dest, ExportOptions("sharegpt"))
    assert len(read_jsonl(dest)) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "x.jsonl"]  # no temporary file left


def test_a_bad_line_leaves_dest_untouched(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.jsonl"
    dest.write_text("old\n")
    source = dataset / "raw_responses.jsonl"
    lines = source.read_text().splitlines(keepends=True)
    source.write_text("".join(lines[:3] + ["{not json\n"] + lines[3:]))
    with pytest.raises(ExportError, match=r"raw_responses\.jsonl:4: not valid JSON"):
        export_dataset(dataset, dest, ExportOptions("sharegpt"))
    assert dest.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "x.jsonl"]


def test_a_torn_last_line_is_skipped(dataset: Path, tmp_path: Path) -> None:
    source = dataset / "raw_responses.jsonl"
    with open(source, "a", encoding="utf-8") as fh:
        fh.write('{"id": "torn", "dataset": "ds", "mess')
    report = export_dataset(dataset, tmp_path / "x.jsonl", ExportOptions("sharegpt", truncated="keep"))
    assert report.torn_tail and report.written == 8


def test_refuses_to_overwrite_the_datasets_own_files(dataset: Path) -> None:
    before = (dataset / "raw_responses.jsonl").read_bytes()
    for name in ("raw_responses.jsonl", "run.json", "failed.jsonl", "manifest.json"):
        with pytest.raises(ExportError, match="dataset's own files"):
            export_dataset(dataset, dataset / name, ExportOptions("sharegpt"))
    with pytest.raises(ExportError, match="is a directory"):
        export_dataset(dataset, dataset, ExportOptions("sharegpt"))
    assert (dataset / "raw_responses.jsonl").read_bytes() == before


def test_user_errors(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="format must be one of sharegpt, openai-messages, tokens"):
        ExportOptions("csv")
    with pytest.raises(ExportError, match="reasoning must be one of"):
        ExportOptions("sharegpt", reasoning="hide")
    with pytest.raises(ExportError, match="run.json not found"):
        export_dataset(tmp_path, tmp_path / "x.jsonl", ExportOptions("sharegpt"))


# -- the demo's real output ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def demo_out(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One run of the demo (about 5 s): real collector output from real workers and the simulator."""
    if find_redis_server() is None:
        pytest.skip("redis-server is not installed")
    workdir = tmp_path_factory.mktemp("demo")
    # --turns last (BUDGETQ_TURNS): the round trips below check one regenerated turn per record.
    proc = subprocess.Popen([sys.executable, "-m", "demo.run", "--workdir", str(workdir)], cwd=workdir,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "BUDGETQ_TURNS": "last"})
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the demo then stops what it started
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output.decode(errors="replace")[-4000:]
    yield workdir / "out"


@pytest.mark.e2e
@pytest.mark.timeout(150)
@pytest.mark.parametrize("fmt", CONVERSATION_FORMATS)
def test_demo_output_round_trips_with_token_ids(demo_out: Path, tmp_path: Path, fmt: str) -> None:
    tok = load_tokenizer(demo_out.parent / "tokenizer")
    for name in ("glaive_fc", "code_instruct", "agent_traces"):
        dest = tmp_path / f"{name}.jsonl"
        options = ExportOptions(fmt, truncated="keep", token_ids=True, inexact="keep")
        report = export_dataset(demo_out / name, dest, options, tokenizer=tok)
        source = demo_out / name / "raw_responses.jsonl"
        assert report.written == len(read_jsonl(source)) and report.prompt_mismatch == 0
        assert_round_trip(source, dest, fmt, "inline")


def test_produce_export_command(dataset: Path, tmp_path: Path, tokenizer_dir: Path) -> None:
    from click.testing import CliRunner

    from producer.cli import main
    out_dir, name = dataset.parent, dataset.name
    dest = tmp_path / "train.jsonl"
    res = CliRunner().invoke(main, ["export", name, "--out", str(out_dir), "--format", "openai-messages",
                                    "--reasoning", "field", "--dest", str(dest), "--token-ids", "--tokenizer",
                                    str(tokenizer_dir)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "conversations ->" in res.output
    assert_round_trip(dataset / "raw_responses.jsonl", dest, "openai-messages", "field")
    assert (dataset / "manifest.json").exists()
    bad = CliRunner().invoke(main, ["export", name, "--out", str(out_dir), "--token-ids"])
    assert bad.exit_code == 2 and "--tokenizer" in bad.output
    res = CliRunner().invoke(main, ["export", name, "--out", str(out_dir), "--format", "tokens", "--tokenizer",
                                    str(tokenizer_dir)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert len(read_jsonl(out_dir / name / "tokens.jsonl")) == 6
    bad = CliRunner().invoke(main, ["export", name, "--out", str(out_dir), "--format", "tokens"])
    assert bad.exit_code == 2 and "--tokenizer" in bad.output


def test_parsed_tool_calls_are_written_and_unclosed_reasoning_is_truncated(tmp_path: Path, tok: Any) -> None:
    call = {"id": "call_0123", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    with_call = to_v2(tok, make_record(tok, "a-call", "plain", content=""))
    with_call["reasoning_parser"] = "qwen3-thinking"
    turn = with_call["turns"][0]
    turn.update(response=turn["response"] + '<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>', tool_calls=[call], tool_call_errors=0)
    unclosed = to_v2(tok, make_record(tok, "b-unclosed", "plain", reasoning="It never ends", content="",
                                      reasoning_truncated=True))
    unclosed.update(reasoning_parser="qwen3-thinking", incomplete=True, stopped_by="reasoning_unclosed")
    unclosed["turns"][0].update(reasoning_truncated=False, reasoning_unclosed=True, tool_calls=[],
                                tool_call_errors=1)  # stopped by EOS in mid-thought
    ds = write_dataset(tmp_path, tok, [with_call, unclosed])
    dest = tmp_path / "x.jsonl"
    report = export_dataset(ds, dest, ExportOptions("openai-messages", reasoning="field"))
    assert (report.written, report.dropped_truncated) == (1, 1)
    (turn,) = [r["conversations"][-1] for r in read_jsonl(dest)]
    assert turn["tool_calls"] == [call] and turn["content"] == ""
    export_dataset(ds, dest, ExportOptions("sharegpt"))
    (gpt,) = [r["conversations"][-1] for r in read_jsonl(dest)]
    assert gpt["tool_calls"] == [call] and gpt["value"] == "<think>\nLet me think. The user asks.\n</think>\n\n"
    manifest = json.loads((ds / "manifest.json").read_text())
    assert manifest["counts"]["reasoning_unclosed"] == 1 and manifest["counts"]["tool_calls"] == 1
    assert manifest["counts"]["tool_call_errors"] == 1 and manifest["counts"]["truncated"] == 1


def test_tokens_refuses_output_ids_beyond_the_vocabulary(dataset: Path, tmp_path: Path, tok: Any) -> None:
    """An id the tokenizer does not have is not the model's (a server with another tokenizer, or sglang_sim run
    without --tokenizer, as `make demo` once did): the export refuses it, naming the line, and writes nothing."""
    source = dataset / "raw_responses.jsonl"
    lines = source.read_text().splitlines()
    rec = json.loads(lines[1])
    rec["turns"][0]["output_ids"][0] = len(tok)
    lines[1] = json.dumps(rec)
    source.write_text("\n".join(lines) + "\n")
    dest = tmp_path / "tokens.jsonl"
    with pytest.raises(ExportError, match=rf"raw_responses.jsonl:2: turns\[0\]: output_ids holds id {len(tok)}, "
                                          rf"outside the tokenizer's {len(tok)}-id vocabulary"):
        export_dataset(dataset, dest, ExportOptions("tokens", truncated="keep"), tokenizer=tok)
    assert not dest.exists()


# -- produce export's command line (issue 29): where it reads Redis from, what it says of a dataset still running,
# how it names conversations left out, and which tokenizer it uses ---------------------------------------------


@pytest.fixture
def ds(tmp_path: Path, tok: Any) -> Path:
    return write_dataset(tmp_path, tok, standard_records(tok))


def export_cli(ds: Path, *args: str, env: dict[str, str | None] | None = None) -> Result:
    from producer.cli import main
    return CliRunner().invoke(main, ["export", ds.name, "--out", str(ds.parent), *args],
                              env={"REDIS_URL": None, **(env or {})}, catch_exceptions=False)


def manifest_of(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_export_reads_redis_url_like_every_command(ds: Path, r: redis.Redis, redis_url: str) -> None:
    Ledger(r).set_budget(ds.name, 1234)
    res = export_cli(ds, env={"REDIS_URL": redis_url})
    assert res.exit_code == 0, res.output
    assert manifest_of(ds / "manifest.json")["extra"]["budget"] == 1234
    (ds / "manifest.json").unlink()
    res = export_cli(ds)  # neither --redis-url nor REDIS_URL: no Redis is read
    assert res.exit_code == 0, res.output
    assert "extra" not in manifest_of(ds / "manifest.json")


def start_running(r: redis.Redis, name: str) -> None:
    """Redis as a run leaves it mid-way: the dataset open, one chunk queued, 200 samples selected."""
    assert Ledger(r).set_budget(name, 100_000) == "open"
    state = RunState(r)
    with r.pipeline(transaction=True) as pipe:
        state.hold(pipe, name, state.next_chunk_ids(name, 1), {"s1": "c1"})
        pipe.execute()
    state.set_progress(name, selected=200, todo=150)


def test_exporting_a_running_dataset_warns_and_leaves_the_runs_manifest(ds: Path, tmp_path: Path, r: redis.Redis,
                                                                        redis_url: str) -> None:
    run_manifest = ds / "manifest.json"
    run_manifest.write_text('{"dataset": "ds", "written": "at the run\'s end"}\n', encoding="utf-8")
    start_running(r, ds.name)
    dest = tmp_path / "train" / "b1.jsonl"
    res = export_cli(ds, "--dest", str(dest), "--redis-url", redis_url)
    assert res.exit_code == 0, res.output
    [warning] = [line for line in res.output.splitlines() if "still running" in line]
    assert f"{ds.name} is still running (0/200 samples done)" in warning
    assert run_manifest.read_text(encoding="utf-8") == '{"dataset": "ds", "written": "at the run\'s end"}\n'
    beside = tmp_path / "train" / "b1.manifest.json"
    written = manifest_of(beside)
    assert written["running"] is True and written["extra"]["status"] == "open"
    assert written["counts"]["samples"] == len(standard_records_v2(ds))
    assert res.stdout.rstrip().endswith(f"manifest {beside}")
    Ledger(r).close(ds.name)  # the run ended: the export refreshes the run's manifest again, with no warning
    r.delete(keys.DatasetKeys(ds.name).chunks)
    res = export_cli(ds, "--dest", str(dest), "--redis-url", redis_url)
    assert res.exit_code == 0 and "still running" not in res.output, res.output
    assert "running" not in manifest_of(run_manifest) and manifest_of(run_manifest)["counts"]["samples"] > 0


def standard_records_v2(ds: Path) -> list[str]:
    return (ds / "raw_responses.jsonl").read_text(encoding="utf-8").splitlines()


def test_summary_calls_conversations_that_ended_early_incomplete_not_truncated(tmp_path: Path, tok: Any) -> None:
    recs = standard_records(tok)  # two of them truncated: g-cut-thinking, h-cut-answer
    recs[0].update(incomplete=True, stopped_by="tool_mismatch")
    recs[1].update(incomplete=True, stopped_by="budget")
    recs[2].update(incomplete=True, stopped_by="tool_mismatch")
    ds = write_dataset(tmp_path, tok, recs)
    res = export_cli(ds)
    assert res.exit_code == 0, res.output
    assert ("(2 truncated dropped, 3 incomplete dropped (budget 1, tool_mismatch 2), 0 failed skipped)"
            in res.stdout), res.stdout


def with_stored_tokenizer(ds: Path, path: str) -> None:
    run_json = ds / "run.json"
    run_json.write_text(json.dumps({**json.loads(run_json.read_text()), "tokenizer_path": path}), encoding="utf-8")


def test_tokens_use_the_tokenizer_the_run_stored(ds: Path, tmp_path: Path, tokenizer_dir: Path) -> None:
    res = export_cli(ds, "--format", "tokens")  # run.json names none (a run made before it did): asked for
    assert res.exit_code == 2 and "--tokenizer" in res.output, res.output
    with_stored_tokenizer(ds, str(tokenizer_dir.resolve()))
    res = export_cli(ds, "--format", "tokens")
    assert res.exit_code == 0, res.output
    assert len((ds / "tokens.jsonl").read_text().splitlines()) == 7  # the untruncated turns
    gone = tmp_path / "moved-away"
    with_stored_tokenizer(ds, str(gone))
    res = export_cli(ds, "--format", "tokens")
    assert res.exit_code == 2 and f"the run's tokenizer {gone} (run.json tokenizer_path) no longer exists" in \
        res.output, res.output
    res = export_cli(ds, "--format", "tokens", "--tokenizer", str(tokenizer_dir))  # an explicit one wins
    assert res.exit_code == 0, res.output


def test_attach_stores_the_tokenizer_path_and_a_rerun_may_name_it_otherwise(
        tmp_path: Path, tokenizer_dir: Path, redis_url: str, r: redis.Redis) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    base = [str(data), "--max-tokens", "16", "--out", str(out), "--detach"]
    res = produce([*base, "--tokenizer", str(tokenizer_dir)], redis_url)
    assert res.returncode == 0, res.stderr
    stored = json.loads((out / "prompts" / "run.json").read_text())
    assert stored["tokenizer_path"] == str(tokenizer_dir.resolve())
    link = tmp_path / "tok-link"
    link.symlink_to(tokenizer_dir)
    r.flushall()  # the files are the truth: run.json is what the rerun is compared with
    res = produce([*base, "--tokenizer", str(link)], redis_url)
    assert res.returncode == 0, res.stderr  # the same tokenizer by another path is the same run
