"""A mix in Redis (docs/mix.md): refused before anything is written when it does not match the run, each member's
budget its share, a change made with ``produce budget --mix`` kept by a rerun of the same command, and weights that
close a member past its new share."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from budget import keys
from budget.ledger import Ledger, Mix, MixStore
from producer.cli import main
from tests.demo_data import CODE, GLAIVE
from tests.procs import run_keys

W = {"code_instruct": Fraction(1), "glaive_fc": Fraction(3)}


def run(args: list[str], redis_url: str) -> Any:
    return CliRunner().invoke(main, [*args, "--redis-url", redis_url], catch_exceptions=False)


@pytest.mark.parametrize("extra, reason", [
    (["--budget", "40k", "--mix", "code_instruct=1"], "--mix gives no weight to glaive_fc"),
    (["--budget", "40k", "--mix", "code_instruct=1,glaive_fc=1,traces=2"], "--mix names unknown dataset(s) traces"),
    (["--mix", "code_instruct=1,glaive_fc=1"], "--mix needs the total it shares: --budget AMOUNT"),
    (["--budget", "unlimited", "--mix", "code_instruct=1,glaive_fc=1"], "--mix needs the total"),
    (["--budget", "code_instruct=4k", "--mix", "code_instruct=1,glaive_fc=1"], "with --mix a dataset's budget is"),
    (["--budget", "40k", "--mix", "code_instruct=0,glaive_fc=1"], "a weight of 0"),
])
def test_a_mix_that_does_not_match_the_run_is_refused_before_anything_is_written(
        tmp_path: Path, redis_url: str, r: "redis.Redis", tokenizer_dir: Path, extra: list[str], reason: str) -> None:
    r.set("someone-elses-key", "x")
    before = run_keys(r)
    out = tmp_path / "out"
    res = run([str(CODE), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "100", "--turns", "last",
               "--out", str(out), *extra], redis_url)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and reason in errors[0], res.output
    assert run_keys(r) == before and not out.exists()


def test_a_detached_run_sets_each_members_budget_to_its_share(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                               tokenizer_dir: Path) -> None:
    res = run([str(CODE), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "100", "--turns", "last",
               "--out", str(tmp_path / "out"), "--budget", "40k", "--mix", "code_instruct=1,glaive_fc=3",
               "--detach"], redis_url)
    assert res.exit_code == 0, res.output
    budgets = {n: int(r.hget(keys.DatasetKeys(n).meta, "budget") or 0) for n in W}
    assert budgets == {"code_instruct": 10_000, "glaive_fc": 30_000}
    assert {r.hget(keys.DatasetKeys(n).meta, "mix") for n in W} == {b"code_instruct,glaive_fc"}
    assert MixStore(r).load("code_instruct,glaive_fc") == Mix(40_000, W)


def test_a_rerun_giving_the_same_mix_keeps_a_change_made_since(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                               tokenizer_dir: Path) -> None:
    args = [str(CODE), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "100", "--turns", "last",
            "--out", str(tmp_path / "out"), "--budget", "40k", "--mix", "code_instruct=1,glaive_fc=3", "--detach"]
    assert run(args, redis_url).exit_code == 0
    changed = run(["budget", "--mix", "code_instruct=1,glaive_fc=1", "--total", "20k"], redis_url)
    assert changed.exit_code == 0, changed.output
    assert "code_instruct: budget 10,000" in changed.output and "glaive_fc: budget 10,000" in changed.output
    again = run(args, redis_url)
    assert again.exit_code == 0, again.output
    assert "keeps the mix of 2: total 20,000" in again.output
    assert {n: r.hget(keys.DatasetKeys(n).meta, "budget") for n in W} == {"code_instruct": b"10000",
                                                                        "glaive_fc": b"10000"}
    other = run([*args[:-3], "--mix", "code_instruct=1,glaive_fc=4", "--detach"], redis_url)  # another mix wins
    assert other.exit_code == 0 and "mix changed" in other.output
    assert r.hget(keys.DatasetKeys("glaive_fc").meta, "budget") == b"32000"


def test_changing_weights_closes_a_member_past_its_new_share(r: "redis.Redis", redis_url: str) -> None:
    ledger, store = Ledger(r), MixStore(r)
    mix = Mix(10_000, W)
    for name in W:
        ledger.set_mode(name, "predict", 100)
    store.save(mix, given=mix.given())
    store.apply(ledger, mix)
    assert ledger.commit("code_instruct", "s1", 2_000, {}).committed  # 2,000 of its 2,500
    res = run(["budget", "--mix", "code_instruct=1,glaive_fc=9"], redis_url)  # its share drops to 1,000
    assert res.exit_code == 0, res.output
    assert ledger.state("code_instruct").status == "closed" and ledger.state("code_instruct").used == 2_000
    assert ledger.state("glaive_fc").budget == 9_000 and ledger.state("glaive_fc").status == "open"
    # One dataset's own budget cannot be set under a mix: its share would be overwritten at the next apply.
    r.hset(keys.DatasetKeys("glaive_fc").meta, "name", "glaive_fc")
    refused = run(["budget", "glaive_fc", "50k"], redis_url)
    assert refused.exit_code == 2 and "is in the mix of code_instruct, glaive_fc" in refused.output
    unknown = run(["budget", "--mix", "code_instruct=1,other=1"], redis_url)
    assert unknown.exit_code == 2 and "no mix of exactly code_instruct, other" in unknown.output


def test_the_dry_run_plans_each_share_and_who_runs_dry(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                       tokenizer_dir: Path) -> None:
    small = tmp_path / "small.jsonl"
    small.write_text("".join(CODE.read_text().splitlines(keepends=True)[:12]))
    args = [str(CODE), str(GLAIVE), str(small), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300",
            "--turns", "last", "--out", str(tmp_path / "out"), "--budget", "12k", "--mix",
            "code_instruct=1,glaive_fc=1,small=2", "--dry-run", "--expect-mean", "100", "--throughput", "50"]
    before = run_keys(r)
    res = run([*args, "--json"], redis_url)
    assert res.exit_code == 0, res.output
    import json
    doc = json.loads(res.stdout)
    # small makes at most 12 x 100 = 1,200 of its 6,000: the other 10,800 go 1:1.
    assert doc["mix"]["shares"] == {"code_instruct": 5_400, "glaive_fc": 5_400, "small": 1_200}
    assert doc["mix"]["runs_dry"] == ["small"] and doc["mix"]["total"] == 12_000
    plans = {d["name"]: d for d in doc["datasets"]}
    assert plans["code_instruct"]["budget"] == 5_400 and plans["code_instruct"]["samples_needed"] == 54
    assert plans["small"]["samples_needed"] == 12
    table = run(args, redis_url)
    assert table.exit_code == 0 and "small=2 (1,200, runs dry)" in table.output, table.output
    assert run_keys(r) == before
