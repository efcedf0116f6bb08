"""``produce sample`` on a real run (real `rq worker`, the simulator, `produce` attached): mid-run it shows records
that are on disk, read-only; the run's summary ends with the length picture of what it wrote, which ``produce
sample -n 0`` draws the same after it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from producer.ops.status import picture, read_lengths
from tests.demo_data import CODE
from tests.procs import produce_cmd, read_jsonl, wait_for

DS = "code_instruct"


def sample(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``produce sample DS --out OUT ARGS`` as a user types it: it takes no Redis."""
    return subprocess.run([*produce_cmd(), "sample", DS, "--out", str(out), *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.e2e
def test_sample_mid_run_shows_records_on_disk_and_the_summary_ends_with_their_lengths(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    sim = sim_factory("--tokens-per-second-per-request", "200", "--mean-tokens", "150", "--seed", "6")
    worker = workers(sim.url, BUDGETQ_CONCURRENCY="4").start("w0")
    out = tmp_path / "out"
    results = out / DS / "raw_responses.jsonl"
    # --max-tokens 256 under a mean of 150: some answers are cut, so the picture has its cut row.
    proc = subprocess.Popen([*produce_cmd(), str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "256",
                             "--max-samples", "30", "--chunk-size", "5", "--out", str(out), "--turns", "last",
                             "--redis-url", redis_url, "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(read_jsonl(results)) >= 4, 60, "first results")
        os.kill(worker.pid, signal.SIGSTOP)  # the run cannot end while it is looked at (its lease is 20 s)
        try:
            shown = sample(out, "-n", "3", "--seed", "1")
            raw = sample(out, "-n", "2", "--latest", "--json")
            assert proc.poll() is None  # still attached: these were mid-run looks
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    lines = results.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 30
    # The records named mid-run are the file's: each rule names the id on the line it says.
    assert shown.returncode == 0, shown.stderr
    named = re.findall(r"^── (\S+) · line (\d+) · ", shown.stdout, re.M)
    assert len(named) == 3 and all(json.loads(lines[int(n) - 1])["id"] == sid for sid, n in named), shown.stdout
    read_mid_run = int(re.search(r"^3 of (\d+) records of ", shown.stdout, re.M).group(1))  # type: ignore[union-attr]
    assert 4 <= read_mid_run < 30
    # --json: the records as written, the file's own lines.
    assert raw.returncode == 0 and len(raw.stdout.splitlines()) == 2 and set(raw.stdout.splitlines()) <= set(lines)
    # The summary ends with the picture of every response written; after the run, sample -n 0 draws it alike.
    want = picture(DS, read_lengths(results))
    assert want[0].startswith(f"{DS}: 30 responses,") and want[-1].lstrip().startswith("cut ")
    assert stdout.splitlines()[-len(want):] == want, stdout
    before = {p.name: p.read_bytes() for p in (out / DS).iterdir()}
    after_run = sample(out, "-n", "0")
    assert after_run.returncode == 0 and after_run.stdout.splitlines() == [f"30 records of {results}", *want]
    assert {p.name: p.read_bytes() for p in (out / DS).iterdir()} == before  # read-only
