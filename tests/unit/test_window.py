"""The automatic window's pieces without a server (worker/window.py): what it reads of SGLang's answers, the policy
that moves a worker's window, and the resizable slots the dispatcher waits on."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from sglang_sim.config import SimConfig
from sglang_sim.engine import EngineStats
from sglang_sim.responses import get_load_body, loads_body, server_info
from worker.dispatch import Slots
from worker.window import Load, ServerWindow, capacity_of, counts_of, headroom, server_name

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "sglang_real"


def stats(running: int, queued: int) -> EngineStats:
    return EngineStats(running, running, queued, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 1.0, 0.0)


def test_the_capacity_is_the_schedulers_own_limit_not_the_unset_argument() -> None:
    real = json.loads((REAL / "server_info.json").read_text())["body"]
    assert real["max_running_requests"] is None  # 0.5.23: the argument, unset
    assert capacity_of(real) == 4096  # internal_states[0].effective_max_running_requests_per_dp
    assert capacity_of(server_info(SimConfig(max_running=48), stats(0, 0))) == 48
    two_ranks = {"internal_states": [{"effective_max_running_requests_per_dp": 8}] * 2}
    assert capacity_of(two_ranks) == 16
    assert capacity_of({"max_running_requests": 12, "internal_states": [{}]}) == 12  # an older server
    assert capacity_of({"max_running_requests": None}) is None


def test_both_load_shapes_give_running_waiting_and_the_simulator_says_the_same_in_each() -> None:
    cfg = SimConfig(max_running=32)
    assert counts_of(json.loads(json.dumps(loads_body(cfg, stats(32, 5))))) == (32, 5, 32)
    assert counts_of(json.loads(json.dumps(get_load_body(stats(32, 5))))) == (32, 5, None)  # no limit in it
    two = {"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 1, "max_running_requests": 4}] * 2}
    assert counts_of(two) == (6, 2, 8)
    assert counts_of({"router_manager": True}) is None
    assert counts_of([{"num_reqs": "x", "num_waiting_reqs": 0}]) is None


def test_a_first_answer_gives_each_peer_its_share_of_capacity_plus_headroom() -> None:
    w = ServerWindow()
    w.follow(Load(256), peers=2, busy=False)
    assert headroom(256) == 18 and w.window == (256 + 18) / 2


def test_a_growing_queue_shrinks_and_a_server_below_capacity_grows_only_busy_windows() -> None:
    w = ServerWindow()
    w.follow(Load(100, 0, 0), peers=2, busy=True)
    start = w.window
    w.follow(Load(100, 100, 60), peers=2, busy=True)  # 60 queued, 8 wanted
    assert w.window < start
    low = w.window
    w.follow(Load(100, 70, 0), peers=2, busy=False)  # room, but this worker has no work to fill it
    assert w.window == low
    w.follow(Load(100, 70, 0), peers=2, busy=True)
    assert w.window == low + 0.5 * (100 + headroom(100) - 70) / 2


def test_requests_waiting_below_capacity_aim_at_what_runs_plus_headroom() -> None:
    w = ServerWindow()
    w.follow(Load(100, 0, 0), peers=1, busy=True)
    for _ in range(30):  # the KV cache binds at 60 running: the window settles near 60 + headroom
        running = min(60, round(w.window))
        w.follow(Load(100, running, max(0, round(w.window) - running)), peers=1, busy=True)
    assert abs(w.window - (60 + headroom(100))) <= 1


def test_peers_joining_scale_the_window_and_a_new_capacity_starts_over() -> None:
    w = ServerWindow()
    w.follow(Load(64), peers=1, busy=True)
    w.follow(Load(64), peers=2, busy=True)
    assert w.window == (64 + headroom(64)) / 2
    w.follow(Load(1024), peers=2, busy=True)
    assert w.window == (1024 + headroom(1024)) / 2


def test_a_window_stays_between_one_and_capacity_plus_twice_the_headroom() -> None:
    w = ServerWindow()
    w.follow(Load(10, 0, 0), peers=1, busy=True)
    for _ in range(20):
        w.follow(Load(10, 0, 0), peers=1, busy=True)
    assert w.window == 10 + 2 * headroom(10)
    for _ in range(20):
        w.follow(Load(10, 10, 500), peers=1, busy=True)
    assert w.window == 1.0


def test_loopback_servers_are_named_by_host_others_by_url() -> None:
    assert server_name("http://127.0.0.1:30000/", "gpu-a") == "gpu-a http://127.0.0.1:30000"
    assert server_name("http://u:pw@sglang.internal:30000", "gpu-a") == "http://sglang.internal:30000"


def test_slots_resize_without_taking_back_a_running_slot() -> None:
    async def run() -> None:
        slots = Slots(2)
        await slots.acquire()
        await slots.acquire()
        assert slots.locked()
        waiter = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        assert not waiter.done()
        slots.resize(3)  # grows: the waiter gets the new slot
        await asyncio.sleep(0)
        assert waiter.done() and slots.usage() == (3, 3)
        slots.resize(1)  # shrinks: nothing is taken back, and two releases free no slot
        slots.release()
        slots.release()
        assert slots.locked() and slots.usage() == (1, 1)
        late = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        late.cancel()  # a cancelled wait leaves no slot taken
        await asyncio.gather(late, return_exceptions=True)
        slots.release()
        assert slots.usage() == (0, 1) and not slots.locked()

    asyncio.run(run())
