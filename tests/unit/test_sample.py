"""``produce sample`` (producer/ops/sample.py): which records it picks from a results file, how it shows one (fixed
record in, exact lines out), and what it says of a name the output folder does not have."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from budget.record import RECORD_VERSION
from producer.cli import main
from producer.errors import UsageError
from producer.ops.sample import pick, report, results_of, shorten, show
from producer.results import RESULTS, RUN, Result, iter_results

DS = "ds"


def record(sid: str, tokens: int, **extra: Any) -> dict[str, Any]:
    turn: dict[str, Any] = {"response": "ok", "reasoning": None, "content": "ok", "tool_calls": [], "prompt_tokens": 3,
            "completion_tokens": tokens, "finish_reason": "stop"}
    return {"record_version": RECORD_VERSION, "id": sid, "dataset": DS,
            "messages": [{"role": "user", "content": f"question {sid}"}], "turns": [turn],
            "completion_tokens": tokens, "sampling_params": {"max_new_tokens": 64}, **extra}


def results(out: Path, records: list[dict[str, Any]]) -> list[Result]:
    return list(iter_results(dataset(out, records)))


def dataset(out: Path, records: list[dict[str, Any]], tail: str = "") -> Path:
    """OUT/ds as a run leaves it: run.json (written at attach) and the results file."""
    folder = out / DS
    folder.mkdir(parents=True)
    (folder / RUN).write_text("{}", encoding="utf-8")
    path = folder / RESULTS
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail, encoding="utf-8")
    return path


def test_a_record_is_shown_with_its_last_user_turn_and_each_turns_parts(tmp_path: Path) -> None:
    rec = record("fc-7", 0, generation=1, stopped_by="length", messages=[
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is the weather?"},
        {"role": "user", "content": "And   in\nParis tomorrow, please?"}])
    rec["turns"] = [
        {"reasoning": "Need the tool.", "content": "", "completion_tokens": 20, "finish_reason": "stop",
         "tool_calls": [{"id": "c0", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
         "tool_call_errors": 1},
        {"reasoning": "x" * 30, "content": "Sunny.", "completion_tokens": 64, "finish_reason": "length",
         "reasoning_truncated": True},
    ]
    rec["completion_tokens"] = 84
    [result] = results(tmp_path, [rec])
    assert show(result, chars=20) == [
        "── fc-7 (generation 1) · line 1 · 2 turns · 84 completion tokens · stopped by length",
        "  user (last of 2): And in Paris tomorro… (+10 chars)",
        "  turn 1: 20 tokens, finish stop",
        "    reasoning (14 chars): Need the tool.",
        "    content: (none)",
        '    tool call: get_weather({"city": "Paris"})',
        "    1 tool call(s) did not parse (left in the content)",
        "  turn 2: 64 tokens, finish length, reasoning cut",
        "    reasoning (30 chars): xxxxxxxxxxxxxxxxxxxx… (+10 chars)",
        "    content (6 chars): Sunny.",
    ]


def test_chars_0_shows_every_text_whole_and_indents_its_lines(tmp_path: Path) -> None:
    assert shorten("a  b\n c", 0) == "a  b\n c"
    assert shorten("a  b\n c", 3) == "a b… (+2 chars)"
    rec = record("a", 5)
    rec["turns"][0]["content"] = "line one\nline two"
    assert show(results(tmp_path, [rec])[0], chars=0)[-1] == "    content (17 chars): line one\n      line two"


def test_the_pick_is_random_seeded_in_file_order_and_uniform(tmp_path: Path) -> None:
    path = dataset(tmp_path, [record(f"s{i}", i) for i in range(10)])
    first = pick(path, 3, seed=7)
    assert [r.number for r in first.results] == sorted(r.number for r in first.results)
    assert [r.key for r in pick(path, 3, seed=7).results] == [r.key for r in first.results]
    assert first.read == 10 and len(first.lengths.finished) == 10  # the lengths are of every record
    # Every line has its chance, not only the first three: over 300 seeds each is picked about 90 times.
    seen = Counter(r.number for seed in range(300) for r in pick(path, 3, seed=seed).results)
    assert sorted(seen) == list(range(1, 11)) and all(50 < n < 130 for n in seen.values()), seen
    assert [r.number for r in pick(path, 3, latest=True).results] == [8, 9, 10]
    assert [r.number for r in pick(path, 50, seed=1).results] == list(range(1, 11))
    assert pick(path, 0).results == [] and pick(path, 0).read == 10


def test_a_run_still_writing_is_read_up_to_its_torn_last_line(tmp_path: Path) -> None:
    path = dataset(tmp_path, [record("a", 5), record("b", 7)], tail='{"id": "c", "completion_tok')
    picked = pick(path, 5, seed=0)
    assert [r.key for r in picked.results] == ["a", "b"] and picked.end.torn
    text = report(DS, path, picked, 300)
    assert f"2 of 2 records of {path}; the last line is being written (or was torn by a crash), not read" in text
    assert path.read_text(encoding="utf-8").endswith('"completion_tok')  # read-only: the tail is left as it is


def test_a_dataset_that_has_no_results_yet_shows_none(tmp_path: Path) -> None:
    (tmp_path / DS).mkdir()
    (tmp_path / DS / RUN).write_text("{}", encoding="utf-8")
    path = results_of(tmp_path, DS)
    assert report(DS, path, pick(path, 3), 300).splitlines() == [f"0 records of {path}", "ds: no responses yet"]


@pytest.mark.parametrize("name", ["nope", "../ds", "ds.previous-20260101-000000"])
def test_a_name_the_output_folder_does_not_have_names_those_it_has(tmp_path: Path, name: str) -> None:
    dataset(tmp_path, [record("a", 5)])
    (tmp_path / "not_a_run").mkdir()  # no run.json: not a dataset
    (tmp_path / "ds.previous-20260101-000000").mkdir()  # --new-run's old output: not a dataset name
    (tmp_path / "ds.previous-20260101-000000" / RUN).write_text("{}", encoding="utf-8")
    with pytest.raises(UsageError, match=rf"no dataset '{name}' in {tmp_path} \(it has: ds\)$"):
        results_of(tmp_path, name)


def test_the_command_exits_2_with_one_error_line(tmp_path: Path) -> None:
    dataset(tmp_path, [record("a", 5)])
    res = CliRunner().invoke(main, ["sample", "b", "--out", str(tmp_path)])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr == f"Error: no dataset 'b' in {tmp_path} (it has: ds)\n"
    res = CliRunner().invoke(main, ["sample", DS, "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0 and [json.loads(x)["id"] for x in res.stdout.splitlines()] == ["a"]
