"""Through SGLang's real router (SGLang Model Gateway, sglang-router 0.3.2's `smg`) in front of two simulators.

Real parts end to end: produce (CLI) -> Redis -> rq workers -> `smg launch` on a free loopback port (demo/smg.py,
started with the settings docs/deployment.md recommends) -> two sglang-sim processes. Its readiness is awaited by
polling its /readiness (another process); the simulators' /sim/stats say what the GPUs did.
"""
from __future__ import annotations

import json
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from demo.smg import Router
from tests.demo_data import CODE, GLAIVE
from tests.exactly_once import check_exact
from tests.procs import produce, produce_cmd, read_jsonl, sim_stats, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROUTER_WARNING = "is SGLang's router; it does not report its --request-timeout-secs"


def test_a_budgeted_run_through_the_router_is_exactly_once(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                           tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    sims = [sim_factory("--time-scale", "20", "--mean-tokens", "300", "--seed", str(i)) for i in (1, 2)]
    with Router([s.url for s in sims], tmp_path / "smg", policy="cache_aware") as router:
        # A deadline above the router's default 1,800 s (120 + 1024 / 0.5 s): the worker must say so, once.
        pool = workers(router.url, BUDGETQ_CONCURRENCY="8", BUDGETQ_MIN_TOKENS_PER_SECOND="0.5")
        for i in range(2):
            pool.start(f"w{i}")
        out = tmp_path / "out"
        budget = 15_000
        res = produce([str(GLAIVE), str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1024",
                       "--budget", f"code_instruct={budget}", "--chunk-size", "8", "--queue-depth", "4",
                       "--out", str(out), "--turns", "last"], redis_url)  # one request per record, counted below
        assert res.returncode == 0, res.stderr
        code = check_exact(r, out, "code_instruct")
        assert budget <= sum(x["completion_tokens"] for x in code) and len(code) < 150
        glaive = check_exact(r, out, "glaive_fc")
        assert sorted(x["id"] for x in glaive) == sorted({str(x["id"]) for x in read_jsonl(GLAIVE)})
        # Every answer a GPU produced is in a file, once (cache_aware may keep most prompts on one server: with
        # 16 in flight it is never unbalanced enough to move them, so no share per server is asserted).
        stats = [sim_stats(s.url) for s in sims]
        assert sum(s["completed"] for s in stats) == len(code) + len(glaive)
        assert all(s["aborted"] == 0 for s in stats)

        # The manifest names the servers behind the router, never the router's own statistics as a server.
        manifest = json.loads((out / "glaive_fc" / "manifest.json").read_text())
        assert manifest["server"]["version"] == "0.5.23-sim" and manifest["server"]["model_path"] == "sglang-sim"
        assert sorted(e["url"] for e in manifest["servers"]) == sorted(s.url for s in sims)  # one host: one each
        assert {e["via"] for e in manifest["servers"]} == {router.url}
        assert "server_unknown" not in manifest
        for name in ("w0", "w1"):
            def warned(name: str = name) -> bool:
                return ROUTER_WARNING in pool.log(name)
            wait_for(warned, 30, f"{name}'s router timeout warning")
            assert pool.log(name).count(ROUTER_WARNING) == 1
            assert "--request-timeout-secs 2228 or more" in pool.log(name)


def test_a_backend_killed_mid_run_loses_nothing(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                               tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    # ~0.3 s a request at 1x: enough in flight on each server when one dies.
    sims = [sim_factory("--time-scale", "1", "--mean-tokens", "300", "--seed", str(i)) for i in (1, 2)]
    victim, survivor = sims
    with Router([s.url for s in sims], tmp_path / "smg", policy="round_robin") as router:
        pool = workers(router.url, BUDGETQ_CONCURRENCY="8")
        for i in range(2):
            pool.start(f"w{i}")
        out = tmp_path / "out"
        n = 120
        proc = subprocess.Popen([*produce_cmd(), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens",
                                 "1024", "--chunk-size", "8", "--out", str(out), "--redis-url", redis_url,
                                 "--turns", "last"],  # one request per record: the counts below
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            done = keys.DatasetKeys("glaive_fc").done
            wait_for(lambda: r.hlen(done) >= 30 and sim_stats(victim.url)["running"] > 0, 120,
                     "30 samples committed and requests running on the victim")
            before = sim_stats(victim.url)
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            stdout, stderr = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr
        recs = check_exact(r, out, "glaive_fc")
        assert len(recs) == n and not (out / "glaive_fc" / "failed.jsonl").exists()
        after = sim_stats(survivor.url)
        assert after["aborted"] == 0
        # Each sample was generated to the end exactly once: what the victim had finished (at least what it had
        # when it was killed, at most that plus what it was running) plus what the survivor finished. So what was
        # in flight on the victim was redone once on the survivor, and nothing twice.
        in_flight = before["running"] + before["queued"]
        assert n - before["completed"] - in_flight <= after["completed"] <= n - before["completed"]
        assert in_flight > 0


def test_a_router_whose_servers_cannot_be_asked_leaves_version_and_model_unknown(tmp_path: Path,
                                                                                sim_factory: Any) -> None:
    from budget import serverinfo
    from producer.export.writer import write_manifest
    sim = sim_factory("--time-scale", "50")
    with Router([sim.url], tmp_path / "smg", policy="round_robin") as router:
        with urllib.request.urlopen(router.url + "/get_server_info", timeout=5) as resp:
            own = json.loads(resp.read())
        assert serverinfo.is_router(own), own  # its statistics, no version, no model
        with pytest.raises(serverinfo.ServerInfoError, match="router"):
            serverinfo.fetch(router.url)
        [found] = serverinfo.discover(router.url)
        assert (found.url, found.via, found.info["version"]) == (sim.url, router.url, "0.5.23-sim")
        sim.stop()  # still listed by the router, but no longer answering
        [found] = serverinfo.discover(router.url, timeout=3)
    assert found.router and found.url == router.url and found.info == {}
    dataset = tmp_path / "out" / "ds"
    dataset.mkdir(parents=True)
    (dataset / "run.json").write_text("{}")
    manifest = json.loads(write_manifest(dataset, servers=[found.entry()]).read_text())
    assert manifest["server"] == {} and manifest["servers"] == [{"url": router.url, "router": True}]
    assert "SGLang version and model unknown" in manifest["server_unknown"]
