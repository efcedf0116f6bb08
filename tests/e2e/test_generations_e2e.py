"""Several generations per prompt (docs/generations.md) end to end: `produce` with real `rq worker`s and the
simulator, checked from the server's side (its request log: what each request was sent) and from the files."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from producer.generations import derived_seed, sample_key
from tests import sim_log
from tests.chats import DS as CHATS
from tests.chats import SIM_ARGS, write_dataset
from tests.demo_data import CODE
from tests.procs import produce, read_jsonl, run_keys

CODE_DS = "code_instruct"


def check_samples(r: "redis.Redis", out: Path, name: str) -> list[dict[str, Any]]:
    """Each (id, generation) once, and the counter equals the file's tokens."""
    recs = read_jsonl(out / name / "raw_responses.jsonl")
    pairs = [(x["id"], x["generation"]) for x in recs]
    assert len(pairs) == len(set(pairs)), f"{name}: a sample twice in the output"
    assert int(r.get(keys.DatasetKeys(name).used) or 0) == sum(x["completion_tokens"] for x in recs)
    assert r.hlen(keys.DatasetKeys(name).done) == len(recs)
    return recs


@pytest.mark.e2e
def test_generations_with_a_temperature_list_and_seeds_on_every_turn(redis_url: str, r: "redis.Redis",
                                                                     tokenizer_dir: Path, tmp_path: Path,
                                                                     sim_factory: Any, workers: Any) -> None:
    """Three conversations (1, 2 and 3 turns) x 2 generations: each generation's every turn was sent its own
    temperature and seed (the server's log), the records say their generation, the manifest counts them."""
    log = tmp_path / "requests.jsonl"
    sim = sim_factory(*SIM_ARGS, "--request-log", str(log))
    workers(sim.url).start("w0")
    out = tmp_path / "out"
    res = produce([str(write_dataset(tmp_path)), "--tokenizer", str(tokenizer_dir), "--max-tokens", "64",
                   "--out", str(out), "--generations", "2", "--temperature", "0.2,0.9", "--seed", "5", "--quiet"],
                  redis_url, timeout=120)
    assert res.returncode == 0, res.stderr
    recs = check_samples(r, out, CHATS)
    assert sorted((x["id"], x["generation"]) for x in recs) == sorted(
        (sid, k) for sid in ("one", "two", "three") for k in (0, 1))
    turns = {"one": 1, "two": 2, "three": 3}
    sent = {x["rid"]: x["sampling_params"] for x in sim_log.load(log)}
    for rec in recs:
        k = rec["generation"]
        want = {"temperature": (0.2, 0.9)[k], "sampling_seed": derived_seed(5, rec["id"], k)}
        assert {p: rec["sampling_params"][p] for p in want} == want
        assert len(rec["turns"]) == turns[rec["id"]]
        for turn in range(turns[rec["id"]]):
            prefix = sim_log.turn_prefix(CHATS, sample_key(rec["id"], k), turn)
            asked = [params for rid, params in sent.items() if rid.startswith(prefix)]
            assert asked and all({p: a[p] for p in want} == want for a in asked), (rec["id"], k, turn)
    manifest = json.loads((out / CHATS / "manifest.json").read_text())
    assert manifest["generations"] == {"0": 3, "1": 3} and manifest["temperatures"] == {"0.2": 3, "0.9": 3}
    export = tmp_path / "export.jsonl"
    res = produce(["export", CHATS, "--out", str(out), "--dest", str(export), "--for", "speculators"],
                  redis_url)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(x) for x in export.read_text().splitlines()]
    assert sorted((x["id"], x["generation"]) for x in rows) == sorted((x["id"], x["generation"]) for x in recs)


@pytest.mark.e2e
def test_raising_generations_extends_the_run_and_lowering_is_refused(redis_url: str, r: "redis.Redis",
                                                                     tokenizer_dir: Path, tmp_path: Path,
                                                                     sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "100", "--seed", "3")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="8")
    pool.start("w0")
    out = tmp_path / "out"
    args = [str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300", "--max-samples", "10",
            "--chunk-size", "4", "--out", str(out), "--turns", "last"]
    res = produce([*args, "--generations", "2"], redis_url)
    assert res.returncode == 0, res.stderr
    first = check_samples(r, out, CODE_DS)
    assert Counter(x["generation"] for x in first) == {0: 10, 1: 10}
    res = produce([*args, "--generations", "3"], redis_url)
    assert res.returncode == 0, res.stderr
    assert "extends the stored run of 2" in res.stdout + res.stderr
    recs = check_samples(r, out, CODE_DS)
    assert recs[:20] == first  # nothing made is made again
    assert Counter(x["generation"] for x in recs) == {0: 10, 1: 10, 2: 10}
    assert {x["id"] for x in recs if x["generation"] == 2} == {x["id"] for x in first}
    before = run_keys(r)
    res = produce([*args, "--generations", "2"], redis_url)
    assert res.returncode == 2 and "generations: stored 3, now 2" in res.stderr
    assert run_keys(r) == before


@pytest.mark.e2e
def test_rounds_under_a_budget_keep_the_most_distinct_prompts(redis_url: str, r: "redis.Redis",
                                                              tokenizer_dir: Path, tmp_path: Path,
                                                              sim_factory: Any, workers: Any) -> None:
    """--generations 3 and a budget for ~1.5 x the prompts: every prompt has generation 0, about half have 1, none
    has 2; a rerun keeps exactly that set.

    One worker: rounds are the queue's order, which one worker follows exactly. With several, a worker whose
    admission finds the budget reserved by the others' requests gives its chunk back, and a next round's chunk
    already queued may start first (docs/generations.md)."""
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "100", "--seed", "4")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="16")
    pool.start("w0")
    out = tmp_path / "out"
    prompts = 40
    args = [str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300", "--max-samples", str(prompts),
            "--chunk-size", "4", "--out", str(out), "--turns", "last", "--generations", "3",
            "--expect-mean", "100"]
    # the simulator's mean length is 100 tokens: 1.5 x 40 prompts is ~6,000 tokens
    res = produce([*args, "--budget", "6000"], redis_url)
    assert res.returncode == 0, res.stderr
    recs = check_samples(r, out, CODE_DS)
    by_gen = Counter(x["generation"] for x in recs)
    assert by_gen[0] == prompts and 10 <= by_gen[1] <= 30 and by_gen[2] == 0, by_gen
    res = produce([*args, "--budget", "6000"], redis_url)
    assert res.returncode == 0, res.stderr
    assert check_samples(r, out, CODE_DS) == recs


def test_dry_run_plans_n_times_the_prompts_and_says_the_mix(redis_url: str, r: "redis.Redis",
                                                           tokenizer_dir: Path, tmp_path: Path) -> None:
    before = r.dbsize()
    args = [str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300", "--out", str(tmp_path / "out"),
            "--turns", "last", "--dry-run", "--expect-mean", "100", "--generations", "3", "--temperature",
            "0,0.6,1.0", "--seed", "9"]
    res = produce([*args, "--json"], redis_url)
    assert res.returncode == 0, res.stderr
    [plan] = json.loads(res.stdout)["datasets"]
    assert (plan["valid"], plan["generations"], plan["samples"], plan["samples_needed"]) == (150, 3, 450, 450)
    assert "temperature 0, 0.6, 1" in plan["settings_mix"] and "derived from (9, id, k)" in plan["settings_mix"]
    res = produce(args, redis_url)
    assert res.returncode == 0 and "3 generations of each prompt: 450 samples, sent in rounds" in res.stdout
    res = produce([*args[:-6], "--temperature", "0,1"], redis_url)  # a list without --generations
    assert res.returncode == 2 and "--temperature 0,1: a list goes with --generations N > 1" in res.stderr
    assert r.dbsize() == before
