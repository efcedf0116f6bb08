"""The simulator held to the contract as the real engine speaks it.

tests/fixtures/sglang_real/ holds what PyPI's sglang 0.5.23 answered on this machine's CPU (a tiny random Qwen3,
context 2048), recorded by `make sglang-cpu-smoke FIXTURES=tests/fixtures/sglang_real` (bench/sglang_cpu_record.py).
Each recorded request is replayed to an in-process simulator configured like that server (context, EOS) and its
answer compared field by field: the status, the media type, which keys exist at every level, the types of the
values, and the values that do not differ by nature (error messages, finish reasons, counts budgetq relies on).
Values that do (ids, text, timings, random request ids) are compared by type. Every difference that stays is in
KNOWN with the reason, and named in docs/simulator.md's comparison table (tests/unit/test_docs.py-style check below).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import pytest

from sglang_sim import SimConfig, serve
from sglang_sim.server import SimServer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang_real"
DOC = Path(__file__).resolve().parents[2] / "docs" / "simulator.md"
SERVER = json.loads((FIXTURES / "server.json").read_text())
CONTEXT = int(SERVER["context_length"])
EOS = int(SERVER["model"]["eos_token_id"])

#: (fixture, key path) -> why the simulator answers differently, on purpose. "a.b" is a key present on one side
#: only; each is a row of docs/simulator.md's table.
KNOWN: dict[tuple[str, str], str] = {
    ("get_model_info", "tokenizer_path"): "null unless the simulator runs with --tokenizer (it has none then)",
    ("model_info", "tokenizer_path"): "null unless the simulator runs with --tokenizer (it has none then)",
    ("get_server_info", "tokenizer_path"): "null unless the simulator runs with --tokenizer (it has none then)",
    ("server_info", "tokenizer_path"): "null unless the simulator runs with --tokenizer (it has none then)",
    ("stream", "status"): "budgetq never streams; the simulator refuses stream: true with 400",
    ("*", "meta_info.cached_tokens_details"): "{device, host} once a prefix is cached, null before, as the engine; "
                                              "a replayed request meets the simulator's cold cache",
    ("get_server_info", "context_length"): "the engine reports its --context-length argument (null unless set); "
                                           "the simulator its context, which producer/launch.py reads",
    ("get_server_info", "max_running_requests"): "the engine reports its argument (null unless set); the "
                                                 "simulator its --max-running",
    ("server_info", "max_running_requests"): "the engine reports its argument (null unless set); the simulator "
                                             "its --max-running",
    ("server_info", "context_length"): "the engine reports its --context-length argument (null unless set); "
                                       "the simulator its context, which producer/launch.py reads",
}
#: Errors whose engine message is pydantic's dump of the request, with the server's file paths: compared by shape
#: and by the phrase both must say.
PHRASE = {"wrong_type": "input_ids", "invalid_json": "JSON decode error",
          "no_content_type": "Input should be a dictionary or an instance of GenerateReqInput",
          "form_content_type": "Input should be a dictionary or an instance of GenerateReqInput"}


def have(*names: str) -> list[str]:
    """The fixtures of ``names`` that were recorded (a recording from an engine that cannot serve one lacks it)."""
    return [n for n in names if (FIXTURES / f"{n}.json").exists()]


def load(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / f"{name}.json").read_text()))


def media(content_type: str | None) -> str | None:
    return content_type.split(";")[0].strip() if content_type else None


def kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"  # JSON has one number type; SGLang writes 0.0 where the simulator may write 0
    return type(value).__name__


def shape_diff(real: Any, sim: Any, fixture: str, path: str = "") -> list[str]:
    """Every key present on one side only, and every value whose JSON type differs, less KNOWN ones."""
    out: list[str] = []
    if (fixture, path) in KNOWN or ("*", path) in KNOWN:
        return out
    if isinstance(real, dict) and isinstance(sim, dict):
        for key in sorted(set(real) | set(sim)):
            sub = f"{path}.{key}" if path else key
            if (fixture, sub) in KNOWN or ("*", sub) in KNOWN:
                continue
            if key not in sim:
                out.append(f"{sub}: only the real engine has it ({json.dumps(real[key])[:80]})")
            elif key not in real:
                out.append(f"{sub}: only the simulator has it ({json.dumps(sim[key])[:80]})")
            else:
                out += shape_diff(real[key], sim[key], fixture, sub)
        return out
    if isinstance(real, list) and isinstance(sim, list):
        if real and sim:
            out += shape_diff(real[0], sim[0], fixture, path + "[]")
        return out
    if kind(real) != kind(sim) and not (real is None or sim is None) or (real is None) != (sim is None):
        out.append(f"{path}: real {kind(real)} {json.dumps(real)[:60]}, simulator {kind(sim)} {json.dumps(sim)[:60]}")
    return out


async def replay(sim: SimServer, fixture: dict[str, Any]) -> tuple[int, str | None, Any]:
    req = fixture["request"]
    body = req.get("body")
    data = body.encode() if isinstance(body, str) else (json.dumps(body).encode() if body is not None else None)
    async with aiohttp.ClientSession() as session:
        async with session.request(req["method"], sim.url + req["path"], data=data,
                                   headers=req.get("headers") or {}) as resp:
            raw = await resp.read()
            try:
                parsed: Any = json.loads(raw)
            except ValueError:
                parsed = raw.decode(errors="replace")
            return resp.status, resp.headers.get("Content-Type"), parsed


def sim_config(**kw: Any) -> SimConfig:
    return SimConfig(**{"context_length": CONTEXT, "eos_id": EOS, "mean_tokens": 10_000, "length_dist": "fixed",
                        "time_scale": 1000, **kw})


def run(coro_fn: Callable[[SimServer], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        async with serve(sim_config(**kw), port=0) as sim:
            await coro_fn(sim)
    asyncio.run(main())


def assert_same(name: str, status: int, ctype: str | None, body: Any, real: dict[str, Any] | None = None) -> None:
    real = real or load(name)
    assert status == real["status"], f"{name}: status {status}, the real engine {real['status']}: {body}"
    if (name, "content_type") not in KNOWN:
        assert media(ctype) == media(real["content_type"]), f"{name}: {ctype} vs {real['content_type']}"
    diffs = shape_diff(real["body"], body, name)
    assert not diffs, f"{name}:\n" + "\n".join(diffs)


ERRORS = ["over_context", "no_room", "empty_prompt", "no_prompt", "bad_temperature", "bad_top_p",
          "unknown_sampling_key", "wrong_type", "no_content_type", "form_content_type", "invalid_json"]


@pytest.mark.parametrize("name", have(*ERRORS))
def test_errors_have_the_engines_status_shape_and_message(name: str) -> None:
    real = load(name)

    async def check(sim: SimServer) -> None:
        status, ctype, body = await replay(sim, real)
        assert_same(name, status, ctype, body, real)
        if name in PHRASE:
            assert PHRASE[name] in real["body"]["message"] and PHRASE[name] in body["message"]
        elif real["status"] != 200:
            assert body == real["body"], f"{name}: the simulator says {body}, the engine {real['body']}"
    run(check)


@pytest.mark.parametrize("name", have("generate_length", "generate_repeat", "generate_text", "generate_ignore_eos"))
def test_a_length_finish_has_the_engines_body(name: str) -> None:
    real = load(name)

    async def check(sim: SimServer) -> None:
        status, ctype, body = await replay(sim, real)
        assert_same(name, status, ctype, body, real)
        rmeta, smeta = real["body"]["meta_info"], body["meta_info"]
        assert smeta["finish_reason"] == rmeta["finish_reason"]
        for meta, b in ((rmeta, real["body"]), (smeta, body)):
            assert meta["completion_tokens"] == len(b["output_ids"])
        assert smeta["prompt_tokens"] == rmeta["prompt_tokens"] or name == "generate_text"
        assert smeta["cached_tokens"] <= smeta["prompt_tokens"] - 1 or smeta["cached_tokens"] == 0
    run(check)


def test_a_stop_finish_has_the_engines_body() -> None:
    real = load("generate_stop")
    matched = real["body"]["meta_info"]["finish_reason"]["matched"]
    assert real["body"]["output_ids"][-1] == matched  # the engine: the matched id ends output_ids

    async def check(sim: SimServer) -> None:  # the simulator stops on its EOS only (stop_token_ids: KNOWN)
        status, ctype, body = await replay(sim, real)
        assert_same("generate_stop", status, ctype, body, real)
        finish = body["meta_info"]["finish_reason"]
        assert finish == {"type": "stop", "matched": EOS} and body["output_ids"][-1] == EOS
    async def main() -> None:
        async with serve(SimConfig(context_length=CONTEXT, eos_id=EOS, mean_tokens=3, length_dist="fixed",
                                   time_scale=1000), port=0) as sim:
            await check(sim)
    asyncio.run(main())


@pytest.mark.skipif(not have("generate_abort", "abort_request") == ["generate_abort", "abort_request"],
                    reason="not recorded")
def test_an_aborted_request_has_the_engines_body() -> None:
    real = load("generate_abort")
    real_abort = load("abort_request")

    async def check(sim: SimServer) -> None:
        req = real["request"]
        async with aiohttp.ClientSession() as session:
            task = asyncio.ensure_future(session.post(sim.url + "/generate", json=req["body"]))
            while sim.engine.stats().decoding < 1:  # running: the engine says so
                await asyncio.sleep(0.005)
            async with session.post(sim.url + "/abort_request", json=real_abort["request"]["body"]) as a:
                assert a.status == real_abort["status"]
                abody = await a.read()
                assert (abody.decode() or "") == (real_abort["body"] if isinstance(real_abort["body"], str)
                                                  else json.dumps(real_abort["body"]))
            resp = await task
            body = await resp.json()
            assert_same("generate_abort", resp.status, resp.headers.get("Content-Type"), body, real)
            assert body["meta_info"]["finish_reason"]["type"] == "abort"
            assert body["meta_info"]["finish_reason"] == real["body"]["meta_info"]["finish_reason"]
            resp.release()
    run(check, time_scale=1.0, tokens_per_second_per_request=200)


@pytest.mark.parametrize("name", have("get_model_info", "model_info"))
def test_model_info_has_the_engines_keys(name: str) -> None:
    real = load(name)

    async def check(sim: SimServer) -> None:
        status, ctype, body = await replay(sim, real)
        assert_same(name, status, ctype, body, real)
    run(check)


#: What budgetq (budget/serverinfo.py SERVER_INFO_KEYS, producer/launch.py) and SGLang's router read of
#: /server_info: these must be there with the engine's types. The engine's other ~500 keys are server arguments
#: the simulator has no counterpart for (KNOWN).
SERVER_INFO_READ = ("version", "model_path", "served_model_name", "tokenizer_path", "context_length",
                    "max_total_num_tokens", "max_req_input_len", "tp_size", "dp_size", "random_seed",
                    "reasoning_parser", "tool_call_parser", "enable_deterministic_inference", "internal_states",
                    "max_running_requests", "page_size", "chunked_prefill_size", "device")


@pytest.mark.parametrize("name", have("get_server_info", "server_info"))
def test_server_info_has_what_budgetq_and_the_router_read(name: str) -> None:
    real = load(name)

    async def check(sim: SimServer) -> None:
        status, ctype, body = await replay(sim, real)
        assert status == real["status"] and media(ctype) == media(real["content_type"])
        missing = [k for k in SERVER_INFO_READ if k in real["body"] and k not in body]
        assert not missing, f"{name}: the simulator lacks {missing}"
        for key in SERVER_INFO_READ:
            if key in real["body"] and (name, key) not in KNOWN and key != "internal_states":
                assert not shape_diff({key: real["body"][key]}, {key: body[key]}, name), key
        # internal_states[0] is the scheduler's state (~200 keys); the simulator gives the one budgetq's dashboards read
        assert isinstance(real["body"]["internal_states"][0]["last_gen_throughput"], (int, float))
        assert isinstance(body["internal_states"][0]["last_gen_throughput"], (int, float))
    run(check)


@pytest.mark.parametrize("name", have("health", "health_generate"))
def test_health_after_start(name: str) -> None:
    real = load(name)

    async def check(sim: SimServer) -> None:
        status, ctype, body = await replay(sim, real)
        assert status == real["status"] == 200 and body == real["body"]
    run(check)


@pytest.mark.parametrize("path", [p for p in ("/health", "/health_generate") if have(f"starting_{p[1:]}")])
def test_health_while_starting(path: str) -> None:
    real = load(f"starting{path.replace('/', '_')}")
    answered = [a for a in real["answers"] if a["status"] is not None]
    assert answered[-1]["status"] == 200
    before = [a for a in answered if a["status"] != 200]

    async def check(sim: SimServer) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(sim.url + path) as resp:
                body = await resp.text()
                if before:  # what the engine answered once it listened, before it was ready
                    assert resp.status == before[0]["status"] and body == before[0]["body"]
    run(check, warmup_seconds=60.0)


def test_a_client_hanging_up_leaves_the_server_healthy() -> None:
    real = load("client_hangup")
    assert real["health_after"] == 200 and real["generate_after"] == 200

    async def check(sim: SimServer) -> None:
        async with aiohttp.ClientSession() as session:
            task = asyncio.ensure_future(session.post(sim.url + "/generate", json={
                "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}))
            while sim.engine.stats().decoding < 1:
                await asyncio.sleep(0.005)
            task.cancel()
            while sim.engine.stats().aborted < 1:  # the simulator aborts it as the engine does
                await asyncio.sleep(0.005)
            async with session.get(sim.url + "/health") as resp:
                assert resp.status == real["health_after"]
            async with session.post(sim.url + "/generate", json={"input_ids": [5], "sampling_params": {
                    "max_new_tokens": 2}}) as resp:
                assert resp.status == real["generate_after"]
    run(check, time_scale=1.0, tokens_per_second_per_request=200)


def test_every_known_difference_is_in_the_docs_table() -> None:
    text = DOC.read_text()
    missing = [f"{fixture} {path}" for fixture, path in KNOWN if f"`{path}`" not in text]
    assert not missing, "docs/simulator.md's comparison table lacks: " + ", ".join(missing)


def test_an_id_past_the_vocabulary_kills_both_the_same_way() -> None:
    real = load("out_of_vocab")
    assert real["client"]["status"] is None, "the engine answered instead of dying"
    assert real["port_after"] != "answers" and real["server_exit"] is not None
    vocab = int(SERVER["vocab_size"])

    async def check(sim: SimServer) -> None:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):  # the connection dropped, no answer
                async with session.post(sim.url + "/generate", json=real["request"]["body"]) as resp:
                    await resp.read()
            while sim.site is not None:  # the listening socket closes right after
                await asyncio.sleep(0.005)
            with pytest.raises(aiohttp.ClientConnectionError):
                async with session.get(sim.url + "/health") as resp:
                    await resp.read()
    run(check, vocab_size=vocab, oov_crash=True)


@pytest.mark.skipif(not have("id_at_vocab_size"), reason="not recorded")
def test_an_id_in_the_embeddings_padding_is_served_by_both() -> None:
    real = load("id_at_vocab_size")
    assert real["request"]["body"]["input_ids"][-1] == int(SERVER["vocab_size"])

    async def check(sim: SimServer) -> None:
        status, ctype, body = await replay(sim, real)
        assert_same("id_at_vocab_size", status, ctype, body, real)
    run(check, vocab_size=int(SERVER["vocab_size"]), oov_crash=True)


@pytest.mark.skipif(not have("stream"), reason="not recorded")
def test_streaming_is_the_engines_and_the_simulator_refuses_it_plainly() -> None:
    """budgetq never streams: the simulator refuses `stream: true` (KNOWN) rather than half-model it. What the
    engine does is held here so a simulator that starts streaming knows the shape to give."""
    real = load("stream")
    assert real["status"] == 200 and media(real["content_type"]) == "text/event-stream"
    events = real["events"]
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = events[:-1]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    for before, after in zip(chunks, chunks[1:], strict=False):  # cumulative output
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
    assert ("stream", "status") in KNOWN

    async def check(sim: SimServer) -> None:
        status, _, body = await replay(sim, real)
        assert status == 400 and body == {"error": {"message": "stream not supported by sglang-sim"}}
    run(check)
