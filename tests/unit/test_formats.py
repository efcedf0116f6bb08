"""Tests for the input formats besides JSONL: JSON arrays, Parquet, Hugging Face datasets, folders; field mapping.

Parquet and Hugging Face datasets are built in tmp dirs; their tests skip where pyarrow/datasets are missing.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.inputs import columnar as columnar
from producer.inputs.reader import (
    FieldMapping,
    InputError,
    Problem,
    ReadResult,
    parse_dataset_arg,
    read_all,
    read_dataset,
)
from tests.record_strategies import json_values, plausible, records

FIXTURES = Path(__file__).parents[1] / "fixtures"
INSTALL_HINT = "pip install 'budgetq[formats]'"


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def reasons(result: ReadResult) -> list[tuple[int | None, str]]:
    return [(p.line, p.reason) for p in result.invalid]


def fatal(path: Path, **kwargs: Any) -> str:
    with pytest.raises(InputError) as info:
        read_dataset("d", path, **kwargs)
    return str(info.value)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """Rows as a Parquet file; pyarrow merges the struct fields of all rows, filling missing ones with null."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({**columns_of(rows), **extra}), path)
    return path


def columns_of(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Rows as columns: Dataset.from_list and Table.from_pylist would take the columns of the first row only."""
    names = list(dict.fromkeys(k for row in rows for k in row))
    return {name: [row.get(name) for row in rows] for name in names}


@pytest.fixture
def hf(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)  # the reader sets them: restored after the test
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    yield datasets


# Records every format must read alike: the three shapes, ids, old answers, extra keys, bad records.
PARITY: list[dict[str, Any]] = [
    {"id": "m1", "messages": [{"role": "system", "content": "s"}, user("q"), {"role": "assistant", "content": "a"}]},
    {"id": "2", "prompt": "two"},  # Arrow columns hold one type: ids are strings here
    {"conversations": [{"from": "human", "value": "c"}, {"from": "gpt", "value": "old"}]},
    {"messages": [user("call f"), {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                  {"role": "tool", "content": "42", "tool_call_id": "c1"}]},
    {"prompt": ""},
    {"id": "m1", "prompt": "duplicate"},
    {"messages": [{"role": "bot", "content": "x"}]},
]
PARITY_BAD = ["prompt: empty string",
              'messages[0].role: expected one of system, user, assistant, tool, got "bot"']


def check_parity(result: ReadResult) -> None:
    assert [s.id for s in result.samples][:2] == ["m1", "2"]
    assert [s.messages for s in result.samples] == [
        [{"role": "system", "content": "s"}, user("q")],
        [user("two")],
        [user("c")],
        PARITY[3]["messages"],
    ]
    assert [p.reason for p in result.invalid] == PARITY_BAD
    assert [p.reason for p in result.duplicates] == ['duplicate id "m1" (first seen on '
                                                     f'{result.samples[0].unit} {result.samples[0].line})']


# --- JSON arrays ----------------------------------------------------------------------------------------------

def test_json_array_reports_the_line_each_record_starts_on() -> None:
    path = FIXTURES / "bad_records.json"
    result = read_dataset("bad_records", path)
    assert [(s.id, s.line, s.unit) for s in result.samples] == [("ok-1", 2, "line"), ("7", 24, "line")]
    assert result.samples[0].messages == [{"role": "system", "content": "Be brief."}, user("hi")]
    assert reasons(result) == [
        (10, "prompt: empty string"),
        (11, "not a JSON object"),
        (12, 'no "messages", "prompt" or "conversations" field'),
        (13, "conversations[1].from: expected one of system, human, user, gpt, assistant, function_call, tool, "
             'observation, function, got "bot"'),
        (19, '"id" must be a string or an integer, got boolean'),
        (20, "not valid JSON (NaN is not allowed)"),
        (21, "prompt: contains an unpaired surrogate (\\ud800-\\udfff escape), which cannot be encoded as UTF-8"),
        (22, "messages[0].content: null (allowed only on an assistant turn with tool_calls)"),
    ]
    assert [str(p) for p in result.duplicates] == [f'{path}:23: duplicate id "ok-1" (first seen on line 2)']
    assert all(str(p).startswith(f"{path}:") for p in result.invalid)


def test_json_array_reads_like_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(json.dumps(PARITY, indent=2))
    check_parity(read_dataset("d", path))
    one_line = tmp_path / "one.json"
    one_line.write_text(json.dumps(PARITY))  # everything on line 1
    result = read_dataset("one", one_line)
    check_parity(result)
    assert {s.line for s in result.samples} == {1}
    jsonl = read_dataset("d", write_jsonl(tmp_path / "d.jsonl", PARITY))
    assert [(s.id, s.messages) for s in jsonl.samples] == [(s.id, s.messages) for s in result.samples]


def test_json_array_huge_integer_rejects_only_its_record(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text('[{"prompt": "a"},\n {"id": ' + "9" * 5000 + ', "prompt": "x"},\n {"prompt": "b"}]')
    result = read_dataset("d", path)
    assert [s.line for s in result.samples] == [1, 3]
    [(line, reason)] = reasons(result)
    assert line == 2 and reason.startswith("not valid JSON (Exceeds the limit")


@pytest.mark.parametrize("text, message", [
    ('[{"prompt": "a"},\n {"prompt": "b"}\n {"prompt": "c"}]',
     ":3: not valid JSON (Expecting ',' delimiter at column 2)"),
    ('[{"prompt": "a"},\n]', ":2: not valid JSON (Expecting value at column 1)"),
    ('[{"prompt": "a"}]\n[]', ":2: not valid JSON (Extra data at column 1)"),
    ('[{"prompt": "a"},\n {"prompt": "b"', ":2: not valid JSON (Expecting ',' delimiter at column 16)"),
    ('[{"prompt": "a"}', ":1: not valid JSON (Unterminated array at column 17)"),
    ("[\n" + "[" * 100_000, ":2: not valid JSON (nested too deeply)"),
])
def test_json_array_syntax_errors_are_fatal(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "d.json"
    path.write_text(text)
    assert fatal(path) == f"{path}{message}"
    with pytest.raises(InputError) as info:
        read_all([str(path)], skip_invalid=True)  # where the next record starts is unknown: not skippable
    assert str(info.value) == f"{path}{message}"


def test_json_messages_ending_in_at_do_not_double_it(tmp_path: Path) -> None:
    # json's "Invalid control character at" and "Unterminated string starting at" once read "at at column".
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a\tb"}\n{"prompt": "ab')
    assert reasons(read_dataset("d", path)) == [(1, "not valid JSON (Invalid control character at column 14)"),
                                                (2, "not valid JSON (Unterminated string starting at column 12)")]
    array = tmp_path / "d.json"
    array.write_bytes(b'[{"prompt": "a\tb"}]')
    assert fatal(array) == f"{array}:1: not valid JSON (Invalid control character at column 15)"


def test_json_array_bad_utf8_is_fatal(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_bytes(b'[{"prompt": "a"},\n {"prompt": "caf\xe9"}]')
    assert fatal(path) == f"{path}:2: not valid UTF-8 (byte 0xe9 at column 17)"


def test_json_array_bom_whitespace_and_empty(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_bytes(b'\xef\xbb\xbf\n  [ {"prompt": "a"} , {"prompt": "b"} ]\n\n')
    assert [(s.line, s.messages) for s in read_dataset("d", path).samples] == [(2, [user("a")]), (2, [user("b")])]
    path.write_text(" [ ] ")
    result = read_dataset("d", path)
    assert result.samples == [] and result.invalid == []
    with pytest.raises(InputError, match="no valid samples"):
        read_all([str(path)], skip_invalid=False)


def test_dot_json_holding_json_lines_is_read_as_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_bytes(b'{"prompt": "a"}\r\n{"prompt": "b\xe2\x80\xa8c"}\n\n{oops\n')
    result = read_dataset("d", path)
    assert [(s.line, s.messages[0]["content"]) for s in result.samples] == [(1, "a"), (2, "b\u2028c")]
    assert reasons(result) == [(3, "empty line"), (4, "not valid JSON (Expecting property name enclosed in double "
                                                    "quotes at column 2)")]


def test_json_array_hundred_thousand_records(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps([{"messages": [user(f"question {i}"), {"role": "assistant", "content": "old"}]}
                                for i in range(100_000)], indent=1))
    result = read_dataset("big", path)
    assert len(result.samples) == 100_000 and not result.invalid
    assert [s.line for s in result.samples[:2]] == [2, 14]  # indent=1: 12 lines a record


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(plausible | records | json_values, max_size=8), st.booleans())
def test_fuzz_json_array_reads_as_jsonl(tmp_path: Path, body: list[Any], ascii_only: bool) -> None:
    texts = [json.dumps(r, ensure_ascii=ascii_only) for r in body]
    array = tmp_path / "fuzz.json"
    array.write_bytes(("[\n" + ",\n".join(texts) + "\n]\n").encode("utf-8", "surrogatepass"))
    jsonl = tmp_path / "fuzz.jsonl"
    jsonl.write_bytes("".join(t + "\n" for t in texts).encode("utf-8", "surrogatepass"))
    a, b = read_dataset("fuzz", array), read_dataset("fuzz", jsonl)
    # Record i is on line i + 2 of the array and line i + 1 of the JSONL file: otherwise the same.
    assert [(s.id, s.messages, s.line - 1) for s in a.samples] == [(s.id, s.messages, s.line) for s in b.samples]
    assert [(p.reason, (p.line or 0) - 1) for p in a.invalid] == [(p.reason, p.line) for p in b.invalid]
    assert len(a.duplicates) == len(b.duplicates)


# --- Parquet --------------------------------------------------------------------------------------------------

def test_parquet_reads_like_jsonl(tmp_path: Path) -> None:
    result = read_dataset("d", write_parquet(tmp_path / "d.parquet", PARITY))
    check_parity(result)
    assert [(s.line, s.unit) for s in result.samples] == [(1, "row"), (2, "row"), (3, "row"), (4, "row")]
    path = tmp_path / "d.parquet"
    assert [str(p) for p in result.invalid] == [f"{path}: row 5: {PARITY_BAD[0]}", f"{path}: row 7: {PARITY_BAD[1]}"]
    assert str(result.duplicates[0]) == f'{path}: row 6: duplicate id "m1" (first seen on row 1)'


def test_parquet_null_filled_struct_fields_are_dropped(tmp_path: Path) -> None:
    # One row's "name" and "tool_calls" become null fields of every other row's turns: they are not kept.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    rows: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": "u", "name": "alice"},
                      {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "content": "r", "tool_call_id": "c1"}]},
        {"messages": [user("plain")]},
    ]
    result = read_dataset("d", write_parquet(tmp_path / "d.parquet", rows))
    assert result.invalid == []
    assert [s.messages for s in result.samples] == [rows[0]["messages"], [user("plain")]]
    # The same records from JSONL derive the same ids.
    jsonl = read_dataset("d", write_jsonl(tmp_path / "d.jsonl", rows))
    assert [s.id for s in jsonl.samples] == [s.id for s in result.samples]


def test_parquet_rows_count_across_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(columnar, "BATCH_ROWS", 3)
    rows = [{"prompt": f"p{i}" if i % 4 else ""} for i in range(10)]
    result = read_dataset("d", write_parquet(tmp_path / "d.parquet", rows))
    assert [s.line for s in result.samples] == [2, 3, 4, 6, 7, 8, 10]
    assert reasons(result) == [(1, "prompt: empty string"), (5, "prompt: empty string"), (9, "prompt: empty string")]


def test_parquet_other_columns_are_never_converted(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "a"}],
                         image=pa.array([b"\x89PNG\xff"], type=pa.binary()),
                         when=pa.array([datetime.datetime(2024, 1, 1)]))
    assert read_dataset("d", path).samples[0].messages == [user("a")]


@pytest.mark.parametrize("column, reason", [
    ({"id": [1.0, None]}, '"id" must be a string or an integer, got number'),
    ({"prompt": [b"bytes", b"x"]}, "prompt: expected a string, got bytes"),
])
def test_parquet_column_types(tmp_path: Path, column: dict[str, Any], reason: str) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    data = {"prompt": ["a", "b"], **column}
    pq.write_table(pa.table(data), tmp_path / "d.parquet")
    assert reasons(read_dataset("d", tmp_path / "d.parquet"))[0] == (1, reason)


def test_parquet_values_json_cannot_carry_reject_the_row(tmp_path: Path) -> None:
    rows = [
        {"messages": [user("ok"), {"role": "user", "content": "u", "meta": {"when": datetime.datetime(2024, 1, 1)}}]},
        {"messages": [{"role": "user", "content": "u", "meta": {"when": None, "score": float("nan")}}]},
        {"messages": [user("fine")]},
    ]
    result = read_dataset("d", write_parquet(tmp_path / "d.parquet", rows))
    assert reasons(result) == [
        (1, "messages[1].meta.when: a value of type datetime cannot be sent as JSON"),
        (2, "messages[0].meta.score: nan is not allowed (not valid in JSON)"),
    ]
    assert [s.line for s in result.samples] == [3]


def test_parquet_bad_utf8_is_a_bad_row(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    raw = pa.array([b"ok", b"caf\xe9", b"fine"], type=pa.binary())
    pq.write_table(pa.table({"prompt": pa.Array.from_buffers(pa.string(), 3, raw.buffers())}), tmp_path / "d.parquet")
    result = read_dataset("d", tmp_path / "d.parquet")
    assert [s.line for s in result.samples] == [1, 3]
    assert reasons(result) == [(2, "not valid UTF-8 (byte 0xe9 in a string column)")]


def test_parquet_without_record_columns(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "d.parquet", [{"text": "a", "label": 1}])
    assert fatal(path) == f'{path}: no "messages", "prompt" or "conversations" column (columns: text, label)'
    assert fatal(path, mapping=FieldMapping(prompt_field="question")) == \
        f'{path}: no "messages", "question" or "conversations" column (columns: text, label)'


def test_not_a_parquet_file(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    path = tmp_path / "d.parquet"
    path.write_text('{"prompt": "a"}\n')
    assert fatal(path).startswith(f"{path}: not a readable Parquet file (")
    assert fatal(tmp_path / "missing.parquet") == f"{tmp_path / 'missing.parquet'}: file not found"


def test_parquet_through_read_all(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "ok"}] + [{"prompt": ""}] * 60)
    with pytest.raises(InputError) as info:
        read_all([str(path)], skip_invalid=False)
    lines = str(info.value).splitlines()
    assert lines[0] == f"{path}: row 2: prompt: empty string"
    assert lines[50:] == [f"{path}: ... and 10 more invalid rows", "use --skip-invalid to skip bad rows"]
    [result] = read_all([f"math={path}"], skip_invalid=True)
    assert result.name == "math" and len(result.samples) == 1 and len(result.invalid) == 60


def test_missing_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert fatal(path) == f"{path}: reading Parquet needs pyarrow: {INSTALL_HINT}"


# --- Hugging Face datasets ------------------------------------------------------------------------------------

def test_save_to_disk_dataset(tmp_path: Path, hf: Any) -> None:
    path = tmp_path / "gsm"
    hf.Dataset.from_dict(columns_of(PARITY[:4] + [{"prompt": ""}])).save_to_disk(str(path))
    # A save_to_disk folder holds .arrow and .json files: it is never read as a plain folder.
    assert (path / "state.json").is_file()
    result = read_dataset("gsm", path)
    assert [s.messages for s in result.samples][:3] == [[{"role": "system", "content": "s"}, user("q")],
                                                        [user("two")], [user("c")]]
    assert result.samples[3].messages == PARITY[3]["messages"]
    assert [str(p) for p in result.invalid] == [f"{path}: row 5: prompt: empty string"]
    assert parse_dataset_arg(str(path)) == ("gsm", path)
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"


def test_save_to_disk_after_select_keeps_the_selected_order(tmp_path: Path, hf: Any) -> None:
    ds = hf.Dataset.from_list([{"prompt": f"p{i}"} for i in range(6)]).select([5, 1, 3])
    ds.save_to_disk(str(tmp_path / "d"))
    result = read_dataset("d", tmp_path / "d")
    assert [(s.line, s.messages[0]["content"]) for s in result.samples] == [(1, "p5"), (2, "p1"), (3, "p3")]


def test_save_to_disk_dataset_dict(tmp_path: Path, hf: Any) -> None:
    ds = hf.Dataset.from_list([{"prompt": "a"}])
    hf.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "one"))
    assert len(read_dataset("one", tmp_path / "one").samples) == 1
    hf.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "two"))
    assert fatal(tmp_path / "two") == (f"{tmp_path / 'two'}: a DatasetDict with splits test, train: give one "
                                       f"split's folder, e.g. {tmp_path / 'two' / 'train'}")
    assert len(read_dataset("train", tmp_path / "two" / "train").samples) == 1


def test_save_to_disk_with_field_mapping(tmp_path: Path, hf: Any) -> None:
    rows = [{"uid": "a", "chat": [user("hi")]}, {"uid": "b", "chat": [{"role": "bot", "content": "x"}]}]
    hf.Dataset.from_dict(columns_of(rows)).save_to_disk(str(tmp_path / "d"))
    mapping = FieldMapping(messages_field="chat", id_field="uid", system_prompt="S")
    result = read_dataset("d", tmp_path / "d", mapping=mapping)
    assert [(s.id, s.messages) for s in result.samples] == [("a", [{"role": "system", "content": "S"}, user("hi")])]
    assert reasons(result) == [(2, 'chat[0].role: expected one of system, user, assistant, tool, got "bot"')]
    assert fatal(tmp_path / "d").endswith('no "messages", "prompt" or "conversations" column (columns: uid, chat)')


def test_broken_save_to_disk_folder(tmp_path: Path, hf: Any) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "state.json").write_text("{}")
    assert fatal(tmp_path / "d").startswith(f"{tmp_path / 'd'}: cannot load the saved Hugging Face dataset (")


def test_missing_datasets_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert fatal(tmp_path / "d") == (f"{tmp_path / 'd'}: reading a Hugging Face dataset folder needs the datasets "
                                     f"package: {INSTALL_HINT}")


# --- plain folders --------------------------------------------------------------------------------------------

def test_folder_of_data_files(tmp_path: Path) -> None:
    folder = tmp_path / "mix"
    (folder / "part2").mkdir(parents=True)
    a = write_jsonl(folder / "a.jsonl", [{"id": "x", "prompt": "a1"}, {"prompt": ""}])
    b = folder / "part2" / "b.json"
    b.write_text('[\n {"id": "x", "prompt": "dup"},\n {"prompt": "b2"}\n]')
    (folder / ".hidden").mkdir()
    write_jsonl(folder / ".hidden" / "c.jsonl", [{"prompt": "never read"}])
    write_jsonl(folder / ".d.jsonl", [{"prompt": "never read"}])
    (folder / "README.md").write_text("# not data")
    name, path = parse_dataset_arg(str(folder))
    assert (name, path) == ("mix", folder)
    result = read_dataset(name, path)
    assert [(s.path, s.line, s.messages[0]["content"]) for s in result.samples] == [(str(a), 1, "a1"),
                                                                                   (str(b), 3, "b2")]
    assert [str(p) for p in result.invalid] == [f"{a}:2: prompt: empty string"]
    assert [str(p) for p in result.duplicates] == [f'{b}:2: duplicate id "x" (first seen at {a}:1)']
    assert result.samples[1].problem("too long") == Problem(str(b), 3, "too long")


def test_folder_with_parquet_files(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    first = write_parquet(folder / "part-00000.parquet", [{"prompt": "a"}, {"prompt": ""}])
    write_parquet(folder / "part-00001.parquet", [{"prompt": "b"}])
    result = read_dataset("shards", folder)
    assert [(Path(s.path).name, s.line, s.unit) for s in result.samples] == [("part-00000.parquet", 1, "row"),
                                                                             ("part-00001.parquet", 1, "row")]
    assert [str(p) for p in result.invalid] == [f"{first}: row 2: prompt: empty string"]


def test_folder_mixing_lines_and_rows_through_read_all(tmp_path: Path) -> None:
    folder = tmp_path / "mix"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"prompt": ""}])
    write_parquet(folder / "b.parquet", [{"prompt": ""}, {"prompt": "ok"}])
    with pytest.raises(InputError) as info:
        read_all([str(folder)], skip_invalid=False)
    assert str(info.value).splitlines()[-1] == "use --skip-invalid to skip bad records"


def test_folder_with_several_splits_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "hub"
    (folder / "data").mkdir(parents=True)
    write_jsonl(folder / "data" / "train-00000-of-00001.jsonl", [{"prompt": "a"}])
    write_jsonl(folder / "data" / "test-00000-of-00001.jsonl", [{"prompt": "b"}])
    assert fatal(folder) == (f"{folder}: holds files of several splits: test (data/test-00000-of-00001.jsonl), "
                             "train (data/train-00000-of-00001.jsonl); a dataset is one split: give a folder or "
                             "file holding only one")
    (folder / "data" / "test-00000-of-00001.jsonl").unlink()
    assert len(read_dataset("hub", folder).samples) == 1


def test_folder_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v1.2").mkdir()
    with pytest.raises(InputError, match='the folder name "v1.2" cannot be a dataset name'):
        parse_dataset_arg("v1.2")
    assert parse_dataset_arg("ok=v1.2") == ("ok", Path("v1.2"))
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert parse_dataset_arg(".") == ("sub", Path("."))


# --- field mapping --------------------------------------------------------------------------------------------

def test_field_mapping_in_every_format(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = [{"uid": 1, "question": "q1"}, {"uid": 2, "chat": [user("q2")]}, {"uid": 3, "turns": []},
               {"uid": 4, "question": "x", "chat": [user("y")]},
               {"uid": 5, "question": None, "chat": None, "turns": None}]
    mapping = FieldMapping(messages_field="chat", prompt_field="question", conversations_field="turns",
                           id_field="uid")
    expected_bad = [(3, "turns: empty list"), (4, 'more than one of "chat", "question", "turns"'),
                    (5, '"chat", "question" and "turns" are null')]
    json_path = tmp_path / "d.json"
    json_path.write_text(json.dumps(records, indent=0))
    paths = [write_jsonl(tmp_path / "d.jsonl", records), json_path]
    if columnar_available():
        paths.append(write_parquet(tmp_path / "d.parquet", records))
    for path in paths:
        result = read_dataset("d", path, mapping=mapping)
        assert [(s.id, s.messages) for s in result.samples] == [("1", [user("q1")]), ("2", [user("q2")])], path
        assert [p.reason for p in result.invalid] == [r for _, r in expected_bad], path


def columnar_available() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def test_read_all_takes_the_mapping(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "x"}])
    with pytest.raises(InputError, match='no "messages", "prompt" or "conversations" field'):
        read_all([str(path)], skip_invalid=False)
    [result] = read_all([str(path)], skip_invalid=False, mapping=FieldMapping(prompt_field="q"))
    assert result.samples[0].messages == [user("x")]


def test_system_prompt_is_added_only_where_there_is_none(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = [
        {"prompt": "p"},
        {"messages": [{"role": "system", "content": "theirs"}, user("m")]},
        {"messages": [user("u"), {"role": "assistant", "content": "a"}, {"role": "system", "content": "late"},
                      user("v")]},
        {"conversations": [{"from": "human", "value": "c"}]},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    result = read_dataset("d", path, mapping=FieldMapping(system_prompt="Be brief."))
    ours = {"role": "system", "content": "Be brief."}
    assert [s.messages for s in result.samples] == [
        [ours, user("p")], records[1]["messages"], records[2]["messages"], [ours, user("c")]]
    # The derived id hashes what is sent, so it changes with the system prompt; a given id does not.
    plain = read_dataset("d", path)
    assert [a.id == b.id for a, b in zip(result.samples, plain.samples, strict=True)] == [False, True, True, False]


def test_empty_system_prompt_is_a_prompt(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p"}])
    result = read_dataset("d", path, mapping=FieldMapping(system_prompt=""))
    assert result.samples[0].messages == [{"role": "system", "content": ""}, user("p")]


@pytest.mark.parametrize("kwargs, message", [
    ({"messages_field": ""}, "messages_field: expected a non-empty field name"),
    ({"prompt_field": "messages"}, "must differ"),
    ({"id_field": "prompt"}, "must differ"),
    ({"system_prompt": "\ud800"}, "system_prompt: not valid UTF-8"),
])
def test_bad_field_mapping(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FieldMapping(**kwargs)


# --- imports --------------------------------------------------------------------------------------------------

def test_reading_jsonl_imports_neither_pyarrow_nor_datasets(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}])
    json_path = tmp_path / "e.json"
    json_path.write_text('[{"prompt": "b"}]')
    code = ("import sys; from pathlib import Path; from producer.inputs.reader import read_all; "
            f"read_all([{str(path)!r}, {str(json_path)!r}], skip_invalid=False); "
            "print(sorted(m for m in ('pyarrow', 'datasets', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[]"
