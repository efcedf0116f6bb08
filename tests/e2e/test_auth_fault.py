"""A wrong SGLANG_API_KEY is a configuration fault of the worker, not a failure of the samples.

Real parts: produce (attached, a subprocess), real ``rq worker -w worker.Worker`` processes, the simulator over
HTTP requiring a key (it answers SGLang's 401). The wrong-key workers are restarted whenever they exit, as a
supervisor would (compose ``restart: unless-stopped``), for ~20 s; then workers with the right key finish the run.
"""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from tests.demo_data import GLAIVE
from tests.exactly_once import check_exact
from tests.procs import produce_cmd, read_jsonl, sim_stats

pytestmark = pytest.mark.e2e

SECRET = "sk-right-key-5b1e"
WRONG = "sk-wrong-key-9c2d"
EXIT_CONFIG = 78  # worker/rqworker.py
FAULT_S = 20.0
LINE = "refused this worker's credentials"


def test_wrong_api_key_gives_chunks_back_and_exits_then_right_key_finishes(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "50", "--seed", "12", "--api-key", SECRET)
    bad = workers(sim.url, BUDGETQ_CONCURRENCY="8", SGLANG_API_KEY=WRONG)
    out = tmp_path / "out"
    n = 40
    with open(tmp_path / "produce.out", "wb") as so, open(tmp_path / "produce.err", "wb") as se:
        prod = subprocess.Popen([*produce_cmd(), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens",
                                 "256", "--max-samples", str(n), "--chunk-size", "8", "--queue-depth", "4",
                                 "--out", str(out), "--redis-url", redis_url], stdout=so, stderr=se)
    k = keys.DatasetKeys("glaive_fc")
    try:
        # The supervisor: every wrong-key worker that exits is started again under its name, for FAULT_S.
        names = ["bad0", "bad1"]
        procs = {name: bad.start(name) for name in names}
        starts = dict.fromkeys(names, 1)
        codes: list[int] = []
        t0 = time.monotonic()
        while True:
            for name, proc in list(procs.items()):
                if proc.poll() is None:
                    continue
                codes.append(proc.returncode)
                # rq's teardown marks the registration dead (it expires in 60 s): a restart under the name is let in
                key = f"rq:worker:{name}"
                assert not r.exists(key) or r.hexists(key, "death"), "an exited worker left a live registration"
                if time.monotonic() - t0 < FAULT_S:
                    procs[name] = bad.start(name)  # same name: rq refuses it if the old registration is alive
                    starts[name] += 1
                else:
                    del procs[name]
            if not procs:
                break
            assert time.monotonic() - t0 < FAULT_S + 120, "a wrong-key worker did not exit"
            time.sleep(0.05)  # polling other processes' exits: there is no event to await across them
        assert prod.poll() is None, (tmp_path / "produce.err").read_text()

        refused = sim_stats(sim.url)["unauthorized"]
        assert refused > 0 and sim_stats(sim.url)["completed"] == 0
        assert codes and all(c == EXIT_CONFIG for c in codes), codes
        assert r.hlen(k.failed) == 0, "samples were marked failed for the worker's wrong key"
        assert int(r.get(k.used) or 0) == 0 and r.hlen(k.done) == 0
        for name in names:
            text = bad.log(name)
            # One error per start, naming the status, the server and the variable, never the key.
            assert text.count(LINE) == starts[name], text[-2000:]
            line = next(x for x in text.splitlines() if LINE in x)
            assert "401" in line and sim.url in line and "SGLANG_API_KEY" in line and "ERROR" in line, line
            assert WRONG not in text and SECRET not in text
            assert "Traceback" not in text, text[-2000:]
        # The chunks were given back, not failed: their jobs finished with status unauthorized.
        results = [str(r.hget(key, "meta") or b"") for key in r.scan_iter("rq:job:bq-glaive_fc-*")]
        assert any('"state": "done"' in m and '"stop_reason": "unauthorized"' in m for m in results), results[:3]

        # The right key: the run finishes, every sample exactly once, nothing failed.
        good = workers(sim.url, BUDGETQ_CONCURRENCY="8", SGLANG_API_KEY=SECRET)
        good.start("good0")
        good.start("good1")
        assert prod.wait(180) == 0, (tmp_path / "produce.err").read_text()
    finally:
        if prod.poll() is None:
            prod.kill()
            prod.wait()
    recs = check_exact(r, out, "glaive_fc")
    assert len(recs) == n and len({x["id"] for x in recs}) == n
    assert not read_jsonl(out / "glaive_fc" / "failed.jsonl")
    assert sim_stats(sim.url)["unauthorized"] == refused  # the right-key workers were never refused
    print(f"wrong key for {FAULT_S:.0f} s: {sum(starts.values())} worker starts, {refused} requests refused, "
          f"0 samples failed")
