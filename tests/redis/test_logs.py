"""Logs: one line per event, text or JSON (BUDGETQ_LOG_FORMAT / --log-format), levels, --verbose and --quiet.

The formatter (budget/runtime.py) is checked on records; the worker as ``rq worker`` runs it (every line of its
output one JSON object: budgetq's, rq's own, the server-info reporter's with its fields); ``produce`` as a user
runs it, JSON with debug lines, then text again with --quiet and --verbose on the finished run.
"""
from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from budget import runtime
from producer.cli import main
from sglang_sim.responses import VERSION
from tests.demo_data import GLAIVE
from tests.procs import produce

TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def record(msg: str, *args: Any, level: int = logging.INFO, exc: bool = False, **extra: Any) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise RuntimeError("boom at redis://bq:hunter2@db:6379/0")
        except RuntimeError:
            exc_info = sys.exc_info()
    rec = logging.LogRecord("budgetq.test", level, __file__, 1, msg, args, exc_info)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_hold_ts_level_logger_msg_and_the_extra_fields() -> None:
    line = runtime.JsonFormatter().format(record("%s: %d samples", "ds", 3, dataset="ds", samples=[1, 2],
                                              path=Path("/tmp/x")))
    assert "\n" not in line
    event = json.loads(line)
    assert TS.fullmatch(event.pop("ts"))
    assert event == {"level": "info", "logger": "budgetq.test", "msg": "ds: 3 samples", "dataset": "ds",
                     "samples": [1, 2], "path": "/tmp/x"}
    failed = json.loads(runtime.JsonFormatter().format(record("failed", level=logging.ERROR, exc=True)))
    assert failed["level"] == "error" and "Traceback" in failed["exc"] and "RuntimeError: boom" in failed["exc"]


def test_url_passwords_are_masked_in_every_format() -> None:
    rec = record("cannot reach Redis at %s", "rediss://budgetq:s3cr%2Ft@redis.internal:6379/0", exc=True,
                 url="redis://:hunter2@h:1/0")
    for formatter in (runtime.JsonFormatter(), runtime.TextFormatter("%(message)s"), runtime.PlainFormatter()):
        text = formatter.format(rec)
        assert "s3cr" not in text and "hunter2" not in text, text
        assert "rediss://budgetq:***@redis.internal:6379/0" in text
    assert runtime.redact("http://10.0.0.5:30000/a@b and http://h:30000") == "http://10.0.0.5:30000/a@b and http://h:30000"


def test_plain_text_is_the_message_and_debug_lines_say_so() -> None:
    assert runtime.PlainFormatter().format(record("ds: 3 samples ready")) == "ds: 3 samples ready"
    assert runtime.PlainFormatter().format(record("connected", level=logging.DEBUG)) == "debug: connected"


def test_cli_log_options(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["x.jsonl", "--tokenizer", "t", "--max-tokens", "5", "-v", "-q"])
    assert res.exit_code == 2 and "--verbose and --quiet exclude each other" in res.output
    res = runner.invoke(main, ["x.jsonl", "--tokenizer", "t", "--max-tokens", "5", "--log-format", "xml"])
    assert res.exit_code == 2 and "xml" in res.output
    # An error is a JSON line too while JSON is on; exit code unchanged.
    res = runner.invoke(main, [str(tmp_path / "missing.jsonl"), "--tokenizer", "t", "--max-tokens", "5",
                               "--log-format", "json"])
    assert res.exit_code == 2
    event = json.loads(res.stderr.strip().splitlines()[-1])
    assert event["level"] == "error" and event["exit_code"] == 2 and "missing.jsonl" in event["msg"]
    # ... and plain again for the next command in the same process.
    res = runner.invoke(main, ["export", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 2 and res.stderr.startswith("Error: ")


def parse_lines(text: str, where: str) -> list[dict[str, Any]]:
    events = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            raise AssertionError(f"{where}:{n} is not JSON: {line!r}") from None
        assert isinstance(event, dict) and {"ts", "level", "logger", "msg"} <= set(event), (where, n, line)
        assert TS.fullmatch(event["ts"]) and event["level"] in ("debug", "info", "warning", "error"), line
        events.append(event)
    return events


@pytest.mark.e2e
def test_worker_and_produce_log_json_lines(redis_url: str, tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
                                           workers: Any) -> None:
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "100", "--seed", "41")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="8", BUDGETQ_LOG_FORMAT="json")
    pool.start("w0")
    out = tmp_path / "out"
    args = [str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "200", "--max-samples", "16",
            "--chunk-size", "8", "--out", str(out)]
    res = produce([*args, "-v", "--log-format", "json"], redis_url)
    assert res.returncode == 0, res.stderr
    pool.stop_all()
    assert pool.procs[0].returncode == 0

    events = parse_lines(pool.log("w0"), "worker log")
    by_logger: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_logger.setdefault(e["logger"], []).append(e)
    assert any(e["msg"].startswith("budgetq worker: 1 server(s)") for e in by_logger["budgetq.worker"])
    assert any("bq-glaive_fc-0000001" in e["msg"] for e in by_logger["rq.worker"]), "rq's own lines are JSON too"
    reported = by_logger["budgetq.worker.serverinfo"]
    assert [(e["server"], e["version"], e["level"]) for e in reported] == [(sim.url, VERSION, "info")]

    produced = parse_lines(res.stderr, "produce stderr")
    assert {e["logger"] for e in produced} == {"budgetq.produce"}
    assert any(e["level"] == "debug" and e["msg"] == f"connected to Redis at {redis_url}" for e in produced)
    assert any(e["level"] == "info" and e["msg"].startswith("glaive_fc: 16 samples ready") for e in produced)
    manifest = [e for e in produced if e.get("manifest")]
    assert [(e["dataset"], e["servers"]) for e in manifest] == [("glaive_fc", 1)]
    assert "complete" in res.stdout and not res.stdout.startswith("{"), "the summary stays a table on stdout"

    # The finished run again: --quiet prints nothing but the summary; -v in text marks its debug lines.
    quiet = produce([*args, "--quiet"], redis_url)
    assert quiet.returncode == 0 and quiet.stderr == "" and "complete" in quiet.stdout
    verbose = produce([*args, "--verbose"], redis_url)
    assert verbose.returncode == 0, verbose.stderr
    lines = verbose.stderr.splitlines()
    assert f"debug: connected to Redis at {redis_url}" in lines
    assert any(line.startswith("glaive_fc: 16 samples ready") for line in lines)
    assert not any(line.startswith("{") for line in lines)
    plain = produce(args, redis_url)
    assert plain.returncode == 0 and "samples ready" in plain.stderr and "debug:" not in plain.stderr


@pytest.mark.e2e
def test_a_worker_refuses_an_unknown_log_format(redis_url: str, workers: Any, sim_factory: Any) -> None:
    pool = workers("http://127.0.0.1:9", BUDGETQ_LOG_FORMAT="xml")
    proc = pool.start("w0")
    assert proc.wait(60) != 0
    assert "BUDGETQ_LOG_FORMAT='xml'" in pool.log("w0")
