"""Bad input, bad budgets, missing files: a clear message naming file and line, exit 2, Redis untouched."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from budget import keys
from budget.record import OTHER_VERSION, VERSION
from producer.cli import main
from tests.procs import produce_cmd

GOOD = '{"id": 1, "prompt": "hello"}\n{"id": 2, "messages": [{"role": "user", "content": "hi"}]}\n'


@pytest.fixture
def seeded(r: "redis.Redis") -> "redis.Redis":
    r.set("someone-elses-key", "x")  # a database that is not empty: exit 2 must leave it exactly so
    return r


def run(args: list[str], redis_url: str) -> Any:
    return CliRunner().invoke(main, [*args, "--redis-url", redis_url], catch_exceptions=False)


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("bad_line, reason", [
    ("{not json", "not valid JSON"),
    ('{"id": 3}', 'no "messages", "prompt" or "conversations"'),
    ('{"prompt": ""}', "prompt"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role"),
    ('[1, 2]', "not a JSON object"),
])
def test_bad_line_is_refused_with_file_and_line(tmp_path: Path, redis_url: str, seeded: Any, tokenizer_dir: Path,
                                                bad_line: str, reason: str) -> None:
    path = write(tmp_path, "ds.jsonl", GOOD + bad_line + "\n")
    res = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10"], redis_url)
    assert res.exit_code == 2
    assert f"{path}:3:" in res.output and reason in res.output
    assert "Traceback" not in res.output
    assert seeded.dbsize() == 1


def test_skip_invalid_skips_and_reports(tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    path = write(tmp_path, "ds.jsonl", GOOD + "{oops\n")
    res = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--skip-invalid",
               "--detach", "--out", str(tmp_path / "out")], redis_url)
    assert res.exit_code == 0, res.output
    assert f"skipped {path}:3:" in res.output


@pytest.mark.parametrize("budget", ["-1", "0.5", "NaN", "abc", "9223372036854775808", "1e6", "ds=", "nope=5"])
def test_bad_budget_exit_2(tmp_path: Path, redis_url: str, seeded: Any, tokenizer_dir: Path, budget: str) -> None:
    path = write(tmp_path, "ds.jsonl", GOOD)
    res = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--budget", budget], redis_url)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert seeded.dbsize() == 1


@pytest.mark.parametrize("arg, message", [
    ("missing.jsonl", "not found"),
    ("bad.name=ds.jsonl", "bad.name"),
    ("a:b=ds.jsonl", "a:b"),
])
def test_bad_file_arguments(tmp_path: Path, redis_url: str, seeded: Any, tokenizer_dir: Path, arg: str,
                            message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, "ds.jsonl", GOOD)
    monkeypatch.chdir(tmp_path)
    res = run([arg, "--tokenizer", str(tokenizer_dir), "--max-tokens", "10"], redis_url)
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert seeded.dbsize() == 1


def test_two_files_with_one_name(tmp_path: Path, redis_url: str, seeded: Any, tokenizer_dir: Path) -> None:
    a = write(tmp_path, "ds.jsonl", GOOD)
    (tmp_path / "b").mkdir()
    b = write(tmp_path / "b", "ds.jsonl", GOOD)
    res = run([str(a), str(b), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10"], redis_url)
    assert res.exit_code == 2
    assert seeded.dbsize() == 1


def test_max_tokens_is_required(tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    path = write(tmp_path, "ds.jsonl", GOOD)
    res = run([str(path), "--tokenizer", str(tokenizer_dir)], redis_url)
    assert res.exit_code == 2
    assert "--max-tokens" in res.output


def test_over_context_prompts_are_skipped_not_sent(tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    long_prompt = "word " * 400
    path = write(tmp_path, "ds.jsonl", GOOD + '{"id": "long", "prompt": "%s"}\n' % long_prompt)
    res = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "100", "--max-context", "300",
               "--detach", "--out", str(tmp_path / "out")], redis_url)
    assert res.exit_code == 0, res.output
    assert f"{path}:3: prompt of" in res.output
    assert "2 samples ready" in res.output


def test_settings_change_refused_without_new_run(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                 tokenizer_dir: Path) -> None:
    path = write(tmp_path, "ds.jsonl", GOOD)
    out = str(tmp_path / "out")
    first = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--detach", "--out", out],
                redis_url)
    assert first.exit_code == 0, first.output
    size = r.dbsize()
    again = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "20", "--detach", "--out", out],
                redis_url)
    assert again.exit_code == 2
    assert "max_new_tokens: stored 10, now 20" in again.output and "--new-run" in again.output
    assert r.dbsize() == size
    fresh = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "20", "--detach", "--out", out,
                 "--new-run"], redis_url)
    assert fresh.exit_code == 0, fresh.output


@pytest.mark.parametrize("where", ["run.json", "redis"])
def test_a_run_of_another_version_is_refused_and_left_untouched(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                                tokenizer_dir: Path, where: str) -> None:
    path = write(tmp_path, "ds.jsonl", GOOD)
    out = tmp_path / "out"
    args = [str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--detach", "--out", str(out)]
    first = run(args, redis_url)
    assert first.exit_code == 0, first.output
    run_json, meta = out / "ds" / "run.json", keys.DatasetKeys("ds").meta
    settings = json.loads(run_json.read_text())
    assert settings["version"] == VERSION
    if where == "run.json":  # a run.json without the key, and nothing in Redis
        r.flushall()
        run_json.write_text(json.dumps({k: v for k, v in settings.items() if k != "version"}))
    else:  # the run in Redis made by another version
        r.hset(meta, "settings", json.dumps({**settings, "version": VERSION - 1}, sort_keys=True))
    before = (r.dbsize(), r.hgetall(meta), run_json.read_bytes())
    again = run(args, redis_url)
    assert again.exit_code == 2, again.output
    assert f"dataset ds: the stored run was {OTHER_VERSION}" in again.output
    assert (r.dbsize(), r.hgetall(meta), run_json.read_bytes()) == before
    fresh = run([*args, "--new-run"], redis_url)
    assert fresh.exit_code == 0, fresh.output
    assert json.loads(run_json.read_text())["version"] == VERSION


def test_a_record_of_another_version_is_refused_and_left_untouched(tmp_path: Path, redis_url: str,
                                                                   r: "redis.Redis", tokenizer_dir: Path) -> None:
    """A flat record (record version 1, no ``record_version``) on file: neither produce nor export reads it."""
    path = write(tmp_path, "ds.jsonl", GOOD)
    out = tmp_path / "out"
    args = [str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--detach", "--out", str(out)]
    first = run(args, redis_url)
    assert first.exit_code == 0, first.output
    results, meta = out / "ds" / "raw_responses.jsonl", keys.DatasetKeys("ds").meta
    results.write_text(json.dumps({"id": "a", "dataset": "ds", "messages": [], "response": "x", "content": "x",
                                   "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 1}) + "\n")
    before = (r.dbsize(), r.hgetall(meta), (out / "ds" / "run.json").read_bytes(), results.read_bytes())
    again = run(args, redis_url)
    assert again.exit_code == 2, again.output
    assert f"{results}:1: a record of record_version None, {OTHER_VERSION}" in again.output
    assert (r.dbsize(), r.hgetall(meta), (out / "ds" / "run.json").read_bytes(), results.read_bytes()) == before
    export = run(["export", "ds", "--out", str(out)], redis_url)
    assert export.exit_code == 2 and OTHER_VERSION in export.output, export.output
    fresh = run([*args, "--new-run"], redis_url)
    assert fresh.exit_code == 0, fresh.output


def test_budget_zero_sends_nothing(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                   tokenizer_dir: Path) -> None:
    path = write(tmp_path, "ds.jsonl", GOOD)
    res = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--budget", "0",
               "--out", str(tmp_path / "out")], redis_url)
    assert res.exit_code == 0, res.output
    assert r.llen("rq:queue:budgetq") == 0
    assert "budget reached" in res.output


def test_redis_unreachable_is_exit_1_without_traceback(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = write(tmp_path, "ds.jsonl", GOOD)
    res = subprocess.run([*produce_cmd(), str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10",
                          "--redis-url", "redis://:s3cret@127.0.0.1:1/0"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1
    assert "cannot reach Redis" in res.stderr and "Traceback" not in res.stderr
    assert "s3cret" not in res.stderr  # secrets never reach a log


def test_an_output_folder_that_cannot_be_written_is_refused_before_redis(tmp_path: Path, redis_url: str,
                                                                         seeded: Any, tokenizer_dir: Path) -> None:
    # Root writes anywhere, so the folder is made impossible rather than forbidden: a file stands in its place.
    path = write(tmp_path, "ds.jsonl", GOOD)
    (tmp_path / "out").mkdir()
    blocked = write(tmp_path / "out", "ds", "a file where the dataset's folder goes")
    res = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--out", str(tmp_path / "out")],
              redis_url)
    assert res.exit_code == 2, res.output
    assert f"cannot write {blocked}" in res.output and "Traceback" not in res.output
    assert seeded.dbsize() == 1  # nothing registered, no collector lock taken


def test_a_dataset_failing_midway_through_attach_leaves_no_collector_lock(tmp_path: Path, redis_url: str,
                                                                          r: "redis.Redis",
                                                                          tokenizer_dir: Path) -> None:
    # The second dataset's results file is a folder: its attach fails after both locks were taken. A lock left
    # behind would refuse a rerun from another host for its 30 s TTL.
    from budget.runstate import RunState
    a, b = write(tmp_path, "a.jsonl", GOOD), write(tmp_path, "b.jsonl", GOOD)
    (tmp_path / "out" / "b" / "raw_responses.jsonl").mkdir(parents=True)
    res = CliRunner().invoke(main, [str(a), str(b), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10",
                                    "--out", str(tmp_path / "out"), "--redis-url", redis_url])
    assert res.exit_code != 0
    store = RunState(r)
    assert not r.exists(store.collector_key("a")) and not r.exists(store.collector_key("b"))


@pytest.mark.parametrize("sglang_url, message", [
    ("sglang:30000", "--pilot: SGLANG_URL: 'sglang:30000' is not an http(s) URL"),
    (" , ", "--pilot: SGLANG_URL is empty"),
])
def test_pilot_refuses_an_sglang_url_that_is_not_http_before_reading_anything(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sglang_url: str, message: str) -> None:
    # The same parser as the workers' (budget/urls.py): a URL without its scheme is exit 2 before any file is read.
    monkeypatch.setenv("SGLANG_URL", sglang_url)
    res = CliRunner().invoke(main, [str(tmp_path / "missing.jsonl"), "--tokenizer", str(tmp_path / "no-tok"),
                                    "--max-tokens", "10", "--dry-run", "--pilot", "2"])
    assert res.exit_code == 2, res.output
    assert message in res.output and "not found" not in res.output


def _model_dir_with_config(tokenizer_dir: Path, target: Path, positions: int) -> Path:
    """The test tokenizer without model_max_length, beside a config.json stating the context, as real models do."""
    import shutil
    shutil.copytree(tokenizer_dir, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("model_max_length", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    (target / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    return target


@pytest.mark.parametrize("where, source", [
    ("--max-context", "4,096 tokens (--max-context)"),
    ("tokenizer", "32,768 tokens (tokenizer model_max_length)"),
    ("config", "2,048 tokens (config.json max_position_embeddings)"),
])
def test_max_tokens_at_or_above_the_context_is_refused_before_anything_is_written(
        tmp_path: Path, redis_url: str, seeded: Any, tokenizer_dir: Path, where: str, source: str) -> None:
    # Accepted before: one "skipped" line per prompt, then "complete" and exit 0, having sent nothing.
    path = write(tmp_path, "ds.jsonl", GOOD)
    tok = _model_dir_with_config(tokenizer_dir, tmp_path / "model", 2048) if where == "config" else tokenizer_dir
    limit = {"--max-context": 4096, "tokenizer": 32768, "config": 2048}[where]
    extra = ["--max-context", "4096"] if where == "--max-context" else []
    out = tmp_path / "out"
    res = run([str(path), "--tokenizer", str(tok), "--max-tokens", str(limit), *extra, "--out", str(out)],
              redis_url)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"--max-tokens {limit:,} leaves no room" in errors[0] and source in errors[0]
    assert "skipped" not in res.output and "Traceback" not in res.output
    assert seeded.dbsize() == 1 and not out.exists()
    # One below the context is a run (here: a plan).
    fits = run([str(path), "--tokenizer", str(tok), "--max-tokens", str(limit - 100), *extra, "--dry-run"],
               redis_url)
    assert fits.exit_code == 0, fits.output


@pytest.mark.e2e
def test_max_tokens_at_or_above_the_servers_context_is_refused_before_anything_is_written(
        tmp_path: Path, redis_url: str, r: "redis.Redis", tokenizer_dir: Path, sim_factory: Any,
        workers: Any) -> None:
    """The context a worker recorded for its SGLang server (smaller than the tokenizer's) is checked too."""
    from tests.procs import run_keys, wait_for
    sim = sim_factory("--time-scale", "50", "--context-length", "300")
    workers(sim.url).start("w0")
    wait_for(lambda: r.hlen(keys.SERVER_INFO) > 0, 60, "the worker recorded its server")
    path = write(tmp_path, "ds.jsonl", GOOD)
    before = run_keys(r)
    out = tmp_path / "out"
    res = run([str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300", "--out", str(out)], redis_url)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "context of 300 tokens (SGLang server" in errors[0], res.output
    assert run_keys(r) == before and not out.exists()
