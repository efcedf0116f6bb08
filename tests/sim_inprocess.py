"""The simulator in-process on a free loopback port (sglang_sim.serve) with an aiohttp client for it, two engine
settings (FAST answers at once, SLOW ones take ~20 s), a request body, and a poll for an engine state."""
from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Callable, Coroutine, TypeVar

import aiohttp

from sglang_sim import SimConfig, serve
from sglang_sim.server import SimServer

T = TypeVar("T")
FAST = SimConfig(time_scale=1000.0)  # 300-token answers in well under a millisecond of compute
SLOW = SimConfig(length_dist="fixed", mean_tokens=20000, tokens_per_second_per_request=1000)  # ~20 s each


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def sim_and_client(cfg: SimConfig) -> AsyncIterator[tuple[SimServer, aiohttp.ClientSession]]:
    async with serve(cfg, port=0) as sim, aiohttp.ClientSession(base_url=sim.url) as client:
        yield sim, client


async def post(client: aiohttp.ClientSession, path: str, body: object) -> tuple[int, Any]:
    async with client.post(path, json=body) as resp:
        data = await resp.json() if resp.content_type == "application/json" else await resp.text()
        return resp.status, data


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


def gen_body(n_prompt: int = 20, **sampling: Any) -> dict[str, Any]:
    return {"input_ids": list(range(10, 10 + n_prompt)), "sampling_params": sampling}
