"""The output record, and the --seed / --skip-special-tokens decisions. Pure functions: no Redis, no server."""
from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from budget import record, serverinfo
from budget.record import VERSION, ChunkPayload, SamplePayload
from producer.launch import seed_warning
from producer.settings import skip_special_tokens_default
from worker.sglang import GenerateError, parse_generation, result_record


def chunk() -> ChunkPayload:
    return {"v": VERSION, "dataset": "ds", "chunk": "c1", "sampling_params": {"max_new_tokens": 64},
            "think": {"start": "<think>", "end": "</think>"}, "reasoning_parser": "qwen3", "samples": []}


def sample(ids: list[int]) -> SamplePayload:
    return {"id": "s1", "input_ids": ids, "opens_think": True}


def body(text: str, ids: list[int], finish: dict[str, Any]) -> dict[str, Any]:
    return {"text": text, "output_ids": ids, "meta_info": {"id": "r", "finish_reason": finish, "prompt_tokens": 3,
                                                          "completion_tokens": len(ids), "cached_tokens": 1}}


def test_the_worker_builds_a_version_2_record_from_the_servers_answer() -> None:
    gen = parse_generation(body("R\n</think>\n\nA", [11, 12, 13, 2], {"type": "stop", "matched": 2}), 64, "u")
    assert gen.output_ids == [11, 12, 13, 2]
    rec = result_record("ds", sample([5, 6, 7]), gen, chunk())
    assert "messages" not in rec  # the producer adds them when it writes the line
    assert list(rec) == [f for f in record.RECORD_FIELDS if f != "messages"]
    assert (rec["record_version"], rec["id"], rec["completion_tokens"], rec["incomplete"]) == (2, "s1", 4, False)
    (turn,) = rec["turns"]
    assert list(turn) == list(record.TURN_FIELDS)
    assert (turn["reasoning"], turn["content"], turn["output_ids"], turn["cached_tokens"]) == (
        "R", "A", [11, 12, 13, 2], 1)
    assert turn["prompt_ids_sha256"] == hashlib.sha256(b"5,6,7").hexdigest() == record.prompt_digest([5, 6, 7])
    assert record.prompt_digest([5, 6, 7]) != record.prompt_digest([5, 6, 8])
    line = record.ordered({**rec, "messages": [{"role": "user", "content": "q"}]})
    assert list(line) == list(record.RECORD_FIELDS)
    assert json.loads(json.dumps(line)) == line


@pytest.mark.parametrize("ids", [[], [0], [7, 0, 31999], list(range(0, 200_000, 37)), [2**31 - 1, 151_643]])
def test_the_prompt_digest_is_of_the_ids_joined_by_commas(ids: list[int]) -> None:
    """The documented text (docs/export.md), whatever writes it: a list, or any other sequence of the same ids."""
    want = hashlib.sha256(",".join(str(i) for i in ids).encode("ascii")).hexdigest()
    assert record.prompt_digest(ids) == want
    assert record.prompt_digest(tuple(ids)) == want


def test_a_turn_cut_while_thinking_is_incomplete() -> None:
    gen = parse_generation(body("R R", [11, 11], {"type": "length", "length": 2}), 2, "u")
    rec = result_record("ds", sample([5]), gen, chunk())
    assert (rec["incomplete"], rec["stopped_by"], rec["turns"][0]["reasoning_truncated"]) == (
        True, "length", True)
    unclosed = record.make_record(sample_id="x", dataset="d", turns=[{**rec["turns"][0], "finish_reason": "stop",
                                                                      "reasoning_truncated": False,
                                                                      "reasoning_unclosed": True}],
                                  reasoning_parser="qwen3", sampling_params={})
    assert (unclosed["incomplete"], unclosed["stopped_by"]) == (True, "reasoning_unclosed")


@pytest.mark.parametrize("ids", [[1, 2], ["1", 2, 3], [1.5, 2, 3], [1, True, 3], [1, None, 3]])
def test_output_ids_that_break_the_contract_are_retried(ids: list[Any]) -> None:
    with pytest.raises(GenerateError, match="output_ids") as err:
        parse_generation(body("abc", [1, 2, 3], {"type": "stop", "matched": 2}) | {"output_ids": ids}, 64, "u")
    assert err.value.retryable


def test_skip_special_tokens_default_is_the_parsers_rule() -> None:
    assert skip_special_tokens_default("gpt-oss") is False
    assert all(skip_special_tokens_default(p) for p in (None, "qwen3", "deepseek-r1", "glm45", "kimi_k2"))
    from worker import reasoning
    rule = getattr(reasoning, "skip_special_tokens_for", None)
    parsers = getattr(reasoning, "PARSERS", ())
    if rule is None:
        pytest.skip("worker.reasoning has no skip_special_tokens_for yet")
    for parser in parsers:
        assert skip_special_tokens_default(parser) == rule(parser), parser


def test_a_seed_is_honoured_only_with_deterministic_inference() -> None:
    seeded = {"max_new_tokens": 8, "sampling_seed": 3}
    on = {"url": "http://a", "enable_deterministic_inference": True}
    off = {"url": "http://b", "enable_deterministic_inference": False}
    old = {"url": "http://c"}
    assert serverinfo.seed_honoured([on, on]) is True
    assert serverinfo.seed_honoured([on, off]) is False
    assert serverinfo.seed_honoured([old]) is None and serverinfo.seed_honoured([]) is None
    assert seed_warning([on], seeded) is None
    assert seed_warning([], seeded) is None  # nothing recorded yet: checked again at the end of the run
    assert seed_warning([on, off], {"max_new_tokens": 8}) is None  # no seed, nothing to say
    message = seed_warning([on, off, old], seeded)
    assert message and "--seed 3" in message and "2 of the 3" in message
    assert "--enable-deterministic-inference" in message
    assert serverinfo.pick({"enable_deterministic_inference": False, "api_key": "x"}) == {
        "enable_deterministic_inference": False}
