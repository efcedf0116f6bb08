"""``produce export`` as its command line: where it reads Redis from, what it says of a dataset still running, and
which tokenizer it uses (issue 29). The export itself is tests/test_export.py's."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from budget import keys
from budget.ledger import Ledger
from budget.runstate import RunState
from producer.cli import main
from render.chat import load_tokenizer
from tests.test_export import standard_records, write_dataset


@pytest.fixture(scope="session")
def tok(tokenizer_dir: Path) -> Any:
    return load_tokenizer(tokenizer_dir)


@pytest.fixture
def ds(tmp_path: Path, tok: Any) -> Path:
    return write_dataset(tmp_path, tok, standard_records(tok, 2))


def export(ds: Path, *args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, ["export", ds.name, "--out", str(ds.parent), *args],
                              env={"REDIS_URL": None, **(env or {})}, catch_exceptions=False)


def manifest(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_export_reads_redis_url_like_every_command(ds: Path, r: redis.Redis, redis_url: str) -> None:
    Ledger(r).set_budget(ds.name, 1234)
    res = export(ds, env={"REDIS_URL": redis_url})
    assert res.exit_code == 0, res.output
    assert manifest(ds / "manifest.json")["extra"]["budget"] == 1234
    (ds / "manifest.json").unlink()
    res = export(ds)  # neither --redis-url nor REDIS_URL: no Redis is read
    assert res.exit_code == 0, res.output
    assert "extra" not in manifest(ds / "manifest.json")


def start_running(r: redis.Redis, name: str) -> None:
    """Redis as a run leaves it mid-way: the dataset open, one chunk queued, 200 samples selected."""
    assert Ledger(r).set_budget(name, 100_000) == "open"
    state = RunState(r)
    with r.pipeline(transaction=True) as pipe:
        state.hold(pipe, name, state.next_chunk_ids(name, 1), {"s1": "c1"})
        pipe.execute()
    state.set_progress(name, selected=200, todo=150)


def test_exporting_a_running_dataset_warns_and_leaves_the_runs_manifest(ds: Path, tmp_path: Path, r: redis.Redis,
                                                                        redis_url: str) -> None:
    run_manifest = ds / "manifest.json"
    run_manifest.write_text('{"dataset": "ds", "written": "at the run\'s end"}\n', encoding="utf-8")
    start_running(r, ds.name)
    dest = tmp_path / "train" / "b1.jsonl"
    res = export(ds, "--dest", str(dest), "--redis-url", redis_url)
    assert res.exit_code == 0, res.output
    [warning] = [line for line in res.output.splitlines() if "still running" in line]
    assert f"{ds.name} is still running (0/200 samples done)" in warning
    assert run_manifest.read_text(encoding="utf-8") == '{"dataset": "ds", "written": "at the run\'s end"}\n'
    beside = tmp_path / "train" / "b1.manifest.json"
    written = manifest(beside)
    assert written["running"] is True and written["extra"]["status"] == "open"
    assert written["counts"]["samples"] == len(standard_records_v2(ds))
    assert res.stdout.rstrip().endswith(f"manifest {beside}")
    Ledger(r).close(ds.name)  # the run ended: the export refreshes the run's manifest again, with no warning
    r.delete(keys.DatasetKeys(ds.name).chunks)
    res = export(ds, "--dest", str(dest), "--redis-url", redis_url)
    assert res.exit_code == 0 and "still running" not in res.output, res.output
    assert "running" not in manifest(run_manifest) and manifest(run_manifest)["counts"]["samples"] > 0


def standard_records_v2(ds: Path) -> list[str]:
    return (ds / "raw_responses.jsonl").read_text(encoding="utf-8").splitlines()


def test_summary_calls_conversations_that_ended_early_incomplete_not_truncated(tmp_path: Path, tok: Any) -> None:
    recs = standard_records(tok, 2)  # two of them truncated: g-cut-thinking, h-cut-answer
    recs[0].update(incomplete=True, stopped_by="tool_mismatch")
    recs[1].update(incomplete=True, stopped_by="budget")
    recs[2].update(incomplete=True, stopped_by="tool_mismatch")
    ds = write_dataset(tmp_path, tok, recs)
    res = export(ds)
    assert res.exit_code == 0, res.output
    assert ("(2 truncated dropped, 3 incomplete dropped (budget 1, tool_mismatch 2), 0 failed skipped)"
            in res.stdout), res.stdout
