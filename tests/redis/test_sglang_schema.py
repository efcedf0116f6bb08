"""SGLang 0.5.23's own schema as the contract test (tests/sglang_schema.py loads it from the real wheel).

Every /generate body budgetq sends, captured from real `rq worker` processes and `produce --dry-run --pilot`
talking to the simulator, is decoded with SGLang's GenerateRequest and its sampling_params built and
verified as SGLang's scheduler does; every answer the simulator gave is decoded with SGLang's
GenerateResponse. The simulator's refusals are checked against SGLang's on the same bodies.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
import redis
from aiohttp import web
from aiohttp.typedefs import Handler

from sglang_sim import SimConfig
from sglang_sim.server import make_app
from tests.procs import produce_cmd, read_jsonl
from tests.sglang_schema import Contract

pytestmark = pytest.mark.timeout(240)

DATA = Path(__file__).resolve().parents[2] / "demo" / "data"


@pytest.fixture(scope="module")
def contract() -> Contract:
    return Contract()


class CapturingSim:
    """The simulator in a thread of its own, on a loopback port, keeping every /generate body and answer."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.exchanges: list[tuple[Any, int, Any]] = []  # (request JSON, status, response JSON)
        self.url = ""
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @web.middleware
    async def _capture(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != "/generate":
            return await handler(request)
        raw = await request.read()  # cached: the handler reads it again
        resp = await handler(request)
        body = resp.body if isinstance(resp, web.Response) else None
        if isinstance(body, bytes):
            self.exchanges.append((json.loads(raw), resp.status, json.loads(body)))
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = make_app(self.cfg)
        app.middlewares.append(self._capture)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        self._loop.close()

    def __enter__(self) -> "CapturingSim":
        self._thread.start()
        assert self._ready.wait(30), "the capturing simulator did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


@pytest.mark.e2e
def test_worker_bodies_and_simulator_answers_follow_sglang_schema(
        contract: Contract, redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path,
        workers: Any) -> None:
    sampling = ["--temperature", "0.7", "--top-p", "0.9", "--top-k", "20", "--seed", "7"]
    common = [str(DATA / "glaive_fc.jsonl"), "--tokenizer", str(tokenizer_dir), "--max-tokens", "256",
              "--max-samples", "30", *sampling, "--redis-url", redis_url,
              "--turns", "last"]  # one /generate per sample: the counts below
    with CapturingSim(SimConfig(time_scale=50.0, mean_tokens=200, seed=3)) as sim:
        env = {**os.environ, "SGLANG_URL": sim.url}
        pilot = subprocess.run([*produce_cmd(), *common, "--dry-run", "--pilot", "3"], capture_output=True,
                               text=True, timeout=120, env=env)
        assert pilot.returncode == 0, pilot.stderr
        n_pilot = len(sim.exchanges)
        assert n_pilot == 3
        pool = workers(sim.url, BUDGETQ_CONCURRENCY="8")
        pool.start("w0")
        out = tmp_path / "out"
        run = subprocess.run([*produce_cmd(), *common, "--chunk-size", "8", "--out", str(out)],
                             capture_output=True, text=True, timeout=180, env=env)
        assert run.returncode == 0, run.stderr
        exchanges = list(sim.exchanges)
    recs = read_jsonl(out / "glaive_fc" / "raw_responses.jsonl")
    assert len(recs) == 30 and len(exchanges) == n_pilot + 30
    for body, status, answer in exchanges:
        assert status == 200, answer
        req = contract.request(body)
        assert req.input_ids and req.sampling_params.max_new_tokens == 256
        assert req.sampling_params.sampling_seed == 7 and req.sampling_params.top_k == 20
        resp = contract.response(answer)
        meta = resp.meta_info
        assert meta is not None and meta.completion_tokens == len(resp.output_ids or [])
        assert type(meta.finish_reason).__name__ in ("FinishStop", "FinishLength")
    worker_bodies = [b for b, _, _ in exchanges[n_pilot:]]
    rids = [b["rid"] for b in worker_bodies]
    assert all(isinstance(x, str) for x in rids) and len(set(rids)) == len(rids)


@pytest.mark.parametrize("body", [
    {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}},
    {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0, "top_k": -1}},
    {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "stop_regex": "x", "min_p": 0.1}},
    {"input_ids": [5], "sampling_params": {"max_tokens": 8}},
    {"input_ids": [5], "sampling_params": {"top_p": 0.0}},
    {"input_ids": [5], "sampling_params": {"top_k": 0}},
    {"input_ids": [5], "sampling_params": {"temperature": -1.0}},
    {"input_ids": [5], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [5], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 8}},
    {"input_ids": [5], "sampling_params": {"repetition_penalty": 0.0}},
    {"input_ids": [5], "sampling_params": {"max_new_tokens": "8"}},
    {"input_ids": "5"},
    {"input_ids": [5], "rid": 7},
])
def test_simulator_refuses_what_sglang_refuses(contract: Contract, body: dict[str, Any]) -> None:
    """The same body: SGLang's types refuse it exactly when the simulator answers 400, and the message of a
    value the scheduler refuses is SGLang's own."""
    try:
        contract.request(body)
        sglang_error = None
    except (ValueError, TypeError) as exc:  # JsonContractError is a ValueError
        sglang_error = str(exc)

    async def go() -> tuple[int, Any]:
        async with _client(SimConfig(time_scale=1000.0)) as post:
            return await post(body)

    status, answer = asyncio.run(go())
    assert (status == 400) == (sglang_error is not None), (status, answer, sglang_error)
    if status == 400 and isinstance(answer.get("error"), dict):
        assert answer["error"]["message"] == sglang_error
    elif status == 400 and isinstance(answer.get("error"), str):
        assert answer["error"] == sglang_error
    else:
        assert status != 200 or contract.response(answer)


def _client(cfg: SimConfig) -> Any:
    import contextlib

    import aiohttp

    from sglang_sim import serve

    @contextlib.asynccontextmanager
    async def cm() -> AsyncIterator[Any]:
        async with serve(cfg, port=0) as sim, aiohttp.ClientSession(base_url=sim.url) as session:
            async def post(body: Any) -> tuple[int, Any]:
                async with session.post("/generate", json=body) as resp:
                    return resp.status, await resp.json()
            yield post

    return cm()


def test_the_contract_is_sglangs_own(contract: Contract) -> None:
    """Guard against a test that passes on a stand-in: the modules are the wheel's files."""
    api_file, sampling_file = contract.api.__file__, contract.sampling.__file__
    assert api_file is not None and api_file.endswith("sglang/api/v1/api_types.py")
    assert sampling_file is not None and sampling_file.endswith("sglang/srt/sampling/sampling_params.py")
    with pytest.raises(contract.api.JsonContractError, match="unknown field `bogus`"):
        contract.request({"input_ids": [1], "sampling_params": {"bogus": 1}})
