"""The simulator's fault injection: each fault's wire shape, its counters, its rate, outages and /sim/faults.

Servers run in-process (sglang_sim.serve). Waiting for server-side state (a request running, a hang
registered, the listening socket closed) polls the server's own state under a deadline, as
test_sim.py does: the simulator exposes no event for those.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sglang_sim import SimConfig, SimProcess, make_app
from sglang_sim.config import from_argv
from sglang_sim.fault_http import FAULTS, FaultState
from sglang_sim.faults import MALFORMED_KINDS, FaultSettings, draw
from tests.sim_inprocess import FAST, SLOW, gen_body, post, run, sim_and_client, until
from tests.virtual_time import run_virtual
from worker.config import WorkerConfig
from worker.sglang import GenerateError, SGLangClient

pytestmark = pytest.mark.timeout(20)

INSTANT = SimConfig(zero_latency=True)
MAX_NEW = 300


async def stats(client: aiohttp.ClientSession) -> dict[str, Any]:
    async with client.get("/sim/stats") as r:
        return dict(await r.json())


async def set_faults(client: aiohttp.ClientSession, **changes: Any) -> dict[str, Any]:
    async with client.post("/sim/faults", json=changes) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


def sglang_error(body: Any, status: int) -> bool:
    return (
        isinstance(body, dict)
        and set(body) == {"object", "message", "type", "param", "code"}
        and body["object"] == "error" and body["code"] == status and body["param"] is None
        and isinstance(body["message"], str)
    )


@pytest.fixture(autouse=True)
def no_server_errors(caplog: pytest.LogCaptureFixture) -> Any:
    """Faults are deliberate: aiohttp must not log them as handler errors."""
    caplog.set_level(logging.ERROR, logger="aiohttp")
    yield
    logged = [r for r in caplog.get_records("call") if r.name.startswith("aiohttp")]
    assert not logged, [r.getMessage() for r in logged]


# -- errors ---------------------------------------------------------------------------------------


def test_error_statuses_with_sglang_shape_and_retry_after() -> None:
    async def go() -> None:
        async with sim_and_client(INSTANT.replace(error_rates=((503, 1.0),), retry_after=2.0)) as (_, client):
            for status, has_retry_after in ((503, True), (429, True), (500, False)):
                await set_faults(client, error_rates={str(status): 1.0})
                async with client.post("/generate", json=gen_body()) as r:
                    assert r.status == status and sglang_error(await r.json(), status)
                    assert r.headers.get("Retry-After") == ("2" if has_retry_after else None)
            await set_faults(client, retry_after=None, error_rates={"503": 1.0})
            async with client.post("/generate", json=gen_body()) as r:
                assert r.status == 503 and "Retry-After" not in r.headers
            s = await stats(client)
            assert s["injected_errors"] == {"429": 1, "500": 1, "503": 2}
            assert s["requests_total"] == 4 and s["submitted"] == 0  # nothing reached the batch

    run(go())


# -- resets, truncation, hangs ---------------------------------------------------------------------


def test_reset_closes_without_a_response() -> None:
    async def go() -> None:
        async with sim_and_client(INSTANT.replace(reset_rate=1.0)) as (_, client):
            with pytest.raises(aiohttp.ServerDisconnectedError):
                async with client.post("/generate", json=gen_body()) as r:
                    await r.read()
            await set_faults(client, clear=True)
            status, _ = await post(client, "/generate", gen_body())  # the pool recovers
            s = await stats(client)
        assert status == 200 and s["resets"] == 1 and s["requests_total"] == 2

    run(go())


def test_truncated_body_after_the_generation_ran() -> None:
    cfg = FAST.replace(malformed_rate=1.0, malformed_kinds=("truncated",))

    async def go() -> None:
        async with sim_and_client(cfg) as (sim, client):
            with pytest.raises(aiohttp.ClientPayloadError):
                async with client.post("/generate", json=gen_body(max_new_tokens=MAX_NEW)) as r:
                    assert r.status == 200 and r.content_length is not None
                    await r.read()
            s = await stats(client)
        assert s["malformed"] == {"truncated": 1}
        assert sim.engine.stats().completed == 1  # it was a real generation whose reply broke

    run(go())


def test_hang_holds_no_slot_and_is_cleaned_up_when_the_client_leaves() -> None:
    async def go() -> None:
        async with sim_and_client(FAST.replace(hang_rate=1.0)) as (sim, client):
            async with aiohttp.ClientSession(base_url=sim.url) as leaving:
                waiting = asyncio.create_task(post(leaving, "/generate", gen_body()))
                await until(lambda: len(sim.faults.hanging) == 1)
                assert sim.engine.stats().running == 0 and sim.engine.stats().submitted == 0
                waiting.cancel()  # the client gives up
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
            await until(lambda: not sim.faults.hanging)
            await set_faults(client, hang_rate=0.0)
            status, _ = await post(client, "/generate", gen_body())
            s = await stats(client)
        assert status == 200 and s["hangs"] == 1 and s["hanging"] == 0

    run(go())


def test_hang_cleaned_up_by_the_sweep_without_handler_cancellation() -> None:
    async def go() -> None:
        runner = web.AppRunner(make_app(FAST.replace(hang_rate=1.0, disconnect_check_interval=0.05)))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        faults = runner.app[FAULTS]
        try:
            async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{runner.addresses[0][1]}") as leaving:
                waiting = asyncio.create_task(post(leaving, "/generate", gen_body()))
                await until(lambda: len(faults.hanging) == 1)
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
            await until(lambda: not faults.hanging)
        finally:
            await runner.cleanup()

    run(go())


def test_hang_ends_with_the_server() -> None:
    async def go() -> None:
        async with sim_and_client(FAST.replace(hang_rate=1.0)) as (sim, client):
            waiting = asyncio.create_task(post(client, "/generate", gen_body()))
            await until(lambda: len(sim.faults.hanging) == 1)
            await sim.stop()
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await waiting

    run(go())


# -- malformed replies and aborts -------------------------------------------------------------------


@pytest.mark.parametrize("kind", [k for k in MALFORMED_KINDS if k != "truncated"])
def test_malformed_kinds(kind: str) -> None:
    cfg = FAST.replace(malformed_rate=1.0, malformed_kinds=(kind,), length_dist="fixed", mean_tokens=50)

    async def go() -> None:
        async with sim_and_client(cfg) as (sim, client):
            async with client.post("/generate", json=gen_body(max_new_tokens=MAX_NEW)) as r:
                status, raw = r.status, await r.read()
            s = await stats(client)
        assert s["malformed"] == {kind: 1}
        # Everything but the proxy page is a generation that ran and whose reply got mangled.
        assert sim.engine.stats().completed == (0 if kind == "html-502" else 1)
        if kind == "html-502":
            assert status == 502 and raw.startswith(b"<html>") and b"502 Bad Gateway" in raw
            return
        assert status == 200
        if kind == "not-json":
            with pytest.raises(ValueError):
                json.loads(raw)
            return
        body = json.loads(raw)
        if kind == "no-meta":
            assert "meta_info" not in body and "text" in body
            return
        tokens = body["meta_info"].get("completion_tokens", "absent")
        expected = {
            "tokens-negative": lambda t: isinstance(t, int) and t < 0,
            "tokens-string": lambda t: t == str(len(body["output_ids"])),
            "tokens-huge": lambda t: isinstance(t, int) and t > MAX_NEW,
            "tokens-missing": lambda t: t == "absent",
        }[kind]
        assert expected(tokens), tokens

    run(go())


def test_injected_abort_runs_then_ends_as_abort() -> None:
    cfg = FAST.replace(abort_rate=1.0, length_dist="fixed", mean_tokens=1000)

    async def go() -> None:
        async with sim_and_client(cfg) as (sim, client):
            outs = [await post(client, "/generate", gen_body(max_new_tokens=MAX_NEW)) for _ in range(5)]
            s = await stats(client)
        for status, out in outs:
            meta = out["meta_info"]
            assert status == 200 and meta["finish_reason"]["type"] == "abort"
            assert set(meta["finish_reason"]) == {"type", "message", "status_code", "err_type"}
            assert meta["completion_tokens"] == len(out["output_ids"]) < MAX_NEW
        assert len({out["meta_info"]["completion_tokens"] for _, out in outs}) > 1  # cut at various points
        assert s["aborts_injected"] == 5 and s["aborted"] == 5 and s["completed"] == 0
        assert sim.engine.stats().completion_tokens_total == sum(o["meta_info"]["completion_tokens"] for _, o in outs)

    run(go())


# -- rates and determinism ------------------------------------------------------------------------------

MIXED = INSTANT.replace(
    fault_seed=1234,
    error_rates=((503, 0.1), (500, 0.05), (429, 0.1)),
    reset_rate=0.05,
    malformed_rate=0.1,
    malformed_kinds=("no-meta", "tokens-huge"),
    abort_rate=0.05,
)
EXPECTED = {"503": 0.1, "500": 0.05, "429": 0.1, "reset": 0.05, "malformed": 0.1, "abort": 0.05, "ok": 0.55}


async def classify(client: aiohttp.ClientSession) -> str:
    try:
        async with client.post("/generate", json=gen_body(max_new_tokens=MAX_NEW)) as r:
            body = await r.json()
            if r.status != 200:
                return str(r.status)
    except aiohttp.ServerDisconnectedError:
        return "reset"
    meta = body.get("meta_info")
    if meta is None or meta.get("completion_tokens", 0) > MAX_NEW:
        return "malformed"
    return "abort" if meta["finish_reason"]["type"] == "abort" else "ok"


async def mixed_run(cfg: SimConfig, n: int) -> tuple[list[str], dict[str, Any]]:
    async with sim_and_client(cfg) as (_, client):
        seen = [await classify(client) for _ in range(n)]
        return seen, await stats(client)


def test_rates_and_counters_over_many_requests() -> None:
    n = 300
    seen, s = run(mixed_run(MIXED, n))
    counts = collections.Counter(seen)
    for outcome, rate in EXPECTED.items():
        assert abs(counts[outcome] / n - rate) < 0.06, (outcome, counts)
    assert s["injected_errors"] == {k: counts[k] for k in ("429", "500", "503")}
    assert s["resets"] == counts["reset"] and s["aborts_injected"] == counts["abort"]
    assert sum(s["malformed"].values()) == counts["malformed"] and set(s["malformed"]) <= {"no-meta", "tokens-huge"}
    assert s["requests_total"] == n == sum(c for _, c in s["requests_by_second"])


def test_faults_are_deterministic_given_the_fault_seed() -> None:
    a, _ = run(mixed_run(MIXED, 60))
    b, _ = run(mixed_run(MIXED.replace(seed=99), 60))  # the output seed does not move the faults
    c, _ = run(mixed_run(MIXED.replace(fault_seed=1235), 60))
    assert a == b and a != c
    # Without --fault-seed the draws follow --seed.
    assert FaultSettings.from_config(SimConfig(seed=5)).fault_seed == 5
    settings = FaultSettings.from_config(MIXED)
    assert [draw(settings, i) for i in range(1, 50)] == [draw(settings, i) for i in range(1, 50)]


def test_requests_total_counts_bad_requests_too() -> None:
    async def go() -> None:
        async with sim_and_client(INSTANT) as (_, client):
            await post(client, "/generate", {"text": "a", "sampling_params": {"top_p": 0.0}})
            await post(client, "/generate", gen_body())
            s = await stats(client)
        assert s["requests_total"] == 2 and s["submitted"] == 1
        assert s["injected_errors"] == {} and s["malformed"] == {} and s["resets"] == s["hangs"] == 0
        [[second, count]] = s["requests_by_second"]
        assert second >= 0 and count == 2

    run(go())


# -- outages ----------------------------------------------------------------------------------------


def test_configured_outage_windows_start_and_end_on_time() -> None:
    """--outage windows on virtual time (tests/virtual_time.py), so their edges are exact: each starts at its start
    and ends after its duration by itself; an overlapping window merges with the one running, as one outage that ends
    with the later of the two (here the first: (1.1, 0.2) lies inside (1.0, 0.5))."""
    windows = ((0.0, 0.3), (1.0, 0.5), (1.1, 0.2))

    async def go() -> list[tuple[float, bool, float]]:
        loop = asyncio.get_running_loop()
        faults = FaultState(FaultSettings.from_config(INSTANT), windows, clock=loop.time)
        faults.start()
        seen = []
        for t in (0.0001, 0.2999, 0.3001, 0.9999, 1.0001, 1.1001, 1.4999, 1.5001):
            await asyncio.sleep(t - loop.time())
            seen.append((round(loop.time(), 4), faults.in_outage, round(faults.outage_remaining(), 4)))
        assert faults.counters.outages_started == 2
        return seen

    assert run_virtual(go()) == [(0.0001, True, 0.2999), (0.2999, True, 0.0001), (0.3001, False, 0.0),
                                 (0.9999, False, 0.0), (1.0001, True, 0.4999), (1.1001, True, 0.3999),
                                 (1.4999, True, 0.0001), (1.5001, False, 0.0)]


def test_configured_outage_window_then_normal() -> None:
    """The wire side of a configured window: 503 with Retry-After and /health 503 while it runs, normal answers
    after. The window is long and ended live, so no request can miss it on a slow machine; that a window ends by
    itself is test_configured_outage_windows_start_and_end_on_time's."""
    cfg = INSTANT.replace(outages=((0.0, 60.0),), retry_after=1.0)

    async def go() -> None:
        async with sim_and_client(cfg) as (sim, client):
            await until(lambda: sim.faults.in_outage)
            async with client.post("/generate", json=gen_body()) as r:
                assert r.status == 503 and sglang_error(await r.json(), 503) and r.headers["Retry-After"] == "1"
            async with client.get("/health") as r:
                assert r.status == 503
            sim.faults.end_outage()
            status, out = await post(client, "/generate", gen_body())
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
            async with client.get("/health") as r:
                assert r.status == 200
            s = await stats(client)
        assert s["outages_started"] == 1 and s["outage_rejected"] == 1 and s["requests_total"] == 2

    run(go())


def test_live_outage_cuts_in_flight_requests_and_ends_on_demand() -> None:
    async def go() -> None:
        async with sim_and_client(SLOW.replace(hang_rate=0.0)) as (sim, client):
            running = asyncio.create_task(post(client, "/generate", gen_body(max_new_tokens=30000)))
            await until(lambda: sim.engine.stats().running == 1)
            state = await set_faults(client, outage_for=5)
            assert state["in_outage"] and 0 < state["outage_remaining"] <= 5  # exact: the virtual-time test above
            status, body = await running
            assert status == 503 and sglang_error(body, 503)
            assert sim.engine.stats().running == 0 and sim.engine.stats().aborted == 1
            assert (await post(client, "/generate", gen_body()))[0] == 503
            state = await set_faults(client, outage_for=0)
            assert not state["in_outage"] and state["outage_remaining"] == 0
            await set_faults(client, outage_for=0)  # ending no outage is harmless
            async with client.post("/generate", json=gen_body(max_new_tokens=0)) as r:
                assert r.status == 200
            s = await stats(client)
        assert s["outage_cut"] == 1 and s["outage_rejected"] == 1 and s["outages_started"] == 1

    run(go())


def test_refuse_mode_closes_the_listening_socket() -> None:
    async def go() -> None:
        async with sim_and_client(SLOW.replace(outage_mode="refuse")) as (sim, client):
            running = asyncio.create_task(post(client, "/generate", gen_body(max_new_tokens=30000)))
            await until(lambda: sim.engine.stats().running == 1)
            await set_faults(client, outage_for=5)
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await running  # in flight when the server "went down"
            await until(lambda: not sim.faults.listening)
            async with aiohttp.ClientSession(base_url=sim.url) as fresh:
                with pytest.raises(aiohttp.ClientConnectorError):
                    await post(fresh, "/health", None)
            sim.faults.end_outage()
            await until(lambda: sim.faults.listening)
            async with aiohttp.ClientSession(base_url=sim.url) as fresh:
                assert (await post(fresh, "/generate", gen_body(max_new_tokens=0)))[0] == 200

    run(go())


def test_configured_refuse_outage_from_the_start() -> None:
    async def go() -> None:
        # A long window, ended live: a request cannot miss it on a slow machine (the ends are the virtual-time test's).
        async with sim_and_client(INSTANT.replace(outages=((0.0, 60.0),), outage_mode="refuse")) as (sim, _):
            await until(lambda: not sim.faults.listening)
            async with aiohttp.ClientSession(base_url=sim.url) as fresh:
                with pytest.raises(aiohttp.ClientConnectorError):
                    await post(fresh, "/generate", gen_body())
            sim.faults.end_outage()
            await until(lambda: sim.faults.listening and not sim.faults.in_outage)
            async with aiohttp.ClientSession(base_url=sim.url) as fresh:
                assert (await post(fresh, "/generate", gen_body()))[0] == 200

    run(go())


# -- live control -----------------------------------------------------------------------------------


def test_sim_faults_get_post_and_validation() -> None:
    async def go() -> None:
        async with sim_and_client(INSTANT) as (_, client):
            async with client.get("/sim/faults") as r:
                state = await r.json()
            assert state == {
                "fault_seed": 0, "error_rates": {}, "retry_after": None, "reset_rate": 0.0, "hang_rate": 0.0,
                "malformed_rate": 0.0, "malformed_kinds": list(MALFORMED_KINDS), "abort_rate": 0.0,
                "outage_mode": "503", "outages": [], "in_outage": False, "outage_remaining": 0.0, "listening": True,
            }
            state = await set_faults(client, error_rates={"503": 0.2}, reset_rate=0.1, malformed_kinds="truncated,no-meta",
                                     retry_after=0.5, fault_seed=7)
            assert state["error_rates"] == {"503": 0.2} and state["reset_rate"] == 0.1 and state["fault_seed"] == 7
            assert state["malformed_kinds"] == ["truncated", "no-meta"] and state["retry_after"] == 0.5
            for bad in ({"reset_rate": 2}, {"reset_rate": "x"}, {"abort_rate": 0.8}, {"error_rates": {"200": 0.1}},
                        {"malformed_kinds": ["bogus"]}, {"outage_mode": "nap"}, {"outage_for": -1}, {"nope": 1}):
                async with client.post("/sim/faults", json=bad) as r:
                    assert r.status == 400 and isinstance((await r.json())["error"], str), bad
            async with client.get("/sim/faults") as r:
                assert (await r.json())["reset_rate"] == 0.1  # a refused change changes nothing
            state = await set_faults(client, clear=True, hang_rate=0.01)
            assert state["error_rates"] == {} and state["reset_rate"] == 0.0 and state["hang_rate"] == 0.01
            assert state["retry_after"] == 0.5  # clear turns faults off, it does not forget shapes

    run(go())


def test_a_poison_rid_hangs_on_every_attempt_and_other_rids_are_answered() -> None:
    from budget.record import request_id
    poison = request_id("ds", "bad", 0)[:28]
    assert request_id("ds", "bad", 7).startswith(poison) and not request_id("ds", "good", 0).startswith(poison)

    async def go() -> None:
        async with sim_and_client(FAST.replace(hang_rid_prefixes=(poison,))) as (sim, client):
            async with aiohttp.ClientSession(base_url=sim.url) as leaving:
                bodies = [{**gen_body(), "rid": request_id("ds", "bad", attempt)} for attempt in (0, 1)]
                waiting = [asyncio.create_task(post(leaving, "/generate", body)) for body in bodies]
                await until(lambda: len(sim.faults.hanging) == 2)
                status, _ = await post(client, "/generate", {**gen_body(), "rid": request_id("ds", "good", 0)})
                assert status == 200
                for task in waiting:
                    task.cancel()  # the worker dies
                for task in waiting:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await until(lambda: not sim.faults.hanging)
            s = await stats(client)
        assert s["hangs"] == 2 and s["hanging"] == 0 and sim.engine.stats().completed == 1

    run(go())
    assert from_argv(["--hang-rid-prefix", "ab", "--hang-rid-prefix", "cd"]).hang_rid_prefixes == ("ab", "cd")
    with pytest.raises(SystemExit):
        from_argv(["--hang-rid-prefix", ""])


def test_cli_fault_options() -> None:
    cfg = from_argv([
        "--error-rate", "503=0.1", "--error-rate", "429=0.05", "--error-rate", "503=0.2", "--retry-after", "3",
        "--reset-rate", "0.01", "--hang-rate", "0.02", "--malformed-rate", "0.03", "--malformed-kind", "truncated,no-meta",
        "--malformed-kind", "html-502", "--abort-rate", "0.04", "--outage", "10:5", "--outage-mode", "refuse",
        "--fault-seed", "9",
    ])
    assert cfg.error_rates == ((503, 0.2), (429, 0.05)) and cfg.retry_after == 3.0
    assert (cfg.reset_rate, cfg.hang_rate, cfg.malformed_rate, cfg.abort_rate) == (0.01, 0.02, 0.03, 0.04)
    assert cfg.malformed_kinds == ("truncated", "no-meta", "html-502")
    assert cfg.outages == ((10.0, 5.0),) and cfg.outage_mode == "refuse" and cfg.fault_seed == 9
    for bad in (["--error-rate", "503"], ["--error-rate", "200=0.1"], ["--reset-rate", "0.6", "--hang-rate", "0.6"],
                ["--malformed-kind", "nope"], ["--outage", "5"], ["--outage", "5:0"]):
        with pytest.raises(SystemExit):
            from_argv(bad)


def test_console_script_with_faults() -> None:
    with SimProcess(["--error-rate", "503=1", "--retry-after", "1"]) as sim:

        async def go() -> None:
            async with aiohttp.ClientSession(base_url=sim.url) as client:
                async with client.post("/generate", json=gen_body()) as r:
                    assert r.status == 503 and r.headers["Retry-After"] == "1"

        run(go())


# -- the worker's client survives every fault -------------------------------------------------------

FAULT_CONFIGS = {
    "503": INSTANT.replace(error_rates=((503, 1.0),), retry_after=0.5),
    "500": INSTANT.replace(error_rates=((500, 1.0),)),
    "429": INSTANT.replace(error_rates=((429, 1.0),)),
    "reset": INSTANT.replace(reset_rate=1.0),
    "hang": INSTANT.replace(hang_rate=1.0),
    "abort": INSTANT.replace(abort_rate=1.0),
    **{kind: INSTANT.replace(malformed_rate=1.0, malformed_kinds=(kind,)) for kind in MALFORMED_KINDS},
}


@pytest.mark.parametrize("fault", sorted(FAULT_CONFIGS))
def test_worker_client_sees_each_fault_as_retryable(fault: str) -> None:
    async def go() -> None:
        async with sim_and_client(FAULT_CONFIGS[fault].replace(length_dist="fixed", mean_tokens=500)) as (sim, session):
            # A short timeout ends the hang; any other fault is answered at once, and a timeout there would hide
            # its status on a slow machine.
            timeout = 0.3 if fault == "hang" else 10.0
            client = SGLangClient(session, WorkerConfig(servers=(sim.url,), request_timeout=timeout))
            with pytest.raises(GenerateError) as info:
                await client.generate({**gen_body(max_new_tokens=MAX_NEW), "rid": "r"}, MAX_NEW)
            assert info.value.retryable, info.value.reason
            if fault == "503":
                assert info.value.status == 503 and info.value.retry_after == 0.5

    run(go())
