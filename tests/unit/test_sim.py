"""The SGLang simulator honours reference/sglang-generate.md and models a GPU batch cheaply.

Servers run in-process on a free loopback port (sglang_sim.serve), except one test that starts the
real console script. The speed model's times are checked on the engine alone, on virtual time
(tests/virtual_time.py), where they are exact; over HTTP only what load cannot change is asserted
(counts, tokens, and e2e_latency as a floor). Waiting for a server-side state (a request now running, an abort booked) polls
the engine's counters under a deadline: the simulator exposes no event for those.
"""
from __future__ import annotations

import asyncio
import contextlib
import shutil
from typing import Any, Callable

import aiohttp
import pytest
from aiohttp import web

from sglang_sim import SimConfig, SimProcess, serve
from sglang_sim.config import THINK_CLOSE_ID, THINK_OPEN_ID, from_argv
from sglang_sim.engine import Engine
from sglang_sim.prefix_cache import PrefixCache
from sglang_sim.server import STATE, make_app
from sglang_sim.textgen import Lexicon, OutputPlan, render
from tests.sim_inprocess import FAST, SLOW, gen_body, post, run, sim_and_client, until
from tests.virtual_time import run_virtual

pytestmark = pytest.mark.timeout(20)


# -- the response contract --------------------------------------------------------------------


def check_invariants(out: dict[str, Any], max_new: int, eos: int = 2) -> str:
    meta = out["meta_info"]
    ids, text, finish = out["output_ids"], out["text"], meta["finish_reason"]
    assert meta["completion_tokens"] == len(ids)
    assert set(meta) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}
    if finish["type"] == "stop":
        assert finish == {"type": "stop", "matched": eos}
        assert ids[-1] == eos and eos not in ids[:-1]
        assert len(ids) <= max_new  # an EOS on the last allowed token is a stop (SGLang checks EOS first)
        # one pseudo-word (or marker) per token; the EOS has no text
        assert len(text.split()) == len(ids) - 1
    else:
        assert finish == {"type": "length", "length": max_new}
        assert len(ids) == max_new and eos not in ids
        assert len(text.split()) == len(ids)
    return str(finish["type"])


def test_stop_and_length_invariants() -> None:
    async def go() -> None:
        async with sim_and_client(FAST) as (_, client):
            outs = await asyncio.gather(*(post(client, "/generate", gen_body(max_new_tokens=300)) for _ in range(60)))
        kinds = set()
        for status, out in outs:
            assert status == 200
            kind = check_invariants(out, 300)
            kinds.add(kind)
            if kind == "stop":  # default style "open": the reasoning is closed, never opened
                assert "</think>" in out["text"] and "<think>" not in out["text"]
                assert THINK_CLOSE_ID in out["output_ids"] and THINK_OPEN_ID not in out["output_ids"]
        assert kinds == {"stop", "length"}

    run(go())


def test_length_cut_inside_reasoning_has_no_close_tag() -> None:
    async def go() -> None:
        async with sim_and_client(FAST.replace(length_dist="fixed", mean_tokens=500)) as (_, client):
            status, out = await post(client, "/generate", gen_body(max_new_tokens=10))
        assert status == 200 and check_invariants(out, 10) == "length"
        assert "</think>" not in out["text"]

    run(go())


def test_default_max_new_tokens_is_128() -> None:
    async def go() -> None:
        async with sim_and_client(FAST.replace(length_dist="fixed", mean_tokens=1000)) as (_, client):
            status, out = await post(client, "/generate", {"text": "hello there"})
        assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
        assert out["meta_info"]["prompt_tokens"] == 2

    run(go())


@pytest.mark.parametrize("style", ["open", "full", "none"])
def test_reasoning_styles(style: str) -> None:
    cfg = FAST.replace(length_dist="fixed", mean_tokens=50, reasoning_style=style)

    async def go() -> None:
        async with sim_and_client(cfg) as (_, client):
            status, out = await post(client, "/generate", gen_body(max_new_tokens=100))
        assert status == 200 and check_invariants(out, 100) == "stop"
        text, ids = out["text"], out["output_ids"]
        assert text.startswith("<think>\n") == (style == "full")
        assert ("\n</think>\n\n" in text) == (style != "none")
        if style == "full":
            assert ids[0] == THINK_OPEN_ID
        if style != "none":
            reasoning, answer = text.split("</think>")
            assert len(reasoning.split()) - (style == "full") == round(0.6 * (49 - (2 if style == "full" else 1)))

    run(go())


def test_render_every_prefix_is_consistent() -> None:
    lex = Lexicon(0)
    plan = OutputPlan(natural_len=30, reasoning_words=17, offset=32760, style="full")  # wraps the stream
    full_text, full_ids = render(lex, plan, 29, 2)
    for n in range(30):
        text, ids = render(lex, plan, n, None)
        assert len(ids) == n and ids == full_ids[:n]
        assert len(text.split()) == n
        assert full_text.startswith(text.rstrip())


def test_ignore_eos_and_min_new_tokens() -> None:
    async def go() -> None:
        async with sim_and_client(FAST.replace(length_dist="fixed", mean_tokens=5)) as (_, client):
            _, out = await post(client, "/generate", gen_body(max_new_tokens=40, ignore_eos=True))
            assert check_invariants(out, 40) == "length"
            _, out = await post(client, "/generate", gen_body(max_new_tokens=40, min_new_tokens=20))
            assert check_invariants(out, 40) == "stop" and len(out["output_ids"]) == 21

    run(go())


# -- errors ----------------------------------------------------------------------------------

EITHER = "Either text, input_ids or input_embeds should be provided."


def value_err(fragment: str) -> Callable[[Any], bool]:
    return lambda body: isinstance(body["error"], dict) and fragment in body["error"]["message"]


def contract_err(body: Any) -> bool:
    return isinstance(body["error"], str)


def type_err(body: Any) -> bool:
    return body["object"] == "error" and body["type"] == "Bad Request" and body["code"] == 400 and "param" in body


@pytest.mark.parametrize(
    "body,check",
    [
        ({"sampling_params": {}}, value_err(EITHER)),
        ({"text": "a", "input_ids": [1]}, value_err(EITHER)),
        ({"input_ids": []}, value_err("input_ids cannot be empty")),
        ({"input_ids": [[1], [2]]}, value_err("batch not supported by simulator")),
        ({"text": "a", "sampling_params": {"top_p": 0.0}}, lambda b: b == {"error": {"message": "top_p must be in (0, 1], got 0.0."}}),
        ({"text": "a", "sampling_params": {"temperature": -0.5}}, value_err("temperature must be a non-negative")),
        ({"text": "a", "sampling_params": {"top_k": 0}}, value_err("top_k must be -1")),
        ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, value_err("max_new_tokens must be at least 0")),
        ({"text": "a", "sampling_params": {"max_tokens": 5}}, contract_err),
        ({"text": "a", "sampling_params": {"max_new_tokens": 1.5}}, type_err),
        ({"text": "a", "sampling_params": {"temperature": "hot"}}, type_err),
        ({"text": "a", "sampling_params": {"ignore_eos": "yes"}}, type_err),
        ({"text": 5}, type_err),
        ({"input_ids": ["a"]}, type_err),
        ([1, 2], type_err),
        ({"input_ids": [1] * 40000}, value_err("longer than the model's context length")),
        ({"input_ids": [1] * 32768}, value_err("longer than the model's context length")),
        ({"input_ids": [1] * 32000, "sampling_params": {"max_new_tokens": 769}}, value_err("context length")),
        ({"text": "a", "stream": True}, value_err("stream not supported by sglang-sim")),
    ],
)
def test_error_shapes(body: object, check: Callable[[Any], bool]) -> None:
    async def go() -> None:
        async with sim_and_client(FAST) as (sim, client):
            status, out = await post(client, "/generate", body)
            assert status == 400 and check(out), out
            assert sim.engine.stats().submitted == 0

    run(go())


def test_invalid_json_is_a_type_error() -> None:
    async def go() -> None:
        async with sim_and_client(FAST) as (_, client):
            async with client.post("/generate", data=b"{nope", headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400 and type_err(await r.json())

    run(go())


def test_duplicate_rid_while_in_flight_then_reusable() -> None:
    async def go() -> None:
        async with sim_and_client(SLOW) as (sim, client):
            first = asyncio.create_task(post(client, "/generate", {**gen_body(max_new_tokens=30000), "rid": "dup"}))
            await until(lambda: sim.engine.stats().running == 1)
            status, out = await post(client, "/generate", {**gen_body(), "rid": "dup"})
            assert status == 400 and "Duplicate request ID detected" in out["error"]["message"]
            await post(client, "/abort_request", {"rid": "dup"})
            status, out = await first
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
            status, out = await post(client, "/generate", {**gen_body(max_new_tokens=0), "rid": "dup"})
            assert status == 200 and out["meta_info"]["id"] == "dup"

    run(go())


def test_api_key() -> None:
    async def go() -> None:
        async with sim_and_client(FAST.replace(api_key="sekrit")) as (sim, client):
            async with client.post("/generate", json={"text": "a"}) as r:
                assert r.status == 401 and await r.json() == {"error": "Unauthorized"}  # SGLang's answer
            async with client.post("/generate", json={"text": "a"}, headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401
            async with client.post("/generate", json={"text": "a"}, headers={"Authorization": "Bearer sekrit"}) as r:
                assert r.status == 200
            async with client.get("/sim/stats") as r:  # the simulator's own counters stay open
                assert r.status == 200 and (await r.json())["unauthorized"] == 2
            async with client.get("/health") as r:
                assert r.status == 200
            async with client.get("/get_server_info", headers={"Authorization": "Bearer sekrit"}) as r:
                assert (await r.json())["api_key"] == "***"

    run(go())


# -- the speed model ---------------------------------------------------------------------------


def test_latency_grows_with_load() -> None:
    # 200 tokens at 1000 tok/s = 0.2 simulated s; time_scale 5 -> 40 ms for a lone request.
    # 16 requests (4x saturation) share 4 x 1000 tok/s: each ends after 0.8 simulated s, 160 ms.
    cfg = SimConfig(length_dist="fixed", mean_tokens=200, saturation_batch=4, time_scale=5.0)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        engine = Engine(cfg, PrefixCache(16, 0), clock=loop.time)
        assert (await engine.submit(engine.next_seq(), [1], 200).future).generated == 200
        single = loop.time()
        t0 = loop.time()
        loaded = [engine.submit(engine.next_seq(), [1], 200) for _ in range(16)]
        ends = []
        for job in loaded:
            assert (await job.future).generated == 200
            ends.append(loop.time() - t0)
        stats = engine.stats()
        assert single == pytest.approx(0.040, abs=1e-9)
        assert ends == pytest.approx([0.160] * 16, abs=1e-9)  # 4x the lone latency: 4x saturation
        assert stats.completed == 17 and stats.completion_tokens_total == 17 * 200
        assert stats.uptime == pytest.approx(0.200, abs=1e-9)
        assert stats.running_integral == pytest.approx(0.040 + 16 * 0.160, abs=1e-9)  # what a benchmark reads

    run_virtual(go())


def test_server_reports_latency_and_counts_under_load() -> None:
    """Over HTTP, the same load: every answer is the model's, and e2e_latency is never below the model's time (a
    floor only: on a loaded machine the wall time the server measures can only be longer; the times themselves
    are test_latency_grows_with_load's)."""
    cfg = SimConfig(length_dist="fixed", mean_tokens=200, saturation_batch=4, time_scale=5.0)

    async def go() -> None:
        async with sim_and_client(cfg) as (sim, client):
            _, alone = await post(client, "/generate", gen_body(max_new_tokens=500))
            loaded = await asyncio.gather(*(post(client, "/generate", gen_body(max_new_tokens=500)) for _ in range(16)))
            stats = sim.engine.stats()
        for out in [alone] + [out for _, out in loaded]:
            assert check_invariants(out, 500) == "stop" and out["meta_info"]["completion_tokens"] == 200
            assert out["meta_info"]["e2e_latency"] >= 0.040 - 0.001  # the engine may end 0.5 ms early
        assert stats.completed == 17 and stats.completion_tokens_total == 17 * 200 and stats.running_integral > 0

    run(go())


def test_engine_shares_throughput_exactly() -> None:
    # saturation 1: the batch makes 1000 x 5 = 5000 tok/s, split between whoever decodes.
    # A (100 tokens) and B (300) share it: A ends at 200/5000 = 40 ms; B then runs alone, ending at 80 ms.
    async def go() -> None:
        loop = asyncio.get_running_loop()
        engine = Engine(SimConfig(saturation_batch=1, time_scale=5.0), PrefixCache(16, 0), clock=loop.time)
        a, b = engine.submit(engine.next_seq(), [1], 100), engine.submit(engine.next_seq(), [1], 300)
        assert (await a.future).generated == 100
        ta = loop.time()
        assert (await b.future).generated == 300
        tb = loop.time()
        assert ta == pytest.approx(0.040, abs=1e-9) and tb == pytest.approx(0.080, abs=1e-9)
        stats = engine.stats()
        assert stats.completed == 2 and stats.decoding_integral == pytest.approx(2 * 0.040 + 0.040, abs=1e-9)

    run_virtual(go())


def test_fifo_queue_beyond_max_running() -> None:
    """Two slots: the six requests end two at a time, a wave apart, in arrival order."""
    cfg = SimConfig(length_dist="fixed", mean_tokens=100, max_running=2, time_scale=0.5)
    wave = 100 / (cfg.tokens_per_second_per_request * cfg.time_scale)  # 200 ms

    async def go() -> None:
        loop = asyncio.get_running_loop()
        engine = Engine(cfg, PrefixCache(16, 0), clock=loop.time)
        jobs = [engine.submit(engine.next_seq(), [1], 100) for _ in range(6)]
        stats = engine.stats()
        assert (stats.running, stats.queued) == (2, 4)
        ended: dict[int, float] = {}

        def note_end(seq: int) -> Callable[[object], None]:
            def note(_: object) -> None:
                ended[seq] = loop.time()
            return note

        for job in jobs:
            job.future.add_done_callback(note_end(job.seq))
        await asyncio.gather(*(job.future for job in jobs))
        assert [ended[job.seq] for job in jobs] == pytest.approx([wave, wave, 2 * wave, 2 * wave, 3 * wave, 3 * wave],
                                                                 abs=1e-9)

    run_virtual(go())


def test_queue_shows_in_metrics() -> None:
    """The engine's running and queued counts reach /metrics as SGLang's gauges. The requests (20 s each) outlast
    the test, which aborts them."""
    async def go() -> None:
        async with sim_and_client(SLOW.replace(max_running=2)) as (sim, client):
            tasks = [asyncio.create_task(post(client, "/generate", gen_body(max_new_tokens=30000))) for _ in range(6)]
            await until(lambda: sim.engine.stats().submitted == 6)
            async with client.get("/metrics") as r:
                text = await r.text()
            assert 'sglang:num_running_reqs{model_name="sglang-sim"} 2.0' in text
            assert 'sglang:num_queue_reqs{model_name="sglang-sim"} 4.0' in text
            await post(client, "/abort_request", {"rid": "", "abort_all": True})
            for status, out in await asyncio.gather(*tasks):
                assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"

    run(go())


def test_prefill_time_and_prefix_cache() -> None:
    # 2000 uncached tokens at 10k tok/s = 0.2 simulated s = 50 ms, then 10 tokens at 1000 tok/s, 2.5 ms; the repeat
    # is mostly cached: it prefills only its few uncached tokens.
    cfg = SimConfig(prefill_tokens_per_second=10000, time_scale=4.0)
    prompt = list(range(10, 2010))

    async def go() -> None:
        loop = asyncio.get_running_loop()
        engine = Engine(cfg, PrefixCache(cfg.prefix_cache_page, cfg.prefix_cache_pages), clock=loop.time)
        first = await engine.submit(engine.next_seq(), prompt, 10).future
        t_first = loop.time()
        again = await engine.submit(engine.next_seq(), prompt, 10).future
        t_again = loop.time() - t_first
        assert engine.flush_cache()
        flushed = await engine.submit(engine.next_seq(), prompt, 10).future
        t_flushed = loop.time() - t_first - t_again
        decode = 10 / (cfg.tokens_per_second_per_request * cfg.time_scale)
        assert first.cached_tokens == 0 and t_first == pytest.approx(2000 / 40_000 + decode, abs=1e-9)
        assert 1984 <= again.cached_tokens <= 1999
        assert t_again == pytest.approx((2000 - again.cached_tokens) / 40_000 + decode, abs=1e-9)
        assert flushed.cached_tokens == 0 and t_flushed == pytest.approx(t_first, abs=1e-9)

    run_virtual(go())


def test_prefix_cache_over_http() -> None:
    """The server passes the prompt to the cache and reports cached_tokens; /flush_cache empties it; the prefill
    shows in e2e_latency (a floor: 50 ms for the uncached prompt; the times are test_prefill_time_and_prefix_cache's)."""
    cfg = SimConfig(length_dist="fixed", mean_tokens=1, prefill_tokens_per_second=10000, time_scale=4.0)

    async def go() -> None:
        async with sim_and_client(cfg) as (_, client):
            _, first = await post(client, "/generate", gen_body(n_prompt=2000))
            _, again = await post(client, "/generate", gen_body(n_prompt=2000))
            async with client.post("/flush_cache") as r:
                assert r.status == 200
            _, flushed = await post(client, "/generate", gen_body(n_prompt=2000))
        assert first["meta_info"]["cached_tokens"] == 0 and first["meta_info"]["e2e_latency"] >= 0.050 - 0.001
        assert 1984 <= again["meta_info"]["cached_tokens"] <= 1999
        assert flushed["meta_info"]["cached_tokens"] == 0 and flushed["meta_info"]["e2e_latency"] >= 0.050 - 0.001

    run(go())


def test_prefix_cache_unit() -> None:
    cache = PrefixCache(page_size=4, capacity_pages=3)
    assert cache.match_and_insert(list(range(10))) == 0
    assert cache.match_and_insert(list(range(10))) == 8
    assert cache.match_and_insert(list(range(8))) == 7  # never the whole prompt
    assert cache.match_and_insert([0, 1, 2, 3, 9, 9, 9, 9]) == 4
    assert len(cache) == 3  # LRU bound


def test_zero_latency() -> None:
    """A zero-latency engine ends a request inside submit, at no simulated time, whatever its length; the server
    answers it in full."""
    async def engine_side() -> None:
        loop = asyncio.get_running_loop()
        engine = Engine(SLOW.replace(zero_latency=True), PrefixCache(16, 0), clock=loop.time)
        job = engine.submit(engine.next_seq(), [1], 20000)
        assert job.future.done() and job.future.result().generated == 20000 and loop.time() == 0.0

    async def go() -> None:
        async with sim_and_client(SLOW.replace(zero_latency=True)) as (_, client):
            _, out = await post(client, "/generate", gen_body(max_new_tokens=30000))
            assert check_invariants(out, 30000) == "stop" and len(out["output_ids"]) == 20000

    run_virtual(engine_side())
    run(go())


# -- aborts ------------------------------------------------------------------------------------


def test_client_disconnect_aborts_and_frees_rid() -> None:
    async def go() -> None:
        async with sim_and_client(SLOW) as (sim, client):
            async with aiohttp.ClientSession(base_url=sim.url) as leaving:
                gone = asyncio.create_task(post(leaving, "/generate", {**gen_body(max_new_tokens=30000), "rid": "gone"}))
                await until(lambda: sim.engine.stats().running == 1)
                gone.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await gone
            await until(lambda: sim.engine.stats().aborted == 1)
            assert sim.engine.stats().running == 0
            status, _ = await post(client, "/generate", {**gen_body(max_new_tokens=0), "rid": "gone"})
            assert status == 200

    run(go())


def test_disconnect_sweep_without_handler_cancellation() -> None:
    async def go() -> None:
        runner = web.AppRunner(make_app(SLOW.replace(disconnect_check_interval=0.05)))  # no handler_cancellation
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        engine = runner.app[STATE].engine
        try:
            async with aiohttp.ClientSession(base_url=url) as leaving:
                gone = asyncio.create_task(post(leaving, "/generate", gen_body(max_new_tokens=30000)))
                await until(lambda: engine.stats().running == 1)
                gone.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await gone
            await until(lambda: engine.stats().aborted == 1)
        finally:
            await runner.cleanup()

    run(go())


def test_abort_request_prefix_semantics() -> None:
    cfg = SLOW.replace(max_running=1)

    async def go() -> None:
        async with sim_and_client(cfg) as (sim, client):
            def start(rid: str) -> asyncio.Task[tuple[int, Any]]:
                return asyncio.create_task(post(client, "/generate", {**gen_body(max_new_tokens=30000), "rid": rid}))

            running = start("job-1")
            await until(lambda: sim.engine.stats().running == 1)
            queued, other = start("job-10"), start("other")
            await until(lambda: sim.engine.stats().queued == 2)
            await asyncio.sleep(0.01)  # let job-1 decode a few tokens
            # Like SGLang's tokenizer manager: a rid that is not itself in flight aborts nothing...
            assert (await post(client, "/abort_request", {"rid": "job"}))[0] == 200
            assert sim.engine.stats().aborted == 0
            # ...an in-flight one aborts every rid it prefixes (the scheduler's startswith match).
            assert (await post(client, "/abort_request", {"rid": "job-1", "abort_all": False}))[0] == 200
            (s1, r1), (s2, r2) = await running, await queued
            assert s1 == s2 == 200
            f1, f2 = r1["meta_info"]["finish_reason"], r2["meta_info"]["finish_reason"]
            assert f1["type"] == f2["type"] == "abort" and set(f1) == {"type", "message", "status_code", "err_type"}
            assert f2["message"] == "Abort before prefill" and r2["output_ids"] == [] and r2["meta_info"]["prompt_tokens"] == 0
            assert 0 < r1["meta_info"]["completion_tokens"] == len(r1["output_ids"]) < 30000
            assert 2 not in r1["output_ids"]
            assert not other.done()
            await post(client, "/abort_request", {"rid": "", "abort_all": True})
            _, r3 = await other
            assert r3["meta_info"]["finish_reason"]["type"] == "abort"

    run(go())


# -- determinism -------------------------------------------------------------------------------


async def _outputs(cfg: SimConfig, bodies: list[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    async with sim_and_client(cfg) as (_, client):
        res = []
        for body in bodies:
            _, out = await post(client, "/generate", body)
            res.append((out["text"], out["output_ids"]))
        return res


def test_determinism() -> None:
    bodies = [gen_body(n_prompt=5 + i, max_new_tokens=400) for i in range(5)]
    a = run(_outputs(FAST.replace(seed=7), bodies))
    b = run(_outputs(FAST.replace(seed=7), bodies))
    c = run(_outputs(FAST.replace(seed=8), bodies))
    assert a == b and a != c
    seeded = gen_body(max_new_tokens=400, sampling_seed=42)
    greedy = gen_body(max_new_tokens=400, temperature=0)
    d = run(_outputs(FAST, [seeded, bodies[0], seeded, greedy, bodies[1], greedy]))
    assert d[0] == d[2] and d[3] == d[5] and d[0] != d[3]


# -- other endpoints and the CLI ----------------------------------------------------------------


def test_info_endpoints() -> None:
    async def go() -> None:
        async with sim_and_client(FAST) as (sim, client):
            await post(client, "/generate", gen_body())
            for path in ("/health", "/health_generate"):
                async with client.get(path) as r:
                    assert r.status == 200
            for path in ("/model_info", "/get_model_info"):  # SGLang serves both; its router asks the first
                async with client.get(path) as r:
                    info = await r.json()
                    assert {k: info[k] for k in ("model_path", "tokenizer_path", "is_generation")} == {
                        "model_path": "sglang-sim", "tokenizer_path": None, "is_generation": True}
            async with client.get("/server_info") as r:
                assert (await r.json())["version"] == "0.5.23-sim"
            async with client.get("/get_server_info") as r:
                info = await r.json()
            assert info["version"] == "0.5.23-sim" and info["port"] == sim.port
            assert info["internal_states"][0]["last_gen_throughput"] > 0
            async with client.get("/sim/stats") as r:
                stats = await r.json()
            assert stats["completed"] == 1 and stats["running"] == 0 and stats["queued"] == 0
            assert {"aborted", "completion_tokens_total", "running_integral", "uptime", "mean_running"} <= set(stats)

    run(go())


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    """schedule_batch.update_finish_state checks EOS before the length limit."""
    async def go() -> None:
        async with sim_and_client(FAST.replace(length_dist="fixed", mean_tokens=10)) as (_, client):
            status, out = await post(client, "/generate", gen_body(max_new_tokens=10))
            assert status == 200 and check_invariants(out, 10) == "stop" and len(out["output_ids"]) == 10
            status, out = await post(client, "/generate", gen_body(max_new_tokens=9))
            assert status == 200 and check_invariants(out, 9) == "length"

    run(go())


def test_context_limit_is_strict_and_the_scheduler_caps() -> None:
    """Refused only when prompt + max_new_tokens > context (a prompt alone: >=); what just fits, or null, is capped
    at context - prompt - 2 by SGLang's scheduler and ends with `length`."""
    cfg = FAST.replace(context_length=100, length_dist="fixed", mean_tokens=1000)

    async def go() -> None:
        async with sim_and_client(cfg) as (_, client):
            status, out = await post(client, "/generate", gen_body(60, max_new_tokens=41))
            assert status == 400 and "maximum context length of 100 tokens" in out["error"]["message"]
            status, out = await post(client, "/generate", gen_body(100))
            assert status == 400 and "longer than the model's context length (100 tokens)" in out["error"]["message"]
            for max_new in (40, None):
                status, out = await post(client, "/generate", gen_body(60, max_new_tokens=max_new))
                assert status == 200 and check_invariants(out, 38) == "length"
            status, out = await post(client, "/generate", gen_body(60, max_new_tokens=30))
            assert status == 200 and check_invariants(out, 30) == "length"

    run(go())


def test_health_is_503_while_warming_up() -> None:
    """SGLang answers /health 503 until its warm-up request has run; /generate is served meanwhile."""
    async def go() -> None:
        async with sim_and_client(FAST.replace(warmup_seconds=30)) as (sim, client):
            async with client.get("/health") as r:
                assert r.status == 503
            status, _ = await post(client, "/generate", gen_body(max_new_tokens=5))
            assert status == 200
            sim.app[STATE].ready_at = 0.0  # warm-up over
            async with client.get("/health_generate") as r:
                assert r.status == 200

    run(go())


def test_cli_parsing() -> None:
    cfg = from_argv(["--port", "1", "--no-reasoning", "--length-dist", "fixed", "--time-scale", "3"])
    assert (cfg.port, cfg.reasoning_style, cfg.length_dist, cfg.time_scale) == (1, "none", "fixed", 3.0)
    assert from_argv([]) == SimConfig()
    with pytest.raises(SystemExit):
        from_argv(["--time-scale", "0"])


def test_console_script_subprocess() -> None:
    script = shutil.which("sglang-sim")
    assert script, "the package must be pip-installed (editable) so the console script exists"
    with SimProcess(["--time-scale", "100"], command=[script]) as sim:

        async def go() -> None:
            async with aiohttp.ClientSession(base_url=sim.url) as client:
                status, out = await post(client, "/generate", gen_body(max_new_tokens=50))
                assert status == 200 and check_invariants(out, 50) in ("stop", "length")

        run(go())
        proc = sim.proc
    assert proc is not None and proc.returncode == 0  # SIGTERM is a clean shutdown


# -- model families with a real tokenizer (sglang_sim/families.py) -------------------------------------------


@pytest.mark.parametrize("family", ["qwen3-thinking", "glm45", "kimi_k2", "gpt-oss"])
def test_a_family_style_returns_the_real_ids_of_its_text(tmp_path: Any, family: str) -> None:
    """output_ids are the tokenizer's ids of the family's text, EOS last on a stop; text is their decode with
    special tokens left out (skip_special_tokens true, SGLang's default) or kept (false); a cut is a prefix."""
    from transformers import AutoTokenizer

    from tests.families import build_family_tokenizer
    directory = build_family_tokenizer(tmp_path / family, family)
    tok = AutoTokenizer.from_pretrained(str(directory))
    # apply_chat_template's own type for tools: an invariant list, which a list[dict[str, Any]] would not match
    tools: list[dict[str, Any] | Callable[..., Any]]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    prompt = tok.apply_chat_template([{"role": "user", "content": "Weather in Paris?"}], tools=tools,
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    cfg = FAST.replace(reasoning_style=family, tokenizer=str(directory), mean_tokens=40)
    eos_ids = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|user|>", "<|observation|>", "<|return|>",
                                                      "<|call|>")} - {None, tok.unk_token_id}

    async def go() -> list[tuple[bool, Any]]:
        out = []
        async with sim_and_client(cfg) as (_, client):
            for skip in (True, False):
                for _ in range(6):
                    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 400,
                                                                       "skip_special_tokens": skip}}
                    status, answer = await post(client, "/generate", body)
                    assert status == 200, answer
                    out.append((skip, answer))
            status, cut = await post(client, "/generate", {"input_ids": prompt,
                                                           "sampling_params": {"max_new_tokens": 5}})
            out.append((True, cut))
        return out

    answers = run(go())
    calls = 0
    for skip, answer in answers[:-1]:
        ids, text, meta = answer["output_ids"], answer["text"], answer["meta_info"]
        assert meta["finish_reason"]["type"] == "stop" and meta["completion_tokens"] == len(ids)
        assert ids[-1] == meta["finish_reason"]["matched"] and ids[-1] in eos_ids
        assert text == tok.decode(ids[:-1], skip_special_tokens=skip)
        assert tok.decode(ids[:-1]) == tok.decode(tok.encode(tok.decode(ids[:-1]), add_special_tokens=False))
        calls += "get_weather" in text
        if family == "gpt-oss":
            assert ("<|channel|>" in text) == (not skip)  # the markers are special tokens
    assert calls, "a prompt that declares a function gets calls"
    cut = answers[-1][1]
    assert cut["meta_info"]["finish_reason"]["type"] == "length" and len(cut["output_ids"]) == 5


def test_a_family_style_needs_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="reasoning_style glm45 needs --tokenizer"):
        SimConfig(reasoning_style="glm45")


# -- the request log (--request-log; tests/sim_log.py reads it) ---------------------------------------------


def test_request_log_holds_each_answer_as_sent_and_the_helper_finds_each_turn(tmp_path: Any,
                                                                            tokenizer_dir: Any) -> None:
    """Two servers append to one log; a line is readable as soon as its answer arrived (while the servers run), holds
    the prompt ids and the body's output as sent and the answering port; refused requests are not logged; the helper
    decodes prompts and finds a sample's turns in order, the second prompt carrying the first answer."""
    from tokenizers import Tokenizer

    from budget.keys import turn_field
    from budget.record import request_id
    from tests.sim_log import exchanges, load, of_sample, of_turn
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    log = tmp_path / "requests.jsonl"
    cfg = FAST.replace(tokenizer=str(tokenizer_dir), reasoning_style="none", mean_tokens=30, request_log=str(log))
    turn0 = "<|im_start|>user\nWhat is a list?<|im_end|>\n<|im_start|>assistant\n"

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
        async with serve(cfg, port=0) as a, serve(cfg, port=0) as b, aiohttp.ClientSession() as client:
            answers = []
            ids0 = tok.encode(turn0, add_special_tokens=False).ids
            async with client.post(a.url + "/generate", json={"input_ids": ids0, "rid": request_id("ds", "s1", 0),
                                                              "sampling_params": {"max_new_tokens": 200}}) as resp:
                answers.append(await resp.json())
            seen_while_running = load(log)
            turn1 = f"{turn0}{answers[0]['text']}<|im_end|>\n<|im_start|>user\nAnd a tuple?<|im_end|>\n" \
                    "<|im_start|>assistant\n"
            ids1 = tok.encode(turn1, add_special_tokens=False).ids
            async with client.post(b.url + "/generate", json={"input_ids": ids1,
                                                              "rid": request_id("ds", turn_field("s1", 1), 0),
                                                              "sampling_params": {"max_new_tokens": 3}}) as resp:
                answers.append(await resp.json())
            status, _ = await post(client, a.url + "/generate", {"input_ids": [], "rid": request_id("ds", "s2", 0)})
            assert status == 400
            return seen_while_running, answers, [a.port, b.port]

    seen, answers, ports = run(go())
    assert [line["rid"] for line in seen] == [request_id("ds", "s1", 0)]
    lines = load(log)
    assert len(lines) == 2  # the refused request left no line
    for line, answer, port in zip(lines, answers, ports, strict=True):
        assert line["port"] == port
        assert line["output_ids"] == answer["output_ids"] and line["text"] == answer["text"]
        assert line["finish_reason"] == answer["meta_info"]["finish_reason"]
        assert line["completion_tokens"] == answer["meta_info"]["completion_tokens"]
        for timing in ("e2e_latency", "response_sent_to_client_ts"):  # when it ran: a bench's latencies and occupancy
            assert line[timing] == answer["meta_info"][timing]
    assert lines[1]["finish_reason"]["type"] == "length"
    with open(log, "ab") as fh:
        fh.write(b'{"rid": "torn')  # a server killed mid-line: the helper leaves the piece out
    found = of_sample(exchanges(log, tok), "ds", "s1")
    assert [len(t) for t in found] == [1, 1]
    turns = [t[0] for t in found]
    assert [t.port for t in turns] == ports and [t.finish for t in turns] == ["stop", "length"]
    assert turns[0].prompt == turn0 and turns[0].input_ids == lines[0]["input_ids"]
    assert turns[0].output and turns[0].output in turns[1].prompt
    assert of_sample(exchanges(log, tok), "ds", "s2") == [] and of_turn(exchanges(log, tok), "ds", "s1", 2) == []


def test_request_log_option() -> None:
    assert from_argv(["--request-log", "/tmp/x.jsonl"]).request_log == "/tmp/x.jsonl"
    assert from_argv([]).request_log is None
    with pytest.raises(ValueError, match="request_log"):
        SimConfig(request_log="")
