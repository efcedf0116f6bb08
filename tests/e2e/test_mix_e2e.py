"""A mix end to end (docs/mix.md): real rq workers, the simulator, one worker killed with kill -9 mid-run, and a
dataset that runs dry passing the rest of its share on, so the total still lands on the total budget; and Redis
killed and started again from its AOF mid-run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from budget.ledger import mix_id
from demo.stack import RedisServer
from tests.demo_data import CODE, GLAIVE
from tests.exactly_once import check_exact
from tests.procs import Workers, produce, produce_cmd, sim_stats, wait_for


@pytest.mark.e2e
def test_a_mix_lands_on_its_total_and_a_dry_dataset_passes_its_rest_on(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    # "small": 12 prompts of ~100 tokens against a share of 6,000: it runs dry near 1,200 and its rest goes to the
    # others, 1:1. code_instruct and glaive_fc have 150 and 120 prompts: enough for their grown shares.
    small = tmp_path / "small.jsonl"
    small.write_text("".join(line.replace('"id": "', '"id": "small-') for line in
                             CODE.read_text().splitlines(keepends=True)[:12]))
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "100", "--seed", "27")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="4")
    victim = pool.start("victim")
    pool.start("w1")
    out = tmp_path / "out"
    total, max_new = 12_000, 300
    with open(tmp_path / "produce.out", "wb") as so, open(tmp_path / "produce.err", "wb") as se:
        prod = subprocess.Popen([*produce_cmd(), str(CODE), str(GLAIVE), str(small), "--tokenizer", str(tokenizer_dir),
                                 "--max-tokens", str(max_new), "--turns", "last", "--budget", str(total), "--mix",
                                 "code_instruct=1,glaive_fc=1,small=2", "--chunk-size", "4", "--out", str(out),
                                 "--redis-url", redis_url], stdout=so, stderr=se)
    try:
        used = keys.DatasetKeys("code_instruct").used
        wait_for(lambda: int(r.get(used) or 0) > 1_000, 120, "the run under way")
        os.kill(victim.pid, signal.SIGKILL)  # its chunks are reclaimed after their lease; nothing counted twice
        victim.wait()
        assert prod.wait(timeout=300) == 0, (tmp_path / "produce.err").read_text()
    finally:
        if prod.poll() is None:
            prod.kill()
    said = (tmp_path / "produce.err").read_text() + (tmp_path / "produce.out").read_text()
    assert "small: ran dry at" in said, said
    got = {n: sum(x["completion_tokens"] for x in check_exact(r, out, n)) for n in ("code_instruct", "glaive_fc", "small")}
    budgets = {n: int(r.hget(keys.DatasetKeys(n).meta, "budget") or 0) for n in got}
    assert budgets["small"] == got["small"] < 6_000  # it kept what it made
    assert sum(budgets.values()) == total  # the shares still sum to the total
    assert abs(budgets["code_instruct"] - budgets["glaive_fc"]) <= 1  # the rest went 1:1
    for name in ("code_instruct", "glaive_fc"):
        # predict closes when used reaches the share; what was in flight then (2 workers x 4, each <= max_new) may
        # land after it.
        assert budgets[name] <= got[name] <= budgets[name] + 8 * max_new, (name, got, budgets)
    assert sum(got.values()) >= total
    assert sim_stats(sim.url)["completed"] >= sum(r.hlen(keys.DatasetKeys(n).done) for n in got)
    status = produce(["status"], redis_url)
    assert status.returncode == 0 and "mix of 3: total 12,000: code_instruct=1" in status.stdout, status.stdout
    assert f"small=2 ({got['small']:,}, ran dry)" in status.stdout
    manifest = json.loads((out / "small" / "manifest.json").read_text())
    assert manifest["extra"]["mix"] == {"total": total, "weights": {"code_instruct": "1", "glaive_fc": "1", "small": "2"},
                               "weight": "2", "share": got["small"], "got": got["small"], "ran_dry": True}
    assert manifest["extra"]["request_seconds"] > 0  # its requests' time, summed: the cost in view


class FsyncAlwaysRedis(RedisServer):
    """A redis-server whose AOF is fsynced on every write: killed with kill -9, it comes back with everything it
    acknowledged, so whatever a restart loses is the product's doing, not the fsync interval's."""

    def argv(self, binary: str) -> list[str]:
        argv = super().argv(binary)
        argv[argv.index("--appendfsync") + 1] = "always"
        return argv


def _mix_state(r: "redis.Redis", mix: str, names: tuple[str, ...]) -> dict[str, Any]:
    """What a restart must keep: the mix hash, and each member's share, deadline and mix field."""
    fields = ("budget", "deadline", "mix")
    return {"mix": r.hgetall(keys.mix(mix)),
            **{n: dict(zip(fields, r.hmget(keys.DatasetKeys(n).meta, list(fields)), strict=True)) for n in names}}


@pytest.mark.e2e
def test_a_mix_with_a_deadline_survives_redis_restarted_from_its_aof(
        tmp_path: Path, tokenizer_dir: Path, sim_factory: Any) -> None:
    """docs/mix.md failure case: Redis killed with kill -9 mid-run and started again from its AOF (same port, same
    directory). The attached producer and the workers carry on; the mix hash, each member's share and the deadline
    are as before the kill, the shares still sum to the total, and every member's counter equals its file, each id
    once."""
    server = FsyncAlwaysRedis(tmp_path / "redis")
    server.start()
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "100", "--seed", "28")
    pool = Workers(server.url, sim.url, tmp_path, {"BUDGETQ_CONCURRENCY": "4"})
    r = redis.Redis.from_url(server.url)
    out = tmp_path / "out"
    names = ("code_instruct", "glaive_fc")
    total, max_new = 10_500, 300  # glaive_fc has ~9,600 tokens of prompts here: no member runs dry
    with open(tmp_path / "produce.out", "wb") as so, open(tmp_path / "produce.err", "wb") as se:
        prod = subprocess.Popen([*produce_cmd(), str(CODE), str(GLAIVE), "--tokenizer", str(tokenizer_dir),
                                 "--max-tokens", str(max_new), "--turns", "last", "--budget", str(total), "--mix",
                                 "code_instruct=1,glaive_fc=2", "--for", "2h", "--chunk-size", "4", "--out", str(out),
                                 "--redis-url", server.url], stdout=so, stderr=se)
    try:
        pool.start("w0")
        pool.start("w1")
        used = {n: keys.DatasetKeys(n).used for n in names}
        wait_for(lambda: all(int(r.get(k) or 0) > 600 for k in used.values()), 120, "both members under way")
        before = _mix_state(r, mix_id(names), names)
        server.kill()  # kill -9 with chunks in flight: their commits wait for Redis
        server.start()  # same port, same directory: it replays the AOF
        assert _mix_state(r, mix_id(names), names) == before  # as the AOF gave it back
        budgets = {n: int(before[n]["budget"]) for n in names}
        assert all(int(r.get(used[n]) or 0) < budgets[n] for n in names)  # the run was not over at the kill
        assert prod.wait(timeout=240) == 0, (tmp_path / "produce.err").read_text()
        assert all(p.poll() is None for p in pool.procs), "a worker quit on the Redis restart"
        assert _mix_state(r, mix_id(names), names) == before  # the mix, the shares, the deadline: as they were
        assert sum(budgets.values()) == total and budgets["glaive_fc"] == 2 * budgets["code_instruct"]
        for name in names:
            got = sum(x["completion_tokens"] for x in check_exact(r, out, name))  # nothing counted twice
            # predict closes at the share; what was in flight then (2 workers x 4, each <= max_new) may land after.
            assert budgets[name] <= got <= budgets[name] + 8 * max_new, (name, got, budgets)
    finally:
        if prod.poll() is None:
            prod.kill()
        pool.stop_all()
        server.kill()
