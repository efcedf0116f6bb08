"""A mix end to end (docs/mix.md): real rq workers, the simulator, one worker killed with kill -9 mid-run, and a
dataset that runs dry passing the rest of its share on, so the total still lands on the total budget."""
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
from tests.demo_data import CODE, GLAIVE
from tests.exactly_once import check_exact
from tests.procs import produce, produce_cmd, sim_stats, wait_for


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
