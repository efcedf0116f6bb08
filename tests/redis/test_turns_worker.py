"""The worker's side of ``--turns all`` (worker/turns.py, worker/conversation.py) in-process: a Dispatcher on a
real Ledger and the simulator over HTTP, chunks enqueued as the producer enqueues them, the tokenizer files in
Redis as ``produce`` shares them. Each test checks the ledger's invariant: ``used`` = Σ done + Σ unwritten turns.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from budget.ledger import Ledger
from budget.record import (
    LENGTH,
    TOOL_MISMATCH,
    VERSION,
    ChunkPayload,
    SamplePayload,
    header,
    make_turn,
    plan,
    prompt_digest,
    turn_prompts,
    walk,
)
from producer.results import entry_record
from producer.session.attach import JobSettings, share_tokenizer
from producer.session.loop import Item, enqueue_chunks, make_queue
from render.chat import Renderer, load_tokenizer
from tests.dispatcher import dispatcher, until
from tests.procs import sim_stats
from tests.replies import entries, raw
from worker import turns

DS = "conv"
SIM_ARGS = ("--tokens-per-second-per-request", "2000", "--prefix-cache-pages", "0", "--prefill-tokens-per-second", "0",
            "--length-dist", "fixed", "--mean-tokens", "12", "--reasoning-fraction", "0")
MAX_NEW = 64
SAMPLING = {"max_new_tokens": MAX_NEW, "temperature": 0}
DATASET_ANSWER = "zebra quartz obsidian"  # words the dataset's own answers use, and no prompt may hold


def conversation(sid: str, users: int = 3) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    for u in range(users):
        out.append({"role": "user", "content": f"question {u} of {sid}"})
        if u + 1 < users:
            out.append({"role": "assistant", "content": f"{DATASET_ANSWER} {u}"})
    return out


@pytest.fixture
def renderer(tokenizer_dir: Path, r: "redis.Redis", tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Renderer:
    rend = Renderer(load_tokenizer(tokenizer_dir))
    share_tokenizer(r, tokenizer_dir, rend.fingerprint())
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the worker's tokenizer cache: this test's own
    turns.forget()
    return rend


def enqueue(r: "redis.Redis", rend: Renderer, convs: dict[str, list[dict[str, Any]]],
            max_context: int = 4096) -> ChunkPayload:
    """One chunk of conversations as ``produce --turns all`` enqueues it: turn 0 rendered, the messages along."""
    ledger = Ledger(r)
    if not ledger.state(DS).status:
        ledger.set_mode(DS, "drain", MAX_NEW)
        ledger.set_budget(DS, None)
    samples: list[SamplePayload] = []
    items = []
    for sid, messages in convs.items():
        first = rend.render(plan(messages)[0].context)
        items.append(Item(sid, first.input_ids, first.opens_think))
        samples.append({"id": sid, "input_ids": first.input_ids, "opens_think": first.opens_think,
                        "messages": messages, "turns": len(plan(messages))})
    (cid,) = enqueue_chunks(r, make_queue(r), DS, [items], sampling_params=SAMPLING, think=None,
                            settings=JobSettings())
    return {"v": VERSION, "dataset": DS, "chunk": cid, "sampling_params": SAMPLING,
            "think": {"start": "<think>", "end": "</think>"}, "reasoning_parser": "qwen3",
            "samples": samples,
            "conversation": {"tokenizer": rend.fingerprint(), "chat_template_kwargs": {}, "max_context": max_context,
                             "open_markers": None}}


def run(redis_url: str, sim_url: str, chunk: ChunkPayload, concurrency: int = 8) -> Any:
    async def go() -> Any:
        async with dispatcher(redis_url, sim_url, concurrency=concurrency) as d:
            return await d.dispatch(chunk)
    return asyncio.run(go())


def records(r: "redis.Redis") -> dict[str, dict[str, Any]]:
    out = {}
    for _id, fields in entries(r.xrange(keys.DatasetKeys(DS).results)):
        rec = entry_record(fields, lambda sid: None)
        out[rec["id"]] = rec
    return out


def assert_invariant(r: "redis.Redis") -> None:
    """used = Σ done + Σ unwritten turns; and every record's messages interleave with its turns as the export
    reads them (budget/record.py raises otherwise)."""
    for rec in records(r).values():
        assert len(turn_prompts(rec["messages"], rec["turns"])) == len(rec["turns"])
    ledger = Ledger(r)
    done = sum(ledger.done_ids(DS).values())
    assert ledger.state(DS).used == done + ledger.unwritten_turn_tokens(DS)


def test_every_turn_is_generated_on_the_models_own_history(r: "redis.Redis", redis_url: str, sim_factory: Any,
                                                            renderer: Renderer) -> None:
    sim = sim_factory(*SIM_ARGS)
    convs = {f"c{i}": conversation(f"c{i}") for i in range(4)}
    report = run(redis_url, sim.url, enqueue(r, renderer, convs))
    assert report.committed == 4 and report.failed == 0 and report.duplicates == 0
    recs = records(r)
    assert set(recs) == set(convs)
    tok = load_tokenizer(renderer_dir(renderer))
    for sid, rec in recs.items():
        assert len(rec["turns"]) == 3 and rec["incomplete"] is False and rec["stopped_by"] is None
        # what was sent: system and the user turns; never the dataset's answers
        assert [m["role"] for m in rec["messages"]] == ["system", "user", "user", "user"]
        for i, (prompt, turn) in enumerate(zip(turn_prompts(rec["messages"], rec["turns"]), rec["turns"], strict=True)):
            ids = renderer.render(prompt).input_ids
            assert turn["prompt_ids_sha256"] == prompt_digest(ids), f"{sid} turn {i}: not the prompt it was sent"
            text = tok.decode(ids)
            assert DATASET_ANSWER not in text
            for earlier in rec["turns"][:i]:
                assert earlier["content"].strip() in text  # the model's own previous answers are its history
        assert rec["completion_tokens"] == sum(t["completion_tokens"] for t in rec["turns"])
    assert sim_stats(sim.url)["submitted"] == 12
    k = keys.DatasetKeys(DS)
    assert r.hlen(k.turns) == 0 and r.hlen(k.turnrec) == 0 and r.hlen(k.convs) == 0 and r.hlen(k.pending) == 0
    assert_invariant(r)
    assert Ledger(r).state(DS).used == sum(rec["completion_tokens"] for rec in recs.values())


def renderer_dir(rend: Renderer) -> Path:
    return turns.cache_root() / rend.fingerprint()


def test_a_resumed_conversation_goes_on_from_its_committed_turn(r: "redis.Redis", redis_url: str, sim_factory: Any,
                                                                  renderer: Renderer) -> None:
    """Turn 0 committed by a worker that died: the next worker generates turns 1 and 2 only, on turn 0's text."""
    sim = sim_factory(*SIM_ARGS)
    messages = conversation("c0")
    chunk = enqueue(r, renderer, {"c0": messages})
    first = make_turn(response="an answer of the dead worker", reasoning=None, content="an answer of the dead worker",
                      reasoning_truncated=False, reasoning_unclosed=False, tool_calls=[], prompt_tokens=10,
                      cached_tokens=0, completion_tokens=7, finish_reason="stop",
                      prompt_ids=chunk["samples"][0]["input_ids"], output_ids=None)
    ledger = Ledger(r)
    assert ledger.commit_turn(DS, "c0", 0, 7, first).committed
    report = run(redis_url, sim.url, chunk)
    assert report.committed == 1
    rec = records(r)["c0"]
    assert [t["completion_tokens"] for t in rec["turns"]][0] == 7 and len(rec["turns"]) == 3
    assert rec["turns"][0]["content"] == "an answer of the dead worker"
    assert sim_stats(sim.url)["submitted"] == 2  # a committed turn is never generated again
    prompt = turn_prompts(rec["messages"], rec["turns"])[1]
    assert rec["turns"][1]["prompt_ids_sha256"] == prompt_digest(renderer.render(prompt).input_ids)
    assert_invariant(r)


def test_a_lowered_budget_stops_started_conversations(r: "redis.Redis", redis_url: str, sim_factory: Any,
                                                       renderer: Renderer) -> None:
    """The budget lowered to what is used while turn 0 runs: that turn is committed (GPU work is kept), then
    admit_turn stops the conversation with stopped_by budget, and its one turn is written."""
    sim = sim_factory("--tokens-per-second-per-request", "10", "--length-dist", "fixed", "--mean-tokens", "20",
                      "--reasoning-fraction", "0", "--prefill-tokens-per-second", "0")
    chunk = enqueue(r, renderer, {"c0": conversation("c0")})
    ledger = Ledger(r)

    async def go() -> Any:
        async with dispatcher(redis_url, sim.url, concurrency=4) as d:
            report = await d.dispatch(chunk)
            await until(lambda: sim_stats(sim.url)["running"] == 1, "turn 0 to run")
            ledger.set_budget(DS, 0)  # <= used: closed, and cut
            return report

    report = asyncio.run(go())
    rec = records(r)["c0"]
    assert rec["stopped_by"] == "budget" and rec["incomplete"] is True and len(rec["turns"]) == 1
    assert rec["turns"][0]["finish_reason"] == "stop"
    assert report.committed == 1 and sim_stats(sim.url)["submitted"] == 1
    assert_invariant(r)


def test_a_turn_past_the_context_ends_the_conversation_there(r: "redis.Redis", redis_url: str, sim_factory: Any,
                                                              renderer: Renderer) -> None:
    sim = sim_factory(*SIM_ARGS)
    messages = conversation("c0")
    n0 = len(renderer.render(plan(messages)[0].context).input_ids)
    report = run(redis_url, sim.url, enqueue(r, renderer, {"c0": messages}, max_context=n0 + MAX_NEW))
    rec = records(r)["c0"]
    assert report.committed == 1
    assert rec["stopped_by"] == "context" and rec["incomplete"] is True and len(rec["turns"]) == 1
    assert sim_stats(sim.url)["submitted"] == 1
    assert_invariant(r)


# -- the walk over a conversation's plan (pure) -------------------------------------------------------------------
def _turn(content: str = "ok", calls: list[str] | None = None, finish: str = "stop") -> dict[str, Any]:
    return {"content": content, "reasoning": None, "finish_reason": finish, "completion_tokens": 3,
            "tool_calls": [{"id": f"call_{n}_{i}", "type": "function", "function": {"name": n, "arguments": "{}"}}
                           for i, n in enumerate(calls or [])]}


TOOLS: list[dict[str, Any]] = [
    {"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "d1", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": "result of f", "tool_call_id": "d1"},
    {"role": "assistant", "content": "dataset says"}, {"role": "user", "content": "u2"}]


def test_matching_tool_calls_splice_the_datasets_results_with_the_models_call_ids() -> None:
    w = walk(plan(TOOLS), [_turn(calls=["f"])])
    assert w.stopped_by is None and w.prompt is not None
    assert w.sent[-1] == {"role": "tool", "content": "result of f", "tool_call_id": "call_f_0"}
    assert w.prompt[-2]["tool_calls"][0]["id"] == "call_f_0"
    w2 = walk(plan(TOOLS), [_turn(calls=["f"]), _turn("after the tool")])
    assert [m["role"] for m in w2.sent] == ["system", "user", "tool", "user"]
    assert walk(plan(TOOLS), [_turn(calls=["f"]), _turn("x"), _turn("end")]).prompt is None


def test_other_tool_calls_stop_with_tool_mismatch_and_no_calls_skip_the_tool_exchange() -> None:
    w = walk(plan(TOOLS), [_turn(calls=["g"])])
    assert w.stopped_by == TOOL_MISMATCH and w.prompt is None
    assert walk(plan(TOOLS), [_turn(calls=["f", "f"])]).stopped_by == TOOL_MISMATCH
    skipped = walk(plan(TOOLS), [_turn("no tools needed")])
    assert skipped.prompt is not None and [m["role"] for m in skipped.sent] == ["system", "user", "user"]
    plain = conversation("x", users=2)
    assert walk(plan(plain), [_turn(calls=["f"])]).stopped_by == TOOL_MISMATCH  # dataset has no results to splice


def test_a_truncated_turn_ends_the_conversation_unless_it_is_the_last() -> None:
    plain = conversation("x", users=3)
    w = walk(plan(plain), [_turn(finish="length")])
    assert w.stopped_by == LENGTH and w.prompt is None
    last = walk(plan(plain), [_turn(), _turn(), _turn(finish="length")])
    assert last.stopped_by is None and last.prompt is None
    rec = header(sample_id="x", dataset="d", sent=last.sent, turns=[_turn(), _turn(), _turn(finish="length")],
                          stopped_by=None, reasoning_parser=None, sampling_params={})
    assert rec["incomplete"] is True and "turns" not in rec
    assert json.dumps(rec)  # JSON all the way: it goes to Redis as is


def test_a_stranded_conversation_is_ended_with_the_turns_it_has(r: "redis.Redis", renderer: Renderer) -> None:
    """No worker may pick it up (its dataset closed after its worker died): end_as_is writes its committed turns
    as one record, stopped_by budget, once; the counted tokens are then in done, nothing is left in Redis."""
    from budget.record import end_as_is
    ledger = Ledger(r)
    ledger.set_mode(DS, "drain", MAX_NEW)
    ledger.set_budget(DS, None)
    messages = conversation("c9")
    first = _turn("first answer")
    first.update(completion_tokens=9, finish_reason="stop")
    assert ledger.commit_turn(DS, "c9", 0, 9, first).committed
    ended = end_as_is(ledger, DS, "c9", messages, reasoning_parser=None, sampling_params=SAMPLING)
    assert ended.ended
    rec = records(r)["c9"]
    assert rec["stopped_by"] == "budget" and rec["incomplete"] and rec["completion_tokens"] == 9
    assert [m["role"] for m in rec["messages"]] == ["system", "user"]  # ends at its last turn's prompt
    assert end_as_is(ledger, DS, "c9", messages, reasoning_parser=None, sampling_params=SAMPLING) is None
    assert ledger.done_ids(DS) == {"c9": 9}
    assert_invariant(r)


def test_a_warm_stop_leaves_a_conversation_between_turns_for_another_worker(
        r: "redis.Redis", redis_url: str, sim_factory: Any, renderer: Renderer) -> None:
    """SIGTERM's warm stop while turn 0 runs: that turn finishes and is committed (GPU work kept), then the
    conversation is given back between turns instead of holding the shutdown for its remaining turns; the next
    worker resumes it at turn 1."""
    sim = sim_factory("--tokens-per-second-per-request", "10", "--length-dist", "fixed", "--mean-tokens", "20",
                      "--reasoning-fraction", "0", "--prefill-tokens-per-second", "0")
    chunk = enqueue(r, renderer, {"c0": conversation("c0")})

    async def go() -> Any:
        async with dispatcher(redis_url, sim.url, concurrency=4) as d:
            report = await d.dispatch(chunk)
            await until(lambda: sim_stats(sim.url)["running"] == 1, "turn 0 to run")
            d.stop()
            return report

    report = asyncio.run(go())
    k = keys.DatasetKeys(DS)
    assert report.not_started == 1 and report.committed == 0 and sim_stats(sim.url)["submitted"] == 1
    assert int(raw(r.hget(k.convs, "c0"))) == 1 and r.xlen(k.results) == 0
    assert_invariant(r)
    # the producer re-enqueues it (its chunk ended); another worker carries it on from turn 1
    again = enqueue(r, renderer, {"c0": conversation("c0")})
    fast = sim_factory(*SIM_ARGS)
    assert run(redis_url, fast.url, again).committed == 1
    rec = records(r)["c0"]
    assert len(rec["turns"]) == 3 and sim_stats(fast.url)["submitted"] == 2
    assert_invariant(r)


def test_a_turn_the_server_refuses_ends_the_conversation_failed_with_its_reason(
        r: "redis.Redis", redis_url: str, sim_factory: Any, renderer: Renderer) -> None:
    """Turn 1's prompt is longer than the server's context (the chunk's max_context let it through): SGLang's
    400 is final, so the conversation ends stopped_by failed with the reason, its turn 0 written and counted."""
    messages = conversation("c0", users=2)
    n0 = len(renderer.render(plan(messages)[0].context).input_ids)
    sim = sim_factory(*SIM_ARGS, "--context-length", str(n0 + MAX_NEW + 4))
    report = run(redis_url, sim.url, enqueue(r, renderer, {"c0": messages}, max_context=100_000))
    rec = records(r)["c0"]
    assert rec["stopped_by"] == "failed" and rec["incomplete"] is True and len(rec["turns"]) == 1
    assert rec["failed_reason"].startswith("turn 1: 400")
    assert report.committed == 1 and report.failed == 0
    assert not Ledger(r).failed(DS)  # not a failed sample: its turn 0 is good data, on disk
    assert_invariant(r)


def test_strict_stops_a_conversation_whose_next_turn_cannot_fit(r: "redis.Redis", redis_url: str,
                                                                 sim_factory: Any, renderer: Renderer) -> None:
    """strict: turn 0 fits (0 + 64 <= 70) and makes 12 tokens; turn 1 would need 12 + 64 > 70 even alone, so it
    is never sent: stopped_by budget, and strict is never over its budget."""
    sim = sim_factory(*SIM_ARGS)
    ledger = Ledger(r)
    ledger.set_mode(DS, "strict", MAX_NEW)
    ledger.set_budget(DS, MAX_NEW + 6)
    report = run(redis_url, sim.url, enqueue(r, renderer, {"c0": conversation("c0")}))
    rec = records(r)["c0"]
    assert rec["stopped_by"] == "budget" and len(rec["turns"]) == 1 and report.committed == 1
    assert sim_stats(sim.url)["submitted"] == 1
    assert ledger.state(DS).used <= MAX_NEW + 6
    assert_invariant(r)
