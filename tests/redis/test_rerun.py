"""Reruns of ``produce``: where the run's files are (issue 29, High 2), which budget a rerun keeps, what it refuses.

End to end where the run's own files and workers matter: real redis-server, real ``rq worker`` processes, produce
as a subprocess started from the directory a user would start it in.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from tests.demo_data import CODE
from tests.exactly_once import check_exact
from tests.procs import produce_cmd, read_jsonl, sim_stats, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _sigint_as_a_terminal_sends_it() -> None:
    """Ctrl-C's default disposition in the child, even when the suite runs with SIGINT ignored (tests/e2e/test_e2e.py
    says why)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env() -> dict[str, str]:
    """produce started from another directory still imports this checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}


def _files(top: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}


@pytest.mark.e2e
def test_a_rerun_whose_out_resolves_elsewhere_is_refused_and_the_stored_out_resumes(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "200", "--seed", "6")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="4")
    pool.start("w0")
    first_dir, elsewhere = tmp_path / "first", tmp_path / "elsewhere"
    first_dir.mkdir()
    elsewhere.mkdir()
    args = [*produce_cmd(), str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "1024", "--chunk-size", "4",
            "--queue-depth", "2", "--max-samples", "40", "--turns", "last", "--redis-url", redis_url]
    stored_out = (first_dir / "out").resolve()
    results = stored_out / "code_instruct" / "raw_responses.jsonl"
    first = subprocess.Popen([*args, "--out", "out"], cwd=first_dir, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_as_a_terminal_sends_it)
    try:
        wait_for(lambda: len(read_jsonl(results)) >= 8, 90, "first results on disk")
        first.send_signal(signal.SIGINT)  # Ctrl-C: detach, the run goes on in the workers
        _, err = first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, err
    pool.stop_all()  # nothing moves any more: what a refused rerun writes would show
    made = len(read_jsonl(results))
    assert 8 <= made < 40
    meta = keys.DatasetKeys("code_instruct").meta
    assert r.hget(meta, "out_dir") == str(stored_out).encode()

    dbsize, record, files = r.dbsize(), r.hgetall(meta), _files(tmp_path / "first")
    for cwd, out in ((elsewhere, "out"), (first_dir, "outt")):  # another cwd; a typo
        refused = subprocess.run([*args, "--out", out], cwd=cwd, env=_env(), capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2, refused.stderr
        error = [line for line in refused.stderr.splitlines() if line.startswith("Error:")]
        assert len(error) == 1 and "Traceback" not in refused.stderr
        assert f"writes to {stored_out}" in error[0] and str((cwd / out).resolve()) in error[0]
        assert f"--out {stored_out}" in error[0] and "--new-run" in error[0]
        assert r.dbsize() == dbsize and r.hgetall(meta) == record
        assert not (cwd / out).exists()
        assert _files(tmp_path / "first") == files

    # The stored --out, given absolute from the other directory, resumes: nothing made is made again.
    pool.start("w1")
    again = subprocess.run([*args, "--out", str(stored_out)], cwd=elsewhere, env=_env(), capture_output=True,
                           text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    assert "complete" in again.stdout
    recs = check_exact(r, stored_out, "code_instruct")
    assert len(recs) == 40
    assert sim_stats(sim.url)["completed"] == 40
    assert not (elsewhere / "out").exists()


def _cli(args: list[str], redis_url: str) -> Any:
    from click.testing import CliRunner

    from producer.cli import main
    return CliRunner().invoke(main, [*args, "--redis-url", redis_url], catch_exceptions=False)


def test_a_rerun_keeps_a_budget_set_since_unless_it_gives_another(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                                   tokenizer_dir: Path) -> None:
    """The --budget on the command line is what the last run set: rerunning the same command after ``produce
    budget`` keeps the live budget (one line says so); another --budget wins (one line too); none keeps it."""
    data = tmp_path / "ds.jsonl"
    data.write_text('{"id": 1, "prompt": "hello"}\n{"id": 2, "prompt": "hi"}\n')
    run = ["run", str(data), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--detach", "--out",
           str(tmp_path / "out")]
    meta = keys.DatasetKeys("ds").meta

    def rerun(*budget: str) -> list[str]:
        res = _cli([*run, *budget], redis_url)
        assert res.exit_code == 0, res.output
        return [line for line in res.output.splitlines() if line.startswith("ds: ") and "budget" in line]

    assert rerun("--budget", "80k") == [] and r.hget(meta, "budget") == b"80000"
    assert _cli(["budget", "ds", "60k"], redis_url).exit_code == 0
    said = rerun("--budget", "80k")  # the same command again
    assert r.hget(meta, "budget") == b"60000"
    assert len(said) == 1 and "keeps its budget 60,000" in said[0] and "--budget 80,000" in said[0], said
    assert rerun() == [] and r.hget(meta, "budget") == b"60000"  # no --budget: the live one
    said = rerun("--budget", "70k")  # another one wins
    assert r.hget(meta, "budget") == b"70000"
    assert said == ["ds: budget 60,000 -> 70,000 (--budget)"], said
    assert rerun("--budget", "70k") == [] and r.hget(meta, "budget") == b"70000"


def test_budget_unlimited_on_run_is_explicitly_no_budget(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                         tokenizer_dir: Path) -> None:
    """``--budget unlimited`` (and NAME=unlimited), as ``produce budget`` takes it: no budget, which replaces a
    stored one, where no --budget keeps it."""
    data = tmp_path / "ds.jsonl"
    data.write_text('{"id": 1, "prompt": "hello"}\n{"id": 2, "prompt": "hi"}\n')
    run = ["run", str(data), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--detach", "--out",
           str(tmp_path / "out")]
    meta = keys.DatasetKeys("ds").meta
    plan = _cli([*run[:-3], "--dry-run", "--budget", "ds=unlimited"], redis_url)
    assert plan.exit_code == 0, plan.output
    assert "unlimited" in next(line for line in plan.output.splitlines() if line.startswith("ds "))
    assert _cli([*run, "--budget", "5k"], redis_url).exit_code == 0 and r.hget(meta, "budget") == b"5000"
    res = _cli([*run, "--budget", "Unlimited"], redis_url)
    assert res.exit_code == 0, res.output
    assert r.hget(meta, "budget") == b"" and "ds: budget 5,000 -> unlimited (--budget)" in res.output
    assert _cli([*run, "--budget", "ds=3k"], redis_url).exit_code == 0 and r.hget(meta, "budget") == b"3000"
    assert _cli([*run, "--budget", "ds=unlimited"], redis_url).exit_code == 0 and r.hget(meta, "budget") == b""
    assert _cli(run, redis_url).exit_code == 0 and r.hget(meta, "budget") == b""


def test_the_lock_refusal_names_the_host_and_pid_holding_the_dataset(tmp_path: Path, redis_url: str,
                                                                      r: "redis.Redis", tokenizer_dir: Path) -> None:
    from budget.runstate import RunState
    data = tmp_path / "ds.jsonl"
    data.write_text('{"id": 1, "prompt": "hello"}\n')
    # A produce on another host (its pid cannot be checked from here) holds the dataset.
    assert RunState(r).take_collector("ds", "gpu-node-7:4242:0123abcd", 30_000)
    res = _cli(["run", str(data), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--detach", "--out",
                str(tmp_path / "out")], redis_url)
    assert res.exit_code == 1, res.output
    assert "another produce is attached to it (produce pid 4242 on gpu-node-7 holds" in res.output, res.output
    assert r.get(keys.DatasetKeys("ds").collector) == b"gpu-node-7:4242:0123abcd"  # read, never changed
