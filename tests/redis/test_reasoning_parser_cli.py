"""`produce run --reasoning-parser`: detection from the tokenizer, refusal when ambiguous, storage in run.json,
the manifest and each chunk, and another parser on a rerun refused as a settings change.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from budget import keys
from producer.cli import main
from producer.prepare import resolve_parser
from producer.settings import AmbiguousParser, Evidence, detect, mismatches
from render.chat import Renderer, load_tokenizer
from tests.demo_data import TRACES
from tests.exactly_once import check_exact
from tests.families import FAMILIES, build_family_tokenizer
from tests.procs import produce
from tests.replies import raw, texts


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_detected(tmp_path: Path, family: str) -> None:
    tok = load_tokenizer(build_family_tokenizer(tmp_path / family, family))
    assert resolve_parser("auto", tok, Renderer(tok)) == family


def test_think_alone_or_two_families_is_ambiguous() -> None:
    with pytest.raises(AmbiguousParser, match=r"candidates: qwen3, qwen3-thinking, deepseek-r1"):
        detect(Evidence("{{ '<think>' }}...</think>", frozenset(), opens_think=True))
    with pytest.raises(AmbiguousParser, match=r"candidates: gpt-oss, glm45"):
        detect(Evidence("<|channel|> <arg_key>", frozenset(), opens_think=False))


def _two_families(tmp_path: Path) -> Path:
    """GLM-4.5's tokenizer whose template also mentions harmony's <|channel|>: two families' markers."""
    tok_dir = build_family_tokenizer(tmp_path / "mixed", "glm45")
    config_path = tok_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] += "{#- <|channel|> #}"
    config_path.write_text(json.dumps(config))
    return tok_dir


def test_ambiguous_is_refused_with_exit_2_and_a_choice_runs(tmp_path: Path) -> None:
    tok_dir = _two_families(tmp_path)
    args = ["run", str(TRACES), "--tokenizer", str(tok_dir), "--max-tokens", "64", "--max-samples", "3",
            "--dry-run", "--json", "--out", str(tmp_path / "out")]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 2, refused.output
    assert "candidates: gpt-oss, glm45" in refused.output and "--reasoning-parser" in refused.output
    chosen = CliRunner().invoke(main, [*args, "--reasoning-parser", "glm45"])
    assert chosen.exit_code == 0, chosen.output


def test_server_launched_with_another_parser_is_warned_about() -> None:
    servers = [{"url": "http://127.0.0.1:1", "reasoning_parser": "qwen3"}, {"url": "http://127.0.0.1:2"},
               {"url": "http://127.0.0.1:3", "reasoning_parser": "glm45"}]
    assert mismatches("glm45", servers) == [
        "server http://127.0.0.1:1 was launched with --reasoning-parser qwen3, this run parses with glm45: check "
        "that the run names the model's family"]
    assert mismatches("glm45", None) == []


def _queued_payloads(r: "redis.Redis") -> list[dict[str, Any]]:
    out = []
    for job_id in texts(r.lrange(keys.RQ_QUEUE, 0, -1)):
        data = raw(r.hget(f"rq:job:{job_id}", "data"))
        out.append(json.loads(zlib.decompress(data))[2][0])  # RQ's (func, instance, args, kwargs): args[0]
    return out


@pytest.mark.e2e
def test_stored_in_run_json_chunks_and_records_and_another_parser_is_a_settings_change(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    out = tmp_path / "out"
    base = [str(TRACES), "--tokenizer", str(tokenizer_dir), "--max-tokens", "200", "--out", str(out)]
    # Detached and no worker yet: the chunks stay queued, so their payloads can be read.
    res = produce([*base, "--max-samples", "4", "--detach"], redis_url)
    assert res.returncode == 0, res.stderr
    assert "reasoning parser: qwen3-thinking (detected from the tokenizer)" in res.stderr
    run_json = out / "agent_traces" / "run.json"
    assert json.loads(run_json.read_text())["reasoning_parser"] == "qwen3-thinking"
    assert {p.get("reasoning_parser") for p in _queued_payloads(r)} == {"qwen3-thinking"}

    sim = sim_factory("--time-scale", "50", "--mean-tokens", "60", "--max-running", "64")
    workers(sim.url).start("w0")
    res = produce([*base, "--max-samples", "4"], redis_url)
    assert res.returncode == 0, res.stderr
    recs = check_exact(r, out, "agent_traces")
    assert len(recs) == 4
    assert all(x["reasoning_parser"] == "qwen3-thinking" and "reasoning_unclosed" in x["turns"][0]
               and x["turns"][0]["tool_calls"] == [] for x in recs)
    manifest = json.loads((out / "agent_traces" / "manifest.json").read_text())
    assert manifest["reasoning_parser"] == "qwen3-thinking"

    named = produce([*base, "--max-samples", "8", "--reasoning-parser", "qwen3"], redis_url)
    assert named.returncode == 2, named.stderr
    assert "reasoning_parser: stored 'qwen3-thinking', now 'qwen3'" in named.stderr
    res = produce([*base, "--max-samples", "8"], redis_url)  # auto detects the stored parser again: resumes
    assert res.returncode == 0, res.stderr
    recs = check_exact(r, out, "agent_traces")
    assert len(recs) == 8 and all(x["reasoning_parser"] == "qwen3-thinking" for x in recs)
