"""`make sglang-cpu-smoke` is opt-in (it builds SGLang's CPU kernels), so nothing else runs its script: run it here
with ``--sim``, the simulator in place of the engine, so that the script keeps working as budgetq changes
(its produce, worker and export command lines, its exactly-once and id checks). The real engine's answers are
held to the simulator by tests/unit/test_sim_contract_real.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_the_real_engine_smoke_script_passes_against_the_simulator(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.sglang_cpu_smoke", "--sim", "--cache", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=280)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert "PASSED" in done.stderr + done.stdout, tail
    assert "killed worker" in done.stderr + done.stdout, tail  # the kill -9 step ran
