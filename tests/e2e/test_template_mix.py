"""``--template-kwargs-mix`` (issue 15 §2, docs/generations.md): a weighted draw of chat-template kwargs per sample.

The draw itself offline; the producer's chunks on the session Redis; and end to end on real ``rq worker``s and the
simulator, checked from the server's side: every turn of a sample, turn 0 rendered by ``produce`` and later turns
by a worker, was rendered with the kwargs that sample drew."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from budget.record import VERSION
from producer.generations import MixError, TemplateMix, labels, sample_key, split_key, variant
from tests import sim_log
from tests.chats import DS, MESSAGES, SIM_ARGS, write_dataset
from tests.procs import produce, read_jsonl
from tests.rq_jobs import job_payloads

EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's hybrid template: ``enable_thinking=false`` closes an empty think block after the generation prompt."""
    from demo.tokenizer import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("hybrid"), thinking="hybrid")


# -- the draw -------------------------------------------------------------------------------------------------------
def test_parse_reads_keys_values_and_weights() -> None:
    mix = TemplateMix.parse("reasoning_effort=low:4,medium:4,high:2; enable_thinking=true,false", seed=7)
    assert mix.keys == ["enable_thinking", "reasoning_effort"]
    assert dict(mix.choices)["reasoning_effort"] == (("low", 4.0), ("medium", 4.0), ("high", 2.0))
    assert dict(mix.choices)["enable_thinking"] == ((True, 1.0), (False, 1.0))  # JSON values; weight 1 by default
    assert TemplateMix.from_setting(json.loads(json.dumps(mix.setting()))) == mix  # through run.json and back
    assert "reasoning_effort low 40%, medium 40%, high 20%" in mix.describe()


@pytest.mark.parametrize("spec, says", [
    ("", "no KEY=VALUE"), ("reasoning_effort", "expected KEY=VALUE"), ("=low:1", "expected KEY=VALUE"),
    ("k=a:x", "not a number"), ("k=a:0", "> 0"), ("k=a:-1", "> 0"), ("k=a:inf", "> 0"), ("k=a,a", "given twice"),
    ("k=a;k=b", "given twice"), ("k=:2", "empty value"),
])
def test_parse_refuses_what_it_cannot_read(spec: str, says: str) -> None:
    with pytest.raises(MixError, match=says):
        TemplateMix.parse(spec, seed=0)


def test_the_draw_is_a_function_of_key_id_generation_and_seed_with_the_weights() -> None:
    mix = TemplateMix.parse("reasoning_effort=low:4,medium:4,high:2", seed=1)
    n = 6000
    draws = [mix.draw(f"id-{i}", 0)["reasoning_effort"] for i in range(n)]
    assert draws == [mix.draw(f"id-{i}", 0)["reasoning_effort"] for i in range(n)]  # reproducible
    counts = Counter(draws)
    for value, p in (("low", 0.4), ("medium", 0.4), ("high", 0.2)):
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts[value] - n * p) < 5 * sd, counts  # binomial bound: fails about once in 10**6
    # generations of one prompt draw independently, and another seed draws another sequence
    gen1 = [mix.draw(f"id-{i}", 1)["reasoning_effort"] for i in range(n)]
    assert sum(a == b for a, b in zip(draws, gen1, strict=True)) < n * (0.4 ** 2 + 0.4 ** 2 + 0.2 ** 2) + 5 * math.sqrt(n)
    other = TemplateMix.parse("reasoning_effort=low:4,medium:4,high:2", seed=2)
    assert [other.draw(f"id-{i}", 0)["reasoning_effort"] for i in range(n)] != draws


def test_variant_and_labels_name_a_combination() -> None:
    assert variant({"b": 1, "a": True}) == '{"a":true,"b":1}'
    assert labels({"enable_thinking": False, "reasoning_effort": "low", "other": 1},
                  ["enable_thinking", "reasoning_effort"]) == ["enable_thinking=false", "reasoning_effort=low"]


# -- produce: the options, the chunks --------------------------------------------------------------------------------
def _produce_cli(args: list[str], redis_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "producer.cli", *args, "--redis-url", redis_url],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.e2e  # runs produce as a process (several for some): seconds each on a loaded machine
def test_a_bad_mix_is_exit_2_before_redis_is_touched(tmp_path: Path, hybrid_dir: Path, redis_url: str,
                                                     r: "redis.Redis") -> None:
    data = write_dataset(tmp_path)
    before = r.dbsize()
    res = _produce_cli([str(data), "--tokenizer", str(hybrid_dir), "--max-tokens", "16", "--out",
                        str(tmp_path / "out"), "--template-kwargs-mix", "enable_thinking=true:0"], redis_url)
    assert res.returncode == 2 and "--template-kwargs-mix: enable_thinking" in res.stderr, res.stderr
    res = _produce_cli([str(data), "--tokenizer", str(hybrid_dir), "--max-tokens", "16", "--out",
                        str(tmp_path / "out"), "--template-kwargs-mix", "enable_thinking=true,false",
                        "--chat-template-kwargs", '{"enable_thinking": true}'], redis_url)
    assert res.returncode == 2 and "both set enable_thinking" in res.stderr, res.stderr
    assert r.dbsize() == before


@pytest.mark.e2e  # runs produce as a process (several for some): seconds each on a loaded machine
def test_dry_run_says_the_mix(tmp_path: Path, hybrid_dir: Path, redis_url: str) -> None:
    res = _produce_cli([str(write_dataset(tmp_path)), "--tokenizer", str(hybrid_dir), "--max-tokens", "16",
                        "--out", str(tmp_path / "out"), "--template-kwargs-mix", "enable_thinking=true:3,false:1",
                        "--dry-run"], redis_url)
    assert res.returncode == 0, res.stderr
    assert "enable_thinking true 75%, false 25%" in res.stdout + res.stderr


@pytest.mark.e2e  # runs produce as a process (several for some): seconds each on a loaded machine
def test_chunks_carry_each_samples_kwargs_and_its_rendering(tmp_path: Path, hybrid_dir: Path, redis_url: str,
                                                            r: "redis.Redis") -> None:
    """Turn 0 is rendered with the drawn kwargs; a conversation carries their fingerprint for its later turns;
    run.json stores the mix."""
    from producer.prepare import first_turn
    from render.chat import Renderer, load_tokenizer
    out = tmp_path / "out"
    res = produce([str(write_dataset(tmp_path)), "--tokenizer", str(hybrid_dir), "--max-tokens", "16",
                   "--out", str(out), "--generations", "3", "--template-kwargs-mix", "enable_thinking=true,false",
                   "--detach", "--quiet"], redis_url)
    assert res.returncode == 0, res.stderr
    mix = TemplateMix.parse("enable_thinking=true,false", seed=0)
    stored = json.loads((out / DS / "run.json").read_text())
    assert stored["template_kwargs_mix"] == mix.setting()
    tok = load_tokenizer(str(hybrid_dir))
    seen = 0
    for payload in job_payloads(r):
        assert payload["v"] == VERSION
        for sample in payload["samples"]:
            pid, k = split_key(sample["id"])
            drawn = mix.draw(pid, k)
            assert sample["chat_template_kwargs"] == drawn
            renderer = Renderer(tok, chat_template_kwargs=drawn)
            assert sample["input_ids"] == renderer.render(first_turn(MESSAGES[pid])).input_ids
            if pid == "one":
                assert "tokenizer" not in sample
            else:
                assert sample["tokenizer"] == renderer.fingerprint()
            seen += 1
    assert seen == 9


@pytest.mark.e2e  # runs produce as a process (several for some): seconds each on a loaded machine
def test_without_a_mix_chunks_carry_no_kwargs(tmp_path: Path, hybrid_dir: Path, redis_url: str,
                                            r: "redis.Redis") -> None:
    out = tmp_path / "out"
    res = produce([str(write_dataset(tmp_path)), "--tokenizer", str(hybrid_dir), "--max-tokens", "16",
                   "--out", str(out), "--detach", "--quiet"], redis_url)
    assert res.returncode == 0, res.stderr
    assert "template_kwargs_mix" not in json.loads((out / DS / "run.json").read_text())
    for payload in job_payloads(r):
        assert payload["v"] == VERSION
        assert all("chat_template_kwargs" not in s and "tokenizer" not in s for s in payload["samples"])


@pytest.mark.e2e  # runs produce as a process (several for some): seconds each on a loaded machine
def test_another_mix_on_a_rerun_is_a_settings_change(tmp_path: Path, hybrid_dir: Path, redis_url: str,
                                                     r: "redis.Redis") -> None:
    out = tmp_path / "out"
    args = [str(write_dataset(tmp_path)), "--tokenizer", str(hybrid_dir), "--max-tokens", "16", "--out", str(out),
            "--detach", "--quiet"]
    res = produce([*args, "--template-kwargs-mix", "enable_thinking=true,false"], redis_url)
    assert res.returncode == 0, res.stderr
    for other in (["--template-kwargs-mix", "enable_thinking=true:2,false"], []):
        res = produce([*args, *other], redis_url)
        assert res.returncode == 2 and "template_kwargs_mix" in res.stderr, res.stderr


# -- end to end ------------------------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.e2e
def test_every_turn_is_rendered_with_the_kwargs_its_sample_drew(redis_url: str, r: "redis.Redis", hybrid_dir: Path,
                                                                tmp_path: Path, sim_factory: Any,
                                                                workers: Any) -> None:
    """Conversations of 1, 2 and 3 turns x 4 generations, ``enable_thinking`` drawn per sample: from the server's
    log, every request of every turn ends its prompt with the empty think block exactly when its sample drew
    false (turn 0 rendered by produce, later turns by a worker); the records say what they drew, the manifest
    counts it, and the token export re-renders every turn's prompt with the record's kwargs (0 mismatches)."""
    from render.chat import load_tokenizer
    log = tmp_path / "requests.jsonl"
    # The run's tokenizer: the token export refuses output ids it does not have
    sim = sim_factory(*SIM_ARGS, "--request-log", str(log), "--tokenizer", str(hybrid_dir))
    workers(sim.url).start("w0")
    out = tmp_path / "out"
    res = produce([str(write_dataset(tmp_path)), "--tokenizer", str(hybrid_dir), "--max-tokens", "64",
                   "--out", str(out), "--generations", "4", "--template-kwargs-mix", "enable_thinking=true,false",
                   "--order-seed", "3", "--quiet"], redis_url, timeout=120)
    assert res.returncode == 0, res.stderr
    mix = TemplateMix.parse("enable_thinking=true,false", seed=3)
    recs = read_jsonl(out / DS / "raw_responses.jsonl")
    assert sorted((x["id"], x["generation"]) for x in recs) == sorted(
        (sid, k) for sid in ("one", "two", "three") for k in range(4))
    assert int(r.get(keys.DatasetKeys(DS).used) or 0) == sum(x["completion_tokens"] for x in recs)
    drew = {(x["id"], x["generation"]): mix.draw(x["id"], x["generation"]) for x in recs}
    assert {v["enable_thinking"] for v in drew.values()} == {True, False}  # both values occur in this draw
    tok = load_tokenizer(str(hybrid_dir))
    requests = sim_log.load(log)
    checked = 0
    for rec in recs:
        key = (rec["id"], rec["generation"])
        assert rec["chat_template_kwargs"] == drew[key]
        for turn in range(len(rec["turns"])):
            prefix = sim_log.turn_prefix(DS, sample_key(*key), turn)
            sent = [x for x in requests if x["rid"].startswith(prefix)]
            assert sent, (key, turn)
            for x in sent:
                prompt = tok.decode(x["input_ids"], skip_special_tokens=False)
                assert isinstance(prompt, str)  # one sequence of ids: one text (a batch would give a list)
                assert prompt.endswith(EMPTY_THINK) == (drew[key]["enable_thinking"] is False), (key, turn, prompt)
                checked += 1
    assert checked >= 12 + 4 + 8  # every turn of the 12 samples, later turns included
    manifest = json.loads((out / DS / "manifest.json").read_text())
    want = Counter(f"enable_thinking={json.dumps(v['enable_thinking'])}" for v in drew.values())
    assert manifest["template_kwargs"] == dict(sorted(want.items()))
    export = tmp_path / "tokens.jsonl"
    res = produce(["export", DS, "--out", str(out), "--dest", str(export), "--format", "tokens", "--tokenizer",
                   str(hybrid_dir)], redis_url)
    assert res.returncode == 0, res.stderr + res.stdout
    rows = [json.loads(x) for x in export.read_text().splitlines()]
    assert len(rows) == sum(len(x["turns"]) for x in recs)  # every turn's prompt re-rendered and matched
    export = tmp_path / "messages.jsonl"
    res = produce(["export", DS, "--out", str(out), "--dest", str(export), "--for", "speculators"], redis_url)
    assert res.returncode == 0, res.stderr
    for row in (json.loads(x) for x in export.read_text().splitlines()):
        assert row["chat_template_kwargs"] == drew[(row["id"], row["generation"])]


def test_a_record_produce_writes_in_a_workers_stead_says_what_its_sample_was_sent(
        r: "redis.Redis", tmp_path: Path, hybrid_dir: Path) -> None:
    """Generation 1 of "two" started (turn 0 committed) by a worker that died, and the dataset closed: produce ends
    it with its one turn (producer/session/loop.py ``_end_stranded``), and the record says the temperature of generation 1
    and the kwargs it drew, not the chunks' (what a worker's record of it would say)."""
    from budget.ledger import Ledger
    from producer.prepare import load_inputs
    from producer.session.loop import Producer
    from tests.chats import options, turn
    from tests.producers import run_settings
    mix = TemplateMix.parse("enable_thinking=true,false", seed=0)
    inputs = load_inputs(run_settings(str(write_dataset(tmp_path)), "--tokenizer", str(hybrid_dir), "--max-tokens",
                                      "16", "--order", "file", "--temperature", "0.2,0.9", "--system-prompt",
                                      "Be brief.", "--reasoning-parser", "qwen3", "--turns", "all",
                                      "--template-kwargs-mix", "enable_thinking=true,false", "--generations", "2"),
                         echo=lambda m: None, warn=lambda m: None)
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    key = sample_key("two", 1)
    assert ledger.commit_turn(DS, key, 0, 4, turn(key, 0, 4) | {"content": "hi", "reasoning": None},
                              chunk="bq-chats-dead").committed
    producer = Producer(r, inputs.prepared, options(tmp_path, inputs, budgets={DS: 4}),
                        echo=lambda m: None)
    producer.attach()
    producer.run()
    [rec] = read_jsonl(tmp_path / "out" / DS / "raw_responses.jsonl")
    assert (rec["id"], rec["generation"], rec["stopped_by"]) == ("two", 1, "budget")
    assert rec["sampling_params"]["temperature"] == 0.9
    assert rec["chat_template_kwargs"] == mix.draw("two", 1)
