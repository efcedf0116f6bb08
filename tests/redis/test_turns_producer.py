"""The producer's side of ``--turns all`` (docs/multiturn.md) on the session's redis-server: what prepare renders
and selects, what a chunk carries, and what attach does with the conversations Redis and the files hold (the
tokenizer files shared once, failed conversations reopened, started ones resumed unless a live chunk holds them).
The worker's side is tested where it lives; here no worker runs, the ledger's scripts stand for what workers did.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import pytest
import redis

from budget import keys, runstate
from budget.ledger import Ledger
from budget.record import plan
from producer.errors import ProduceError
from producer.export.manifest import Stats
from producer.ops.status import all_status, status_table
from producer.plan import plan_dataset, sequential_eta
from producer.prepare import Inputs, first_turn, load_inputs
from producer.results import RESULTS, RUN
from producer.session.attach import RunOptions
from producer.session.loop import Producer
from producer.settings import ALL, LAST
from render.chat import Renderer, load_tokenizer
from tests.chats import DS, MESSAGES, SIM_ARGS, SYSTEM, options, turn, write_dataset
from tests.producers import run_settings
from tests.replies import entries
from tests.rq_jobs import job_payloads


def inputs_for(tmp_path: Path, tokenizer: Path, turns: str, max_context: int | None = None,
               system_prompt: str | None = "Be brief.") -> Inputs:
    args = [str(write_dataset(tmp_path)), "--tokenizer", str(tokenizer), "--max-tokens", "16", "--order", "file",
            "--reasoning-parser", "qwen3", "--turns", turns]
    args += ["--max-context", str(max_context)] if max_context is not None else []
    args += ["--system-prompt", system_prompt] if system_prompt is not None else []
    return load_inputs(run_settings(*args), echo=lambda m: None, warn=lambda m: None)


def attach(r: "redis.Redis", inputs: Inputs, opts: RunOptions, echoed: list[str] | None = None) -> Producer:
    producer = Producer(r, inputs.prepared, opts, echo=(echoed.append if echoed is not None else lambda m: None))
    producer.attach()
    return producer


def test_all_sends_turn_zero_of_a_conversation_and_one_turn_samples_as_last_does(tmp_path: Path,
                                                                                   tokenizer_dir: Path) -> None:
    every, last = inputs_for(tmp_path, tokenizer_dir, ALL), inputs_for(tmp_path, tokenizer_dir, LAST)
    [p], [q] = every.prepared, last.prepared
    renderer = Renderer(load_tokenizer(str(tokenizer_dir)))
    sample = {s.id: s for s in p.samples}
    assert p.turns == {"two": 2, "three": 3} and q.turns == {} and p.settings.turns == ALL
    assert (p.conversations, p.conversation_turns, p.turns_total) == (2, 5, 6)
    for sid in ("two", "three"):
        # System prompt applied, trailing assistant dropped: the messages as --turns last sends them.
        assert sample[sid].messages[0] == SYSTEM and sample[sid].messages[-1]["role"] == "user"
        turn0 = [SYSTEM, MESSAGES[sid][0]]
        assert plan(sample[sid].messages)[0].context == turn0
        assert list(p.prompts[sid].input_ids) == renderer.render(turn0).input_ids
        assert list(q.prompts[sid].input_ids) == renderer.render(sample[sid].messages).input_ids
    assert list(p.prompts["one"].input_ids) == list(q.prompts["one"].input_ids) and p.turns_of("one") == 1
    assert every.settings.stored["turns"] == ALL and last.settings.stored["turns"] == LAST
    assert {k: v for k, v in every.settings.stored.items() if k != "turns"} == \
        {k: v for k, v in last.settings.stored.items() if k != "turns"}
    block = every.conversation()
    assert block == {"tokenizer": every.settings.stored["tokenizer"], "chat_template_kwargs": {},
                     "max_context": every.context.tokens, "open_markers": None}
    assert last.conversation() is None


def test_the_context_check_of_a_conversation_is_its_turn_zero(tmp_path: Path, tokenizer_dir: Path) -> None:
    renderer = Renderer(load_tokenizer(str(tokenizer_dir)))
    [q] = inputs_for(tmp_path, tokenizer_dir, LAST).prepared
    whole = len(q.prompts["three"].input_ids)
    first = len(renderer.render([SYSTEM, MESSAGES["three"][0]]).input_ids)
    assert first < whole
    context = first + 16  # turn 0 + --max-tokens fits exactly; the whole conversation does not
    [p] = inputs_for(tmp_path, tokenizer_dir, ALL, max_context=context).prepared
    [q] = inputs_for(tmp_path, tokenizer_dir, LAST, max_context=context).prepared
    assert "three" in {s.id for s in p.samples} and "three" not in {s.id for s in q.samples}
    assert not any(x.line == 3 for x in p.over_context)
    [x] = [x for x in q.over_context if x.line == 3]
    assert f"prompt of {whole} tokens" in x.reason


def test_a_template_refusing_a_later_turn_is_found_before_redis(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Turn 0 renders, but the whole conversation (the shape of the later turns) does not: exit 2 naming the
    line, as --turns last would, although only turn 0 is sent."""
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m.role == 'assistant' %}"
                               "{{ raise_exception('no assistant turns') }}{% endif %}{{ m.content }}{% endfor %}")
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ProduceError) as err:
        inputs_for(tmp_path, tok, ALL)
    assert err.value.exit_code == 2 and f"{DS}.jsonl:2" in str(err.value) and "no assistant turns" in str(err.value)


def refusing_template(tokenizer_dir: Path, tmp_path: Path, refused: str) -> Path:
    """The tokenizer with a chat template that refuses any assistant message holding ``refused``: only a later
    turn's shape of that conversation (with the dataset's answers) fails; every turn 0 renders."""
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m.role == 'assistant' and '" + refused + "' in m.content %}"
                               "{{ raise_exception('refused answer') }}{% endif %}{{ m.content }}{% endfor %}")
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def test_every_conversation_is_checked_whole_and_a_refused_one_is_named_by_its_line(tmp_path: Path,
                                                                                    tokenizer_dir: Path) -> None:
    """The check is not a sample: the last conversation of the file is the only one refused (its second answer),
    and it is the one named; --skip-invalid skips it alone and sends the others' prompts as without the check."""
    tok = refusing_template(tokenizer_dir, tmp_path, "Second answer")
    with pytest.raises(ProduceError) as err:
        inputs_for(tmp_path, tok, ALL)
    assert err.value.exit_code == 2 and f"{DS}.jsonl:3" in str(err.value) and "refused answer" in str(err.value)
    args = [str(write_dataset(tmp_path)), "--tokenizer", str(tok), "--max-tokens", "16", "--order", "file",
            "--reasoning-parser", "qwen3", "--turns", ALL, "--skip-invalid"]
    [p] = load_inputs(run_settings(*args), echo=lambda m: None, warn=lambda m: None).prepared
    assert list(p.prompts) == ["one", "two"] and p.turns == {"two": 2}
    [bad] = p.invalid
    assert bad.line == 3 and "refused answer" in bad.reason
    renderer = Renderer(load_tokenizer(str(tok)))
    assert list(p.prompts["two"].input_ids) == renderer.render(first_turn(p.prompts["two"].sample.messages)).input_ids
    assert list(p.prompts["one"].input_ids) == renderer.render(p.prompts["one"].sample.messages).input_ids


def test_a_chunk_of_conversations_carries_messages_turns_and_the_conversation_block(
        r: "redis.Redis", tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs = inputs_for(tmp_path, tokenizer_dir, ALL)
    [p] = inputs.prepared
    producer = attach(r, inputs, options(tmp_path, inputs, chunk_size=1))
    producer.run(detach=True)
    payloads = job_payloads(r)
    by_id = {pl["samples"][0]["id"]: pl for pl in payloads}
    assert set(by_id) == {"one", "two", "three"}
    assert "conversation" not in by_id["one"] and by_id["one"]["samples"][0].keys() == {"id", "input_ids",
                                                                                          "opens_think"}
    messages = {s.id: s.messages for s in p.samples}
    for sid, k in (("two", 2), ("three", 3)):
        [sample] = by_id[sid]["samples"]
        assert sample["turns"] == k and sample["messages"] == messages[sid]
        assert sample["input_ids"] == list(p.prompts[sid].input_ids)
        assert by_id[sid]["conversation"] == inputs.conversation()
    # The tokenizer files are in Redis once, under the run's fingerprint.
    fp = inputs.settings.stored["tokenizer"]
    assert set(runstate.fetch_files(r, fp)) >= {"tokenizer.json", "tokenizer_config.json"}
    assert r.keys("bq:tok:*") == [keys.tokenizer_files(fp).encode()]
    stored = json.loads((tmp_path / "out" / DS / RUN).read_text())
    assert stored["turns"] == ALL and json.loads(r.hget(keys.DatasetKeys(DS).meta, "settings") or "{}")["turns"] == ALL


def test_last_enqueues_what_it_always_did(r: "redis.Redis", tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs = inputs_for(tmp_path, tokenizer_dir, LAST)
    [p] = inputs.prepared
    producer = attach(r, inputs, options(tmp_path, inputs, chunk_size=8))
    producer.run(detach=True)
    [payload] = job_payloads(r)
    assert "conversation" not in payload
    assert [s for s in payload["samples"]] == [
        {"id": s.id, "input_ids": list(p.prompts[s.id].input_ids), "opens_think": p.prompts[s.id].opens_think}
        for s in p.samples]
    assert not r.keys("bq:tok:*")


def test_a_tokenizer_that_cannot_be_shared_is_exit_2_before_anything_is_written(
        r: "redis.Redis", tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs = inputs_for(tmp_path, tokenizer_dir, ALL)
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "vocab.json").write_text("{}")
    # The run's --tokenizer, as its settings say, is a directory without the fast tokenizer's files.
    unshared = [replace(p, settings=replace(p.settings, tokenizer=str(slow))) for p in inputs.prepared]
    with pytest.raises(ProduceError) as err:
        attach(r, replace(inputs, prepared=unshared), options(tmp_path, inputs))
    assert err.value.exit_code == 2 and "cannot share the tokenizer" in str(err.value)
    assert r.dbsize() == 0


def test_a_run_stored_as_last_is_refused_under_all_before_anything_is_written(
        r: "redis.Redis", tmp_path: Path, tokenizer_dir: Path) -> None:
    last = inputs_for(tmp_path, tokenizer_dir, LAST)
    attach(r, last, options(tmp_path, last)).release()
    run_file = tmp_path / "out" / DS / RUN
    before = (run_file.read_bytes(), r.dbsize())
    every = inputs_for(tmp_path, tokenizer_dir, ALL)
    with pytest.raises(ProduceError) as err:
        attach(r, every, options(tmp_path, every))
    assert err.value.exit_code == 2 and "turns: stored 'last', now 'all'" in str(err.value)
    assert (run_file.read_bytes(), r.dbsize()) == before


def record(sid: str, turns: list[dict[str, Any]], stopped_by: str | None) -> dict[str, Any]:
    return {"record_version": 2, "id": sid, "dataset": DS, "messages": None, "turns": turns,
            "completion_tokens": sum(t["completion_tokens"] for t in turns), "incomplete": stopped_by is not None,
            "stopped_by": stopped_by}


def audit(r: "redis.Redis") -> int:
    k = keys.DatasetKeys(DS)
    used = int(r.get(k.used) or 0)
    assert used == sum(int(v) for v in r.hvals(k.done)) + Ledger(r).unwritten_turn_tokens(DS)
    return used


def test_attach_reopens_a_failed_conversation_and_resumes_started_ones(r: "redis.Redis", tmp_path: Path,
                                                                     tokenizer_dir: Path) -> None:
    """On disk: "one" done, "three" failed at turn 2 (turns 0 and 1 kept). In Redis: "two" started (turn 0
    committed) by a chunk that died. The rerun counts "one", reopens "three" (its turns committed again, used
    unchanged), and enqueues "two" and "three" to resume; a second attach changes nothing more."""
    inputs = inputs_for(tmp_path, tokenizer_dir, ALL)
    out = tmp_path / "out" / DS
    out.mkdir(parents=True)
    failed = record("three", [turn("three", 0, 7), turn("three", 1, 11)], "failed")
    (out / RESULTS).write_text(json.dumps(record("one", [turn("one", 0, 5)], None)) + "\n" + json.dumps(failed) + "\n")
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    assert ledger.commit_turn(DS, "two", 0, 4, turn("two", 0, 4), chunk="bq-chats-dead").committed
    echoed: list[str] = []
    producer = attach(r, inputs, options(tmp_path, inputs), echoed)
    [d] = producer.runs
    k = keys.DatasetKeys(DS)
    assert set(d.todo) == {"two", "three"} and d.done == {"one"} and d.resuming == {"three"}
    assert audit(r) == 5 + 18 + 4
    assert not r.hexists(k.done, "three") and ledger.committed_turns(DS, "three") == failed["turns"]
    assert any("1 conversations whose turn failed resume" in m for m in echoed)
    producer.release()
    # Again (the first rerun died before enqueueing): nothing counted twice, the same to-do list.
    producer = attach(r, inputs, options(tmp_path, inputs))
    [d] = producer.runs
    assert set(d.todo) == {"two", "three"} and d.resuming == {"three"} and audit(r) == 27
    producer.run(detach=True)
    held = set(ledger.holders(DS))
    assert held == {"two", "three"}
    # Attached again while a live chunk holds them: not enqueued twice.
    producer = attach(r, inputs, options(tmp_path, inputs))
    [d] = producer.runs
    assert not d.todo and set(d.chunk_samples.get(next(iter(d.chunk_samples)), [])) <= {"two", "three"}
    assert audit(r) == 27
    producer.release()


def test_a_conversation_ended_again_while_no_produce_was_attached_is_collected_not_recounted(
        r: "redis.Redis", tmp_path: Path, tokenizer_dir: Path) -> None:
    """The failed record on disk, the reopened conversation ended since by a worker (its new record in the
    stream): attach must not put the old record's count back in done, and the collector writes the new one."""
    inputs = inputs_for(tmp_path, tokenizer_dir, ALL)
    out = tmp_path / "out" / DS
    out.mkdir(parents=True)
    failed = record("three", [turn("three", 0, 7), turn("three", 1, 11)], "failed")
    (out / RESULTS).write_text(json.dumps(failed) + "\n")
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    ledger.reconcile(DS, [("three", 18)])
    assert ledger.reopen(DS, "three", failed["turns"]) == 1
    assert ledger.commit_turn(DS, "three", 2, 6, turn("three", 2, 6), chunk="c").committed
    header = {k: v for k, v in record("three", [], None).items() if k not in ("turns", "completion_tokens")}
    assert ledger.end_conversation(DS, "three", 3, header).ended
    producer = attach(r, inputs, options(tmp_path, inputs))
    [d] = producer.runs
    assert audit(r) == 24 and int(r.hget(keys.DatasetKeys(DS).done, "three") or 0) == 24
    assert "three" not in d.todo
    producer.step()
    assert d.out.tokens["three"] == 24 and "three" in d.done
    producer.release()


def test_dry_run_counts_conversations_and_turns_and_its_eta_takes_turns_in_sequence(
        tmp_path: Path, tokenizer_dir: Path) -> None:
    [p] = inputs_for(tmp_path, tokenizer_dir, ALL).prepared
    [q] = inputs_for(tmp_path, tokenizer_dir, LAST).prepared
    a = plan_dataset(p, budget=None, out_dir=tmp_path / "out", expect_mean=100, pilot_mean=None, pilot_n=0,
                     throughput=1000.0, in_flight=64)
    b = plan_dataset(q, budget=None, out_dir=tmp_path / "out", expect_mean=100, pilot_mean=None, pilot_n=0,
                     throughput=1000.0)
    assert (a.conversations, a.conversation_turns, a.requests_max, a.longest_conversation) == (2, 5, 6, 3)
    assert a.projected_tokens == 600 and b.projected_tokens == 300
    # 600 tokens at 1000 tok/s is 0.6 s, but the 3-turn conversation takes 3 turns of 100 tokens at 1000/64
    # tokens a second each.
    assert a.eta_s == pytest.approx(3 * 100 * 64 / 1000) and b.eta_s == pytest.approx(0.3)
    assert sequential_eta(600, 1000.0, 1, 100, 64) == pytest.approx(0.6)
    assert sequential_eta(600_000, 1000.0, 3, 100, 64) == pytest.approx(600)
    budgeted = plan_dataset(p, budget=250, out_dir=tmp_path / "out", expect_mean=100, pilot_mean=None, pilot_n=0,
                            throughput=None)
    assert budgeted.samples_needed == 2  # 2 requests a sample on average: 200 tokens a sample


def test_status_and_progress_count_turns(r: "redis.Redis", tmp_path: Path, tokenizer_dir: Path) -> None:
    inputs = inputs_for(tmp_path, tokenizer_dir, ALL)
    producer = attach(r, inputs, options(tmp_path, inputs))
    ledger = Ledger(r)
    for i, n in enumerate((3, 4)):
        assert ledger.commit_turn(DS, "three", i, n, turn("three", i, n), chunk="c").committed
    producer.step()
    line = producer.progress_line()
    assert "conversations 0/2 turns 2/5" in line, line
    [row] = all_status(r, [DS])
    assert (row.turns, row.conversations, row.conversations_open) == (2, 0, 1)
    assert "turns" in status_table([row]).splitlines()[0]
    producer.release()


def test_the_manifest_counts_conversations_by_why_they_stopped() -> None:
    stats = Stats()
    stats.add(record("a", [turn("a", 0, 3)], None))
    stats.add(record("b", [turn("b", 0, 3), turn("b", 1, 2)], "length"))
    stats.add(record("c", [turn("c", 0, 3)], "tool_mismatch"))
    assert stats.stopped() == {"budget": 0, "context": 0, "failed": 0, "length": 1, "reasoning_unclosed": 0,
                               "tool_mismatch": 1}
    assert (stats.incomplete, stats.multi_turn, stats.turns) == (2, 1, 4)


DATASET_ANSWERS = ("Hi, how can I help?", "First answer.", "Second answer.", "The old answer, dropped.")


@pytest.mark.e2e
def test_produce_regenerates_every_turn_on_real_workers(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                        tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    """`produce` (the default --turns all) with a real `rq worker` and the simulator: one record per
    conversation with every turn, and from the server's side every later turn's prompt holds the model's previous
    answer and none of the dataset's."""
    import subprocess

    from render.chat import load_tokenizer
    from tests import sim_log
    from tests.procs import produce_cmd, read_jsonl
    log = tmp_path / "requests.jsonl"
    sim = sim_factory(*SIM_ARGS, "--request-log", str(log))
    workers(sim.url).start("w0")
    out = tmp_path / "out"
    res = subprocess.run([*produce_cmd(), str(write_dataset(tmp_path)), "--tokenizer", str(tokenizer_dir),
                          "--max-tokens", "64", "--out", str(out), "--redis-url", redis_url, "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    recs = {x["id"]: x for x in read_jsonl(out / DS / RESULTS)}
    assert {sid: len(rec["turns"]) for sid, rec in recs.items()} == {"one": 1, "two": 2, "three": 3}
    assert json.loads((out / DS / RUN).read_text())["turns"] == ALL
    k = keys.DatasetKeys(DS)
    assert int(r.get(k.used) or 0) == sum(rec["completion_tokens"] for rec in recs.values())
    assert r.hlen(k.turns) == 0 and r.hlen(k.convs) == 0
    exchanges = sim_log.exchanges(log, load_tokenizer(str(tokenizer_dir)))
    for sid in ("two", "three"):
        seen = sim_log.of_sample(exchanges, DS, sid)
        assert len(seen) == len(recs[sid]["turns"])
        for i, answers in enumerate(seen):
            prompt = answers[-1].prompt
            assert not any(answer in prompt for answer in DATASET_ANSWERS), f"{sid} turn {i}: {prompt!r}"
            assert MESSAGES[sid][2 * i]["content"] in prompt
            if i:
                assert recs[sid]["turns"][i - 1]["content"].strip() in prompt


def test_a_started_conversation_of_a_closed_dataset_is_ended_with_the_turns_it_has(
        r: "redis.Redis", tmp_path: Path, tokenizer_dir: Path) -> None:
    """"two" started (turn 0 committed) by a worker that died, and the dataset is closed (its budget spent): no
    worker may resume it (a closed dataset starts no chunk), so the attached produce ends it with its one turn,
    stopped_by budget, collects it, and finishes: nothing counted is missing from the file."""
    inputs = inputs_for(tmp_path, tokenizer_dir, ALL)
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    assert ledger.commit_turn(DS, "two", 0, 4, turn("two", 0, 4) | {"content": "hi", "reasoning": None},
                              chunk="bq-chats-dead").committed
    echoed: list[str] = []
    producer = attach(r, inputs, options(tmp_path, inputs, budgets={DS: 4}), echoed)
    assert ledger.state(DS).status == "closed"
    producer.run()
    recs = [json.loads(line) for line in (tmp_path / "out" / DS / RESULTS).read_text().splitlines()]
    assert [(x["id"], x["stopped_by"], len(x["turns"])) for x in recs] == [("two", "budget", 1)]
    assert [m["role"] for m in recs[0]["messages"]] == ["system", "user"]  # what its one turn was sent
    assert audit(r) == 4 == sum(x["completion_tokens"] for x in recs)
    assert not r.hlen(keys.DatasetKeys(DS).convs)
    assert any("1 started conversations ended with the turns they have" in m for m in echoed)


def test_a_conversation_whose_workers_keep_dying_is_written_failed_unless_it_progresses(
        r: "redis.Redis", tmp_path: Path, tokenizer_dir: Path) -> None:
    """The three-deaths rule for a started conversation: reclaims without a new committed turn count to 3, and
    then its committed turns go to the file as a failed conversation (a rerun reopens it), never left counted in
    Redis and unwritten; a reclaim after a new committed turn starts the count again."""
    inputs = inputs_for(tmp_path, tokenizer_dir, ALL)
    ledger = Ledger(r)
    ledger.set_budget(DS, None)
    producer = attach(r, inputs, options(tmp_path, inputs))
    [d] = producer.runs
    assert ledger.commit_turn(DS, "three", 0, 4, turn("three", 0, 4) | {"content": "a", "reasoning": None}).committed
    for n in (1, 2):
        d.chunk_samples[f"dead{n}"] = ["three"]
        assert producer._release(d, f"dead{n}", reclaimed=True) == ["three"]
    assert ledger.commit_turn(DS, "three", 1, 6, turn("three", 1, 6) | {"content": "b", "reasoning": None}).committed
    for n in (3, 4):  # progress since: counted from 1 again
        d.chunk_samples[f"dead{n}"] = ["three"]
        assert producer._release(d, f"dead{n}", reclaimed=True) == ["three"]
    d.chunk_samples["dead5"] = ["three"]
    assert producer._release(d, "dead5", reclaimed=True) == []
    assert not ledger.failed(DS) and ledger.done_ids(DS) == {"three": 10}
    (_id, fields), = entries(r.xrange(keys.DatasetKeys(DS).results))
    header = json.loads(fields[b"r"])
    assert header["stopped_by"] == "failed" and header["failed_reason"] == "its chunk lost its worker 3 times"
    assert audit(r) == 10 and not r.hlen(keys.DatasetKeys(DS).convs)
    producer.release()


def test_the_turns_option_offers_exactly_the_modes_the_settings_know() -> None:
    """cli.py's --turns choices and default are producer/settings.py's."""
    from producer.cli import run_cmd
    from producer.settings import ALL, TURNS
    [option] = [p for p in run_cmd.params if p.name == "turns"]
    assert isinstance(option.type, click.Choice) and tuple(option.type.choices) == TURNS and option.default == ALL
