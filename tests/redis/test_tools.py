"""Per-record tool definitions (issue 29, High 1): a record's ``tools`` reach its chat template on every turn, are
validated with file, line and field, stay on every record and export row, and a template that ignores them is
named once per dataset."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from producer.cli import main
from producer.inputs.reader import read_dataset
from render.chat import Renderer, load_tokenizer
from tests import sim_log
from tests.families import build_family_tokenizer
from tests.procs import produce_cmd, read_jsonl


def tool(name: str, description: str) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


ASK = [{"role": "user", "content": "What is the weather like in Tokyo right now?"}]
WEATHER = [tool("get_weather", "Get the current weather for a city")]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in records))
    return path


def test_a_records_tools_reach_its_rendered_prompt(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A list or a JSON string of one (xlam): the prompt holds the template's tool block; a record without tools
    renders as before; batched rendering gives each conversation its own tools."""
    path = write_jsonl(tmp_path / "fc.jsonl", [
        {"id": "list", "messages": ASK, "tools": WEATHER},
        {"id": "string", "messages": ASK, "tools": json.dumps(WEATHER)},
        {"id": "none", "messages": ASK},
        {"id": "other", "messages": ASK, "tools": [tool("get_time", "The time in a city")]},
        {"messages": ASK, "tools": WEATHER},  # no id: tools are part of what the derived id hashes
        {"messages": ASK},
    ])
    read = read_dataset("fc", path)
    assert not read.invalid and not read.duplicates
    samples = {s.id: s for s in read.samples}
    assert samples["list"].tools == samples["string"].tools == WEATHER and samples["none"].tools is None
    tok = load_tokenizer(tokenizer_dir)
    renderer = Renderer(tok)
    batch = renderer.render_many([s.messages for s in read.samples], [s.tools for s in read.samples])
    prompts = {s.id: tok.decode(out.input_ids) for s, out in zip(read.samples, batch, strict=True)}
    assert "<tools>" in prompts["list"] and "Get the current weather for a city" in prompts["list"]
    assert prompts["string"] == prompts["list"]
    assert "<tools>" not in prompts["none"] and "get_weather" not in prompts["none"]
    assert "get_time" in prompts["other"] and "get_weather" not in prompts["other"]
    alone = renderer.render(samples["list"].messages, samples["list"].tools).input_ids
    assert alone == batch[0].input_ids and len(alone) > len(renderer.render(ASK).input_ids) + 100


GOOD = json.dumps({"id": 1, "messages": ASK, "tools": WEATHER}) + "\n"


@pytest.mark.parametrize("tools, reason", [
    ({"type": "function"}, "tools: expected a list of tool objects or a JSON string of one, got object"),
    ([WEATHER[0], "get_weather"], "tools[1]: expected a tool object, got string"),
    ([{}], "tools[0]: expected a tool object, got an empty object"),
    ("[{not json", "tools: a string that is not valid JSON"),
    (json.dumps(WEATHER[0]), "tools: a JSON string of object, expected a list of tool objects"),
])
def test_bad_tools_are_refused_with_file_line_and_field(tmp_path: Path, redis_url: str, r: "redis.Redis",
                                                        tokenizer_dir: Path, tools: Any, reason: str) -> None:
    r.set("someone-elses-key", "x")
    path = tmp_path / "fc.jsonl"
    path.write_text(GOOD + json.dumps({"id": 2, "messages": ASK, "tools": tools}) + "\n")
    args = [str(path), "--tokenizer", str(tokenizer_dir), "--max-tokens", "10", "--redis-url", redis_url]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert f"{path}:2: {reason}" in res.output and "Traceback" not in res.output
    assert r.dbsize() == 1, "nothing enqueued"
    skipped = CliRunner().invoke(main, [*args, "--skip-invalid", "--dry-run"], catch_exceptions=False)
    assert skipped.exit_code == 0, skipped.output
    assert f"skipped {path}:2: {reason}" in skipped.output and "1 samples ready" in skipped.output


def dry_run(*args: str) -> str:
    res = CliRunner().invoke(main, [*args, "--max-tokens", "10", "--dry-run", "--order", "file",
                                    "--redis-url", "redis://127.0.0.1:1"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return str(res.output)


def test_tools_field_names_the_field_and_a_template_that_ignores_tools_is_named_once(
        tmp_path: Path, tokenizer_dir: Path) -> None:
    path = write_jsonl(tmp_path / "fc.jsonl", [{"id": i, "messages": ASK, "functions": WEATHER} for i in range(3)])
    plain = dry_run(str(path), "--tokenizer", str(tokenizer_dir))
    named = dry_run(str(path), "--tokenizer", str(tokenizer_dir), "--tools-field", "functions")
    assert "fc: 3 samples ready (87 prompt tokens)" in plain  # "functions" is not the tools field: ignored
    assert "fc: 3 samples ready (" in named and "(87 prompt tokens)" not in named
    assert "ignores" not in named

    deaf = tmp_path / "deaf"  # the demo tokenizer with a template that renders no tools
    deaf.mkdir()
    for f in tokenizer_dir.iterdir():
        (deaf / f.name).write_bytes(f.read_bytes())
    config = json.loads((deaf / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + "
                               "'<|im_end|>\\n' }}{%- endfor %}{{- '<|im_start|>assistant\\n' }}")
    (deaf / "tokenizer_config.json").write_text(json.dumps(config))
    out = dry_run(str(path), "--tokenizer", str(deaf), "--tools-field", "functions")
    assert out.count('the chat template ignores "tools"') == 1
    assert f'{path}:1: the chat template ignores "tools": 3 samples of fc have tool definitions' in out


def catalogue(i: int) -> str:
    return f"Look an item up in catalogue {i}-only"  # only in the record's tools: never in its messages


def conversation(i: int) -> dict[str, Any]:
    """A function-calling conversation: ask, the dataset's call and its result, an answer, a follow-up."""
    name = f"lookup_{i}"
    tools = [tool(name, catalogue(i))]
    return {"id": f"fc-{i}", "tools": tools if i % 2 else json.dumps(tools), "messages": [
        {"role": "user", "content": f"Please look up item {i} for me."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": name, "arguments": '{"query": "item"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"price": 42}'},
        {"role": "assistant", "content": "It costs 42."},
        {"role": "user", "content": "Thanks. And what about the next item?"}]}


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_turns_all_renders_every_turn_with_the_records_tools_and_keeps_them(
        redis_url: str, tmp_path: Path, sim_factory: Any, workers: Any) -> None:
    """produce -> real rq workers -> the simulator (which calls a function its prompt declares): every turn's
    prompt, as the server saw it, holds the record's tools; the model calls them, so conversations go on past
    turn 0; records and export rows carry the tools; the tokens export re-renders every prompt exactly."""
    tok_dir = build_family_tokenizer(tmp_path / "tok", "qwen3")
    log = tmp_path / "requests.jsonl"
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "60", "--seed", "3", "--reasoning-style", "qwen3",
                      "--tokenizer", str(tok_dir), "--request-log", str(log))
    pool = workers(sim.url)
    pool.start("w0")
    pool.start("w1")
    data = write_jsonl(tmp_path / "fc.jsonl", [conversation(i) for i in range(12)])
    out = tmp_path / "out"
    res = subprocess.run([*produce_cmd(), str(data), "--tokenizer", str(tok_dir), "--reasoning-parser", "qwen3",
                          "--max-tokens", "300", "--turns", "all", "--chunk-size", "3", "--out", str(out),
                          "--redis-url", redis_url], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    assert "ignores" not in res.stderr + res.stdout

    recs = {x["id"]: x for x in read_jsonl(out / "fc" / "raw_responses.jsonl")}
    assert len(recs) == 12
    exchanges = sim_log.exchanges(log, load_tokenizer(str(tok_dir)))
    later = 0
    for i in range(12):
        rec = recs[f"fc-{i}"]
        assert rec["tools"] == [tool(f"lookup_{i}", catalogue(i))], "the record carries its tools, parsed"
        seen = sim_log.of_sample(exchanges, "fc", rec["id"])
        assert len(seen) == len(rec["turns"])
        for turn, answers in enumerate(seen):
            prompt = answers[-1].prompt
            assert catalogue(i) in prompt and "<tools>" in prompt, f"{rec['id']} turn {turn}: no tools"
            assert all(catalogue(j) not in prompt for j in range(12) if j != i)
            later += turn > 0
    assert later >= 12, "conversations went on past turn 0"
    assert any(rec["turns"][0]["tool_calls"] for rec in recs.values()), "the model called the tools it was given"

    exported = subprocess.run([*produce_cmd(), "export", "fc", "--out", str(out), "--format", "openai-messages",
                               "--per-turn"], capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    rows = read_jsonl(out / "fc" / "openai-messages.jsonl")
    assert rows and all(row["tools"] == recs[row["id"]]["tools"] for row in rows)
    from producer.export.writer import ExportOptions, export_dataset
    report = export_dataset(out / "fc", tmp_path / "tokens.jsonl", ExportOptions(format="tokens"),
                            tokenizer=load_tokenizer(str(tok_dir)))
    assert report.prompt_mismatch == 0, "every turn's prompt re-renders, with the record's tools, to what was sent"
    assert report.written > 12


def test_a_parquet_tools_column_is_read_as_the_jsonl_one(tmp_path: Path) -> None:
    """A struct column fills missing keys with null (dropped, as inside turns) and a row without tools has none."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    rows = [{"id": "a", "messages": ASK, "tools": WEATHER}, {"id": "b", "messages": ASK, "tools": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "fc.parquet")
    read = read_dataset("fc", tmp_path / "fc.parquet")
    assert not read.invalid
    assert [s.tools for s in read.samples] == [WEATHER, None]


def test_batched_rendering_keeps_each_records_key_order(tokenizer_dir: Path) -> None:
    """Two records whose tools differ only in key order are two prompts (the template renders the order given)."""
    renderer = Renderer(load_tokenizer(tokenizer_dir))
    reordered = [{"function": WEATHER[0]["function"], "type": "function"}]
    batch = renderer.render_many([ASK, ASK], [WEATHER, reordered])
    assert [out.input_ids for out in batch] == [renderer.render(ASK, WEATHER).input_ids,
                                                renderer.render(ASK, reordered).input_ids]
    assert batch[0].input_ids != batch[1].input_ids
