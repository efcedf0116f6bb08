"""One reader of ``raw_responses.jsonl`` (producer/results.py ``iter_results``): the collector, ``--dry-run`` and
``produce export`` read a file the same way, up to a torn last line or the first line that is not a record.
The collector cuts the file there, a plan stops counting there, an export refuses a file with a bad line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from budget.record import OTHER_VERSION, RECORD_VERSION
from producer.errors import UsageError
from producer.generations import sample_key
from producer.plan import existing_turns
from producer.results import RESULTS, ExportError, ReadEnd, Results, ResultsFile, iter_results

DS = "ds"


def record(sid: str, tokens: int, **extra: Any) -> dict[str, Any]:
    """A record: what export's check asks of one, and what the collector and the plan read."""
    turn = {"response": "ok", "content": "ok", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": tokens}
    return {"record_version": RECORD_VERSION, "id": sid, "dataset": DS, "messages": [{"role": "user", "content": "hi"}],
            "turns": [turn], "completion_tokens": tokens, **extra}


def write(out: Path, lines: list[str], tail: str = "") -> Path:
    path = out / DS / RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines) + tail, encoding="utf-8")
    return path


def test_a_torn_tail_ends_every_reader_at_the_last_complete_line(tmp_path: Path) -> None:
    lines = [json.dumps(record("a", 5)), json.dumps(record("b", 7, generation=1))]
    tail = '{"id": "c", "completion_tok'
    path = write(tmp_path, lines, tail)
    end = ReadEnd()
    results = list(iter_results(path, end))
    assert [(r.number, r.key, r.tokens) for r in results] == [(1, "a", 5), (2, sample_key("b", 1), 7)]
    assert end.torn and end.bad_line is None
    assert existing_turns(tmp_path, DS) == (2, 12, 2)
    export = Results(path)
    assert [n for n, _rec in export] == [1, 2] and export.torn_tail
    out = ResultsFile(path)  # the collector cuts the tail, and only it
    out.close()
    assert out.truncated_bytes == len(tail) and out.total_tokens == 12
    assert path.read_text(encoding="utf-8") == "".join(line + "\n" for line in lines)


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    (json.dumps({k: v for k, v in record("x", 4).items() if k != "completion_tokens"}), "completion_tokens missing"),
    (json.dumps(record("x", 4, generation="first")), "generation must be a whole number"),
])
def test_a_line_that_is_not_a_record_ends_every_reader_there(tmp_path: Path, bad: str, message: str) -> None:
    good = [json.dumps(record("a", 5)), json.dumps(record("b", 7))]
    path = write(tmp_path, [*good, bad, json.dumps(record("c", 9))])
    end = ReadEnd()
    assert [r.number for r in iter_results(path, end)] == [1, 2]
    assert end.bad_line == 3 and not end.torn
    assert existing_turns(tmp_path, DS) == (2, 12, 2)  # nothing after a line it cannot read is counted
    with pytest.raises(ExportError, match=rf"{RESULTS}:3: {message}"):
        list(Results(path))
    out = ResultsFile(path)  # the collector trusts nothing after it: cut from the bad line on
    out.close()
    assert out.total_tokens == 12 and set(out.tokens) == {"a", "b"}
    assert path.read_text(encoding="utf-8") == "".join(line + "\n" for line in good)


@pytest.mark.parametrize("version", [None, 1, 3])
def test_a_record_of_another_version_is_refused_by_every_reader_and_left_as_it_is(
        tmp_path: Path, version: int | None) -> None:
    """No reader converts a record another budgetq version wrote (version 1 was flat, without ``record_version``):
    the collector, the plan and the export all refuse it, naming the file and line, and nothing is cut."""
    other = {k: v for k, v in record("b", 7).items() if k != "record_version"}
    if version is not None:
        other["record_version"] = version
    path = write(tmp_path, [json.dumps(record("a", 5)), json.dumps(other)])
    before = path.read_bytes()
    message = rf"{RESULTS}:2: a record of record_version {version!r}, {OTHER_VERSION}"
    for read in (lambda: list(iter_results(path)), lambda: existing_turns(tmp_path, DS),
                 lambda: list(Results(path)), lambda: ResultsFile(path)):
        with pytest.raises(UsageError, match=message) as err:
            read()
        assert err.value.exit_code == 2
    assert path.read_bytes() == before
