"""Several generations per prompt (docs/generations.md), the producer's side on the session's redis-server: the
sample key, the rounds, what a chunk carries per generation, resume from the file, and the settings check. No
worker runs here; the ledger's commit script stands for what a worker did (tests/e2e/test_generations_e2e.py runs
real workers)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from budget.ledger import Ledger
from budget.record import VERSION, ChunkPayload, SamplePayload, sampling_params_of
from producer.errors import ProduceError
from producer.export.manifest import Stats
from producer.generations import Generations, derived_seed, parse_temperatures, record_key, sample_key, split_key
from producer.plan import plan_dataset
from producer.prepare import Inputs, load_inputs
from producer.results import FAILED_FILE, RESULTS, RUN, ResultsFile, collect, write_failed
from producer.session.attach import RunOptions
from producer.session.loop import Producer
from tests.producers import run_settings
from tests.rq_jobs import job_payloads

DS = "prompts"
IDS = [f"p{i}" for i in range(6)]


def inputs_for(tmp_path: Path, tokenizer: Path, generations: int, temperature: float | list[float] | None = None,
               sampling_seed: int | None = None) -> Inputs:
    path = tmp_path / f"{DS}.jsonl"
    path.write_text("".join(json.dumps({"id": sid, "messages": [{"role": "user", "content": f"Question {sid}?"}]})
                            + "\n" for sid in IDS))
    args = [str(path), "--tokenizer", str(tokenizer), "--max-tokens", "16", "--order", "file", "--reasoning-parser",
            "qwen3", "--turns", "last", "--generations", str(generations)]
    if temperature is not None:
        text = ",".join(map(str, temperature)) if isinstance(temperature, list) else str(temperature)
        args += ["--temperature", text]
    if sampling_seed is not None:
        args += ["--seed", str(sampling_seed)]
    return load_inputs(run_settings(*args), echo=lambda m: None, warn=lambda m: None)


def attach(r: "redis.Redis", tmp_path: Path, inputs: Inputs, echoed: list[str] | None = None) -> Producer:
    opts = RunOptions(out_dir=tmp_path / "out", budgets={DS: None}, chunk_size=4)
    producer = Producer(r, inputs.prepared, opts, echo=(echoed.append if echoed is not None else lambda m: None))
    producer.attach()
    return producer


def test_sample_key_round_trips_and_generation_zero_is_the_id() -> None:
    for pid in ("a", "x\u00e9 1", "ends-with-digits-12", ""):
        for k in (0, 1, 2, 17):
            assert split_key(sample_key(pid, k)) == (pid, k)
    assert sample_key("a", 0) == "a" and sample_key("a", 3) == "a\x1f3"
    assert record_key({"id": "a"}) == "a"  # a record written before generations: generation 0
    assert record_key({"id": "a", "generation": 2}) == "a\x1f2"


def test_derived_seeds_keep_generation_zero_and_differ_per_generation() -> None:
    assert derived_seed(5, "p", 0) == 5
    seeds = {derived_seed(5, "p", k) for k in range(1, 50)}
    assert len(seeds) == 49 and all(0 <= s < 2 ** 31 for s in seeds)
    assert derived_seed(5, "p", 1) == derived_seed(5, "p", 1) != derived_seed(6, "p", 1) != derived_seed(5, "q", 1)


def test_overrides_carry_only_what_differs_from_the_chunk() -> None:
    mix = Generations.from_params(4, {"temperature": [0.0, 0.6, 0.0], "sampling_seed": 3, "max_new_tokens": 9})
    assert mix.overrides("p", 0) is None
    assert mix.overrides("p", 1) == {"temperature": 0.6, "sampling_seed": derived_seed(3, "p", 1)}
    assert mix.overrides("p", 2) == {"sampling_seed": derived_seed(3, "p", 2)}  # entry 2 is entry 0's value
    assert mix.overrides("p", 4) is not None and mix.temperature(4) == 0.6  # 4 mod 3 = 1
    assert Generations.from_params(3, {"temperature": 0.7}).overrides("p", 2) is None
    with pytest.raises(ValueError):
        parse_temperatures("0,-1")
    assert parse_temperatures("0, 0.6,1") == [0.0, 0.6, 1.0]


def test_worker_merges_a_sample_override_over_the_chunk() -> None:
    plain: SamplePayload = {"id": "a", "input_ids": [1], "opens_think": False}
    chunk: ChunkPayload = {"v": VERSION, "dataset": "ds", "chunk": "c1",
                           "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}, "think": None,
                           "reasoning_parser": "qwen3", "samples": [plain]}
    assert sampling_params_of(chunk, plain) is chunk["sampling_params"]
    assert sampling_params_of(chunk, {**plain, "sampling_params": {"temperature": 1.0}}) == {
        "max_new_tokens": 8, "temperature": 1.0}


def test_one_generation_sends_the_chunks_it_always_sent(r: "redis.Redis", tmp_path: Path,
                                                         tokenizer_dir: Path) -> None:
    inputs = inputs_for(tmp_path, tokenizer_dir, 1, temperature=0.7, sampling_seed=4)
    stored = inputs.settings.stored
    assert "generations" not in stored and stored["sampling_params"]["temperature"] == 0.7
    producer = attach(r, tmp_path, inputs)
    [d] = producer.runs
    producer._refill(d)
    payloads = job_payloads(r)
    samples = [s for p in payloads for s in p["samples"]]
    assert [s["id"] for s in samples] == [s.id for s in inputs.prepared[0].samples]
    assert all(set(s) == {"id", "input_ids", "opens_think"} for s in samples)
    assert all(p["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.7, "sampling_seed": 4,
                                        "skip_special_tokens": True}
               for p in payloads)
    assert "generations" not in json.loads((tmp_path / "out" / DS / RUN).read_text())
    producer.release()


def test_rounds_and_per_generation_overrides_in_the_chunks(r: "redis.Redis", tmp_path: Path,
                                                            tokenizer_dir: Path) -> None:
    inputs = inputs_for(tmp_path, tokenizer_dir, 3, temperature=[0.0, 0.6, 1.0], sampling_seed=11)
    [p] = inputs.prepared
    order = [s.id for s in p.samples]
    producer = attach(r, tmp_path, inputs)
    [d] = producer.runs
    assert list(d.todo) == [sample_key(pid, k) for k in range(3) for pid in order]  # rounds
    producer._refill(d)
    payloads = job_payloads(r)
    assert all(pl["sampling_params"]["temperature"] == 0.0 for pl in payloads)  # the list's first entry
    sent = {s["id"]: s for pl in payloads for s in pl["samples"]}
    assert len(sent) == 18
    for pid in order:
        assert "sampling_params" not in sent[pid]
        assert sent[pid]["input_ids"] == sent[sample_key(pid, 1)]["input_ids"] == sent[sample_key(pid, 2)]["input_ids"]
        for k, temp in ((1, 0.6), (2, 1.0)):
            assert sent[sample_key(pid, k)]["sampling_params"] == {"temperature": temp,
                                                                   "sampling_seed": derived_seed(11, pid, k)}
    stored = json.loads((tmp_path / "out" / DS / RUN).read_text())
    assert stored["generations"] == 3 and stored["sampling_params"]["temperature"] == [0.0, 0.6, 1.0]
    producer.release()


def commit(r: "redis.Redis", key: str, tokens: int, params: dict[str, Any]) -> None:
    """What a worker's commit of sample ``key`` leaves in Redis (its record's ``id`` is the sample key)."""
    rec = {"record_version": 2, "id": key, "dataset": DS, "turns": [{"completion_tokens": tokens,
                                                                        "finish_reason": "stop",
                                                                        "prompt_tokens": 3}],
           "completion_tokens": tokens, "incomplete": False, "stopped_by": None, "reasoning_parser": "qwen3",
           "sampling_params": params}
    assert Ledger(r).commit(DS, key, tokens, rec).committed


def test_records_say_their_prompt_and_generation_and_resume_maps_them_back(r: "redis.Redis", tmp_path: Path,
                                                                            tokenizer_dir: Path) -> None:
    inputs = inputs_for(tmp_path, tokenizer_dir, 2, temperature=[0.0, 1.0])
    producer = attach(r, tmp_path, inputs)
    [d] = producer.runs
    producer._refill(d)
    first = [s.id for s in inputs.prepared[0].samples][0]
    commit(r, first, 5, {"temperature": 0.0})
    commit(r, sample_key(first, 1), 7, {"temperature": 1.0})
    messages = {s.id: s.messages for s in inputs.prepared[0].samples}
    written = collect(producer.store, DS, d.out, lambda sid: messages.get(split_key(sid)[0]))
    assert [(w["id"], w["generation"]) for w in written] == [(first, 0), (first, 1)]
    assert all(w["messages"] == messages[first] for w in written)
    lines = [json.loads(x) for x in (tmp_path / "out" / DS / RESULTS).read_text().splitlines()]
    assert [list(x)[:3] for x in lines] == [["record_version", "id", "generation"]] * 2
    assert set(d.out.tokens) == {first, sample_key(first, 1)}
    stats = Stats()
    for rec in lines:
        stats.add(rec)
    assert dict(stats.generations) == {"0": 1, "1": 1} and dict(stats.temperatures) == {"0": 1, "1": 1}
    producer.release()
    # A rerun reads (id, generation) back into the keys: both are done, the other 10 samples still to do.
    again = attach(r, tmp_path, inputs_for(tmp_path, tokenizer_dir, 2, temperature=[0.0, 1.0]))
    [d2] = again.runs
    assert {first, sample_key(first, 1)} <= d2.done and first not in d2.todo
    assert len(d2.todo) + len(d2.done) + sum(len(v) for v in d2.chunk_samples.values()) >= 12
    assert again.summaries()[0].selected == 12
    again.release()
    # failed.jsonl names the prompt and the generation
    write_failed(tmp_path / FAILED_FILE, {sample_key("p1", 2): {"id": sample_key("p1", 2), "reason": "x"}})
    assert json.loads((tmp_path / FAILED_FILE).read_text()) == {"id": "p1", "generation": 2, "reason": "x"}


def test_a_record_without_generation_is_generation_zero(tmp_path: Path) -> None:
    path = tmp_path / RESULTS
    path.write_text(json.dumps({"record_version": 2, "id": "a", "completion_tokens": 3}) + "\n")
    out = ResultsFile(path)
    assert out.tokens == {"a": 3}
    v2 = {"record_version": 2, "id": "a"}
    assert out.append([{**v2, "generation": 1, "completion_tokens": 4}]) != []  # another sample
    assert out.append([{**v2, "generation": 0, "completion_tokens": 3}]) == []  # on file already
    out.close()
    assert ResultsFile(path).tokens == {"a": 3, "a\x1f1": 4}


def test_raising_generations_extends_and_lowering_is_refused(r: "redis.Redis", tmp_path: Path,
                                                             tokenizer_dir: Path) -> None:
    attach(r, tmp_path, inputs_for(tmp_path, tokenizer_dir, 1, temperature=0.5)).release()
    echoed: list[str] = []
    raised = attach(r, tmp_path, inputs_for(tmp_path, tokenizer_dir, 3, temperature=0.5), echoed)
    assert any("extends the stored run of 1" in m for m in echoed)
    assert len(raised.runs[0].todo) == 18
    raised.release()
    before = r.dbsize()
    with pytest.raises(ProduceError) as err:
        attach(r, tmp_path, inputs_for(tmp_path, tokenizer_dir, 2, temperature=0.5))
    assert err.value.exit_code == 2 and "generations: stored 3, now 2" in str(err.value)
    assert r.dbsize() == before
    with pytest.raises(ProduceError) as err:  # another list is a settings change
        attach(r, tmp_path, inputs_for(tmp_path, tokenizer_dir, 3, temperature=[0.5, 1.0]))
    assert err.value.exit_code == 2 and "temperature" in str(err.value)


def test_dry_run_plans_generations_times_prompts(tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs = inputs_for(tmp_path, tokenizer_dir, 3, temperature=[0.0, 1.0], sampling_seed=2)
    plan = plan_dataset(inputs.prepared[0], budget=None, out_dir=tmp_path / "out", expect_mean=10.0,
                        pilot_mean=None, pilot_n=0, throughput=None,
                        settings_mix=inputs.settings.generations.describe())
    assert (plan.valid, plan.samples, plan.generations, plan.samples_needed) == (6, 18, 3, 18)
    assert plan.projected_tokens == 180 and "temperature 0, 1" in plan.settings_mix


def test_the_ready_line_counts_samples_as_its_conversations_and_requests_do(tmp_path: Path,
                                                                           tokenizer_dir: Path) -> None:
    """3 prompts, one a conversation of 2 user turns, x 4 generations: 12 samples, 4 conversations, 16 requests (the
    line said '3 samples ready' beside '4 multi-turn conversations')."""
    from click.testing import CliRunner

    from producer.cli import main
    data = tmp_path / "ds.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and then?"}]
    data.write_text("".join(json.dumps(x) + "\n" for x in
                            ({"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}, {"id": "c", "messages": chat})))
    res = CliRunner().invoke(main, [str(data), "--tokenizer", str(tokenizer_dir), "--max-tokens", "64", "--dry-run",
                                    "--expect-mean", "10", "--generations", "4", "--temperature", "0,1"])
    assert res.exit_code == 0, res.output
    ready = next(line for line in res.output.splitlines() if "samples ready" in line)
    assert ready.startswith("ds: 12 samples ready (3 prompts x 4 generations, "), ready
    assert "4 multi-turn conversations (16 requests at most)" in ready, ready
