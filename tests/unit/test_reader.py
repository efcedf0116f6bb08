"""Tests for producer.inputs.reader: the dataset formats, every rejection reason, and a fuzz that it never crashes."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.inputs.reader import (
    InputError,
    Problem,
    ReadResult,
    check_unique_names,
    parse_dataset_arg,
    read_all,
    read_dataset,
)
from tests.record_strategies import json_values, plausible, records, user

FIXTURES = Path(__file__).parents[1] / "fixtures"


def write_lines(path: Path, records: list[Any]) -> Path:
    """Write records as JSONL; str and bytes items are written as they are (for broken lines)."""
    out = []
    for r in records:
        if isinstance(r, bytes):
            out.append(r)
        elif isinstance(r, str):
            out.append(r.encode("utf-8"))
        else:
            out.append(json.dumps(r).encode("utf-8"))
    path.write_bytes(b"".join(line + b"\n" for line in out))
    return path


def read_records(tmp_path: Path, records: list[Any]) -> ReadResult:
    return read_dataset("d", write_lines(tmp_path / "d.jsonl", records))


def reasons(result: ReadResult) -> list[tuple[int | None, str]]:
    return [(p.line, p.reason) for p in result.invalid]


def only_reason(tmp_path: Path, record: Any) -> str:
    result = read_records(tmp_path, [record])
    assert not result.samples, result.samples
    assert len(result.invalid) == 1
    assert result.invalid[0].line == 1
    return result.invalid[0].reason


# --- dataset arguments and names -------------------------------------------------------------------------------

def test_parse_dataset_arg_name_and_path() -> None:
    assert parse_dataset_arg("math=data/gsm8k.jsonl") == ("math", Path("data/gsm8k.jsonl"))
    assert parse_dataset_arg("data/gsm8k.jsonl") == ("gsm8k", Path("data/gsm8k.jsonl"))
    assert parse_dataset_arg("a-b_C9=x.jsonl") == ("a-b_C9", Path("x.jsonl"))
    assert parse_dataset_arg("x=y=z.jsonl") == ("x", Path("y=z.jsonl"))  # only the first "=" splits


def test_parse_dataset_arg_equals_inside_a_path() -> None:
    # The text before "=" is not a valid name (a "/" or a "."): the whole argument is a path.
    assert parse_dataset_arg("runs/lr=0.1/train.jsonl") == ("train", Path("runs/lr=0.1/train.jsonl"))
    assert parse_dataset_arg("./a=b/data.jsonl") == ("data", Path("./a=b/data.jsonl"))


def test_parse_dataset_arg_prefers_an_existing_whole_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lr=0.1").mkdir()
    (tmp_path / "lr=0.1" / "train.jsonl").write_text("")
    # "lr" looks like a name, but "0.1/train.jsonl" does not exist while the whole argument does.
    assert parse_dataset_arg("lr=0.1/train.jsonl") == ("train", Path("lr=0.1/train.jsonl"))
    (tmp_path / "0.1").mkdir()
    (tmp_path / "0.1" / "train.jsonl").write_text("")
    assert parse_dataset_arg("lr=0.1/train.jsonl") == ("lr", Path("0.1/train.jsonl"))


@pytest.mark.parametrize("arg, fragment", [
    ("my.data.jsonl", 'the file name "my.data" cannot be a dataset name'),
    ("a.b=x.jsonl", 'the file name "a.b=x" cannot be a dataset name'),
    ("données.jsonl", 'the file name "données" cannot be a dataset name'),
    ("has space.jsonl", 'the file name "has space" cannot be a dataset name'),
    ("x" * 65 + ".jsonl", "cannot be a dataset name"),
    (".jsonl", 'the file name ".jsonl" cannot be a dataset name'),
    ("x=", 'no path after "="'),
    ("", "empty dataset argument"),
])
def test_parse_dataset_arg_rejects(arg: str, fragment: str) -> None:
    with pytest.raises(InputError) as info:
        parse_dataset_arg(arg)
    message = str(info.value)
    assert fragment in message
    assert (arg or '""') in message
    if "file name" in fragment:
        assert "NAME=PATH" in message


def test_name_length_limit() -> None:
    assert parse_dataset_arg("x" * 64 + "=d.jsonl")[0] == "x" * 64
    with pytest.raises(InputError):
        parse_dataset_arg("x" * 65 + "=d.jsonl")  # not a name, so a path whose stem is not a name either


def test_check_unique_names() -> None:
    check_unique_names([("a", Path("a.jsonl")), ("b", Path("b.jsonl"))])
    with pytest.raises(InputError) as info:
        check_unique_names([("a", Path("x/a.jsonl")), ("b", Path("b.jsonl")), ("a", Path("y/a.jsonl"))])
    assert str(info.value) == 'y/a.jsonl: dataset name "a" is already used by x/a.jsonl (as "a"); ' \
                              "name one of them with NAME=PATH"
    assert [p.path for p in info.value.problems] == ["y/a.jsonl"]


def test_names_differing_only_in_case_clash() -> None:
    with pytest.raises(InputError, match='"Math" is already used by math.jsonl'):
        check_unique_names([("math", Path("math.jsonl")), ("Math", Path("Math.jsonl"))])


# --- files ------------------------------------------------------------------------------------------------------

def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.jsonl"
    with pytest.raises(InputError) as info:
        read_dataset("nope", path)
    assert str(info.value) == f"{path}: file not found"
    assert info.value.problems == [Problem(str(path), None, "file not found")]


def test_folder_without_data_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not data")
    with pytest.raises(InputError) as info:
        read_dataset("d", tmp_path)
    assert str(info.value) == f"{tmp_path}: a folder without data files (.jsonl, .json, .parquet) that is not " \
                              "a Hugging Face save_to_disk dataset either"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads everything")
def test_unreadable_file(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "d.jsonl", [{"prompt": "x"}])
    path.chmod(0)
    with pytest.raises(InputError, match="permission denied"):
        read_dataset("d", path)


def test_nul_in_path_is_an_input_error() -> None:
    with pytest.raises(InputError, match="invalid path"):
        read_dataset("d", Path("a\0b.jsonl"))


def test_problem_str() -> None:
    assert str(Problem("a.jsonl", 3, "bad")) == "a.jsonl:3: bad"
    assert str(Problem("a.jsonl", None, "bad")) == "a.jsonl: bad"
    assert str(Problem("a.parquet", 3, "bad", "row")) == "a.parquet: row 3: bad"
    assert str(Problem("a.parquet", None, "bad", "row")) == "a.parquet: bad"
    assert Problem("a.parquet", 3, "bad", "row").where == "a.parquet: row 3"


def test_sample_knows_where_it_is(tmp_path: Path) -> None:
    result = read_records(tmp_path, [{"prompt": "x"}])
    sample = result.samples[0]
    assert (sample.path, sample.line, sample.unit) == (str(tmp_path / "d.jsonl"), 1, "line")
    assert str(sample.problem("too long")) == f"{tmp_path / 'd.jsonl'}:1: too long"


# --- formats ----------------------------------------------------------------------------------------------------

def test_messages_keep_extra_keys(tmp_path: Path) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "tools: f"},
        user("call f"),
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "hm"},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
    ]
    result = read_records(tmp_path, [{"id": "s1", "messages": messages, "meta": {"ignored": True}}])
    assert result.invalid == []
    assert result.samples[0].messages == messages
    assert result.samples[0].id == "s1" and result.samples[0].line == 1


def test_assistant_tool_calls_may_omit_content(tmp_path: Path) -> None:
    messages = [user("u"), {"role": "assistant", "tool_calls": [{"id": "c"}]}, {"role": "tool", "content": "r"}]
    assert read_records(tmp_path, [{"messages": messages}]).samples[0].messages == messages


def test_text_parts_are_joined(tmp_path: Path) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    result = read_records(tmp_path, [{"messages": [{"role": "user", "content": parts, "name": "n"}]}])
    assert result.samples[0].messages == [{"role": "user", "content": "Hello world", "name": "n"}]


def test_prompt_becomes_a_user_turn(tmp_path: Path) -> None:
    assert read_records(tmp_path, [{"prompt": "2+2?"}]).samples[0].messages == [user("2+2?")]


def test_sharegpt_roles(tmp_path: Path) -> None:
    turns = [("system", "system"), ("human", "user"), ("gpt", "assistant"), ("user", "user"),
             ("function_call", "assistant"), ("observation", "tool"), ("assistant", "assistant"),
             ("function", "tool"), ("tool", "tool")]
    record = {"conversations": [{"from": f, "value": f"v{i}"} for i, (f, _) in enumerate(turns)]}
    sample = read_records(tmp_path, [record]).samples[0]
    assert sample.messages == [{"role": role, "content": f"v{i}"} for i, (_, role) in enumerate(turns)]


def test_glaive_style_function_calling(tmp_path: Path) -> None:
    record = {"conversations": [
        {"from": "system", "value": "You may call get_weather."},
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": '{"temp": 21}'},
        {"from": "gpt", "value": "It is 21 degrees."},
    ]}
    sample = read_records(tmp_path, [record]).samples[0]
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "tool"]


def test_old_answers_are_dropped(tmp_path: Path) -> None:
    answer = {"role": "assistant", "content": "old"}
    records = [
        {"messages": [user("q1"), answer, user("q2"), answer, answer]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    result = read_records(tmp_path, records)
    assert result.samples[0].messages == [user("q1"), answer, user("q2")]
    assert result.samples[1].messages == [user("q")]


@pytest.mark.parametrize("messages, reason", [
    ([{"role": "assistant", "content": "a"}], "messages: no user turn"),
    ([{"role": "system", "content": "s"}], "messages: no user turn"),
    ([{"role": "system", "content": "s"}, {"role": "tool", "content": "t"}], "messages: no user turn"),
    ([user("u"), {"role": "system", "content": "s"}],
     "messages: must end with a user or tool turn (after dropping the old answer), ends with a system turn"),
])
def test_conversation_shape(tmp_path: Path, messages: list[Any], reason: str) -> None:
    assert only_reason(tmp_path, {"messages": messages}) == reason


def test_conversation_may_end_with_a_tool_turn(tmp_path: Path) -> None:
    messages = [user("u"), {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
                {"role": "tool", "content": "r"}, {"role": "assistant", "content": "old final answer"}]
    assert read_records(tmp_path, [{"messages": messages}]).samples[0].messages == messages[:3]


@pytest.mark.parametrize("record, reason", [
    ({"messages": [{"role": "bot", "content": "x"}]},
     'messages[0].role: expected one of system, user, assistant, tool, got "bot"'),
    ({"messages": [{"role": None, "content": "x"}]},
     "messages[0].role: expected one of system, user, assistant, tool, got null"),
    ({"messages": [user("u"), {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     'messages[1].content[0]: only text parts are supported, got type "image_url"'),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text: expected a string, got integer"),
    ({"messages": [{"role": "user", "content": ["text"]}]},
     "messages[0].content[0]: expected an object, got string"),
    ({"messages": [{"role": "user"}]},
     "messages[0].content: missing (allowed only on an assistant turn with tool_calls)"),
    ({"messages": [user("u"), {"role": "assistant", "content": None}, user("v")]},
     "messages[1].content: null (allowed only on an assistant turn with tool_calls)"),
    ({"messages": [user("u"), {"role": "assistant", "content": None, "tool_calls": []}, user("v")]},
     "messages[1].content: null (allowed only on an assistant turn with tool_calls)"),
    ({"messages": [{"role": "tool", "content": None, "tool_calls": [{}]}]},
     "messages[0].content: null (allowed only on an assistant turn with tool_calls)"),
    ({"messages": [{"role": "user", "content": {"text": "x"}}]},
     "messages[0].content: expected a string, a list of text parts or null, got object"),
    ({"messages": "hi"}, "messages: expected a list, got string"),
    ({"conversations": [{"from": "bot", "value": "x"}]},
     "conversations[0].from: expected one of system, human, user, gpt, assistant, function_call, tool, "
     'observation, function, got "bot"'),
    ({"conversations": [{"value": "x"}]}, "conversations[0].from: missing"),
    ({"conversations": [{"from": "human"}]}, "conversations[0].value: expected a string, got null"),
    ({"conversations": ["x"]}, "conversations[0]: expected an object, got string"),
    ({"conversations": []}, "conversations: empty list"),
    ({"conversations": {"from": "human"}}, "conversations: expected a list, got object"),
    ({"prompt": "   "}, "prompt: empty string"),
    ({"prompt": 5}, "prompt: expected a string, got integer"),
    ({"prompt": "x", "conversations": []}, 'more than one of "messages", "prompt", "conversations"'),
    ({"prompt": None}, '"prompt" is null'),
    ({"id": 1.5, "prompt": "x"}, '"id" must be a string or an integer, got number'),
    ({"id": {}, "prompt": "x"}, '"id" must be a string or an integer, got object'),
    ({"id": False, "prompt": "x"}, '"id" must be a string or an integer, got boolean'),
    ({"id": "a\nb", "prompt": "x"}, '"id" must not contain control characters'),
    ({"id": "a\x85b", "prompt": "x"}, '"id" must not contain control characters'),
    ({"id": 10**300, "prompt": "x"}, '"id" is longer than 256 characters'),
])
def test_invalid_records(tmp_path: Path, record: Any, reason: str) -> None:
    assert only_reason(tmp_path, record) == reason


def test_long_bad_values_are_shortened(tmp_path: Path) -> None:
    reason = only_reason(tmp_path, {"messages": [{"role": "x" * 10_000, "content": "c"}]})
    assert len(reason) < 200 and reason.endswith("...")


def test_null_fields_count_as_absent(tmp_path: Path) -> None:
    result = read_records(tmp_path, [{"prompt": "x", "messages": None, "conversations": None, "id": None}])
    assert result.invalid == []
    assert result.samples[0].id.startswith("h")


def test_unpaired_surrogates_are_rejected(tmp_path: Path) -> None:
    records = [
        '{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\\udc00"}]}',
        '{"id": "\\ud800", "prompt": "x"}',
        '{"prompt": "paired \\ud83d\\ude00 is fine"}',
        '{"prompt": "an escaped backslash \\\\ud800 is text"}',
    ]
    result = read_records(tmp_path, records)
    assert reasons(result) == [
        (1, "messages[1]: contains an unpaired surrogate (\\ud800-\\udfff escape), which cannot be encoded as UTF-8"),
        (2, '"id" contains an unpaired surrogate (\\ud800-\\udfff escape)'),
    ]
    assert result.samples[0].messages[0]["content"] == "paired \U0001F600 is fine"
    assert len(result.samples) == 2


# --- ids ------------------------------------------------------------------------------------------------------

def test_integer_ids_become_strings(tmp_path: Path) -> None:
    result = read_records(tmp_path, [{"id": 7, "prompt": "a"}, {"id": -3, "prompt": "b"}, {"id": "7", "prompt": "c"}])
    assert [s.id for s in result.samples] == ["7", "-3"]
    assert [str(p) for p in result.duplicates] == [f'{tmp_path / "d.jsonl"}:3: duplicate id "7" (first seen on line 1)']


def test_id_length_limit(tmp_path: Path) -> None:
    result = read_records(tmp_path, [{"id": "x" * 256, "prompt": "a"}, {"id": "y" * 257, "prompt": "b"}])
    assert [s.id for s in result.samples] == ["x" * 256]
    assert reasons(result) == [(2, '"id" is longer than 256 characters')]


def test_derived_id_is_a_hash_of_the_normalized_messages(tmp_path: Path) -> None:
    result = read_records(tmp_path, [
        {"prompt": "héllo"},
        {"messages": [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "old answer"}]},
        {"conversations": [{"from": "human", "value": "héllo"}]},
        {"prompt": "other"},
    ])
    canonical = json.dumps([user("héllo")], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    expected = "h" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    assert [s.line for s in result.samples] == [1, 4]
    assert result.samples[0].id == expected
    assert len(result.samples[1].id) == 17 and result.samples[1].id != expected
    assert [(p.line, p.reason) for p in result.duplicates] == [
        (2, f'duplicate id "{expected}" (first seen on line 1)'),
        (3, f'duplicate id "{expected}" (first seen on line 1)'),
    ]


def test_derived_id_is_stable_across_key_order(tmp_path: Path) -> None:
    a = read_records(tmp_path, ['{"messages": [{"role": "user", "content": "x", "name": "n"}]}']).samples[0]
    b = read_records(tmp_path, ['{"messages": [{"name": "n", "content": "x", "role": "user"}]}']).samples[0]
    assert a.id == b.id


# --- lines ----------------------------------------------------------------------------------------------------

def test_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n  \t\r\n{"prompt": "b"}\n\n\n \n')
    result = read_dataset("d", path)
    assert [s.line for s in result.samples] == [1, 4]
    assert reasons(result) == [(2, "empty line"), (3, "empty line")]


def test_no_final_newline_crlf_and_bom(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}')
    result = read_dataset("d", path)
    assert [(s.line, s.messages[0]["content"]) for s in result.samples] == [(1, "a"), (2, "b")]
    assert result.invalid == []


def test_bom_only_at_the_start(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\xef\xbb\xbf{"prompt": "b"}\n')
    assert reasons(read_dataset("d", path)) == [(2, "not valid JSON (Expecting value at column 1)")]


def test_unicode_line_separators_inside_strings_stay_one_line(tmp_path: Path) -> None:
    text = "a\u2028b\u0085c\x1cd"
    path = tmp_path / "d.jsonl"
    path.write_bytes((json.dumps({"prompt": text}, ensure_ascii=False) + "\n" + '{"prompt": "z"}\n').encode())
    result = read_dataset("d", path)
    assert [(s.line, s.messages[0]["content"]) for s in result.samples] == [(1, text), (2, "z")]


def test_one_bad_utf8_line_does_not_spoil_the_file(tmp_path: Path) -> None:
    result = read_records(tmp_path, [{"prompt": "a"}, b'{"prompt": "\xff\xfe"}', {"prompt": "ü"}])
    assert reasons(result) == [(2, "not valid UTF-8 (byte 0xff at position 13)")]
    assert [s.line for s in result.samples] == [1, 3]


def test_very_long_line(tmp_path: Path) -> None:
    text = "long " * 200_000  # 1 MB
    result = read_records(tmp_path, [{"prompt": "a"}, {"messages": [user(text)]}, {"prompt": "b"}])
    assert [len(s.messages[0]["content"]) for s in result.samples] == [1, len(text), 1]


def test_huge_integer_is_a_bad_line_not_a_crash(tmp_path: Path) -> None:
    reason = only_reason(tmp_path, '{"id": ' + "9" * 5000 + ', "prompt": "x"}')
    assert reason.startswith("not valid JSON (Exceeds the limit")


def test_hundred_thousand_lines(tmp_path: Path) -> None:
    """Every line of a large file is read, none lost or taken for a duplicate. How fast: bench/local_speed.py."""
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for i in range(100_000):
            f.write(json.dumps({"messages": [{"role": "system", "content": "Be brief."}, user(f"question {i}"),
                                             {"role": "assistant", "content": "old"}]}) + "\n")
    result = read_dataset("big", path)
    assert len(result.samples) == 100_000 and not result.invalid and not result.duplicates
    assert [s.line for s in result.samples[::25_000]] == [1, 25_001, 50_001, 75_001]
    assert result.samples[-1].messages[1]["content"] == "question 99999"


# --- the fixture with every kind of bad line ---------------------------------------------------------------------

BAD_LINES = [
    (2, "not valid JSON (Expecting ',' delimiter at column 12)"),
    (3, "not a JSON object"),
    (4, 'no "messages", "prompt" or "conversations" field'),
    (5, 'messages[2].role: expected one of system, user, assistant, tool, got "bot"'),
    (6, '"id" must be a string or an integer, got list'),
    (7, "prompt: empty string"),
    (8, 'more than one of "messages", "prompt", "conversations"'),
    (9, "empty line"),
    (10, "not valid UTF-8 (byte 0xe9 at position 16)"),
    (11, 'messages[0].content[1]: only text parts are supported, got type "image_url"'),
    (12, "messages[0].content: null (allowed only on an assistant turn with tool_calls)"),
    (13, "conversations[1].from: expected one of system, human, user, gpt, assistant, function_call, tool, "
         'observation, function, got "bot"'),
    (14, "messages: no user turn"),
    (15, "messages: must end with a user or tool turn (after dropping the old answer), ends with a system turn"),
    (16, '"id" must be a string or an integer, got boolean'),
    (17, '"id" must not be empty'),
    (18, '"id" must not contain control characters'),
    (19, '"id" is longer than 256 characters'),
    (20, "not valid JSON (NaN is not allowed)"),
    (21, "prompt: contains an unpaired surrogate (\\ud800-\\udfff escape), which cannot be encoded as UTF-8"),
    (22, "messages: expected a list, got object"),
    (23, "messages: empty list"),
    (24, "messages[0]: expected an object, got string"),
    (25, "messages[0].role: missing"),
    (26, "conversations[0].value: expected a string, got integer"),
    (27, "prompt: expected a string, got list"),
    (28, '"messages" is null'),
    (29, "messages[0].content: expected a string, a list of text parts or null, got number"),
    (30, "messages[0].tool_calls: expected a list, got object"),
    (31, "not valid JSON (nested too deeply)"),
    (32, "not valid JSON (Extra data at column 17)"),
    (33, "not a JSON object"),
    (35, "empty line"),
]


def test_bad_lines_fixture() -> None:
    path = FIXTURES / "bad_lines.jsonl"
    result = read_dataset("bad_lines", path)
    assert reasons(result) == BAD_LINES
    assert all(p.path == str(path) for p in result.invalid)
    assert [(s.id, s.line) for s in result.samples] == [("ok-1", 1), ("7", 36)]
    assert [(p.line, p.reason) for p in result.duplicates] == [(34, 'duplicate id "ok-1" (first seen on line 1)')]


def test_bad_lines_fixture_through_read_all() -> None:
    path = FIXTURES / "bad_lines.jsonl"
    with pytest.raises(InputError) as info:
        read_all([f"bad={path}"], skip_invalid=False)
    lines = str(info.value).splitlines()
    assert lines[:-1] == [f"{path}:{n}: {reason}" for n, reason in BAD_LINES]
    assert lines[-1] == "use --skip-invalid to skip bad lines"
    assert [(p.line, p.reason) for p in info.value.problems] == BAD_LINES
    [result] = read_all([f"bad={path}"], skip_invalid=True)
    assert result.name == "bad" and len(result.samples) == 2 and reasons(result) == BAD_LINES


# --- read_all ---------------------------------------------------------------------------------------------------

def test_read_all(tmp_path: Path) -> None:
    a = write_lines(tmp_path / "a.jsonl", [{"prompt": "x"}])
    b = write_lines(tmp_path / "other.jsonl", [{"prompt": "y"}, {"prompt": "z"}])
    results = read_all([str(a), f"b={b}"], skip_invalid=False)
    assert [(r.name, r.path, len(r.samples)) for r in results] == [("a", a, 1), ("b", b, 2)]
    assert read_all([], skip_invalid=False) == []


def test_read_all_caps_the_listing_per_file(tmp_path: Path) -> None:
    a = write_lines(tmp_path / "a.jsonl", [{"prompt": "ok"}] + ["{"] * 120)
    b = write_lines(tmp_path / "b.jsonl", [{"prompt": "ok"}, "[]"])
    with pytest.raises(InputError) as info:
        read_all([str(a), str(b)], skip_invalid=False)
    lines = str(info.value).splitlines()
    assert len(lines) == 50 + 1 + 1 + 1
    assert lines[0].startswith(f"{a}:2: not valid JSON")
    assert lines[49].startswith(f"{a}:51: ")
    assert lines[50] == f"{a}: ... and 70 more invalid lines"
    assert lines[51] == f"{b}:2: not a JSON object"
    assert lines[52] == "use --skip-invalid to skip bad lines"
    assert len(info.value.problems) == 121


def test_read_all_skip_invalid(tmp_path: Path) -> None:
    a = write_lines(tmp_path / "a.jsonl", ["nope", {"prompt": "x"}])
    [result] = read_all([str(a)], skip_invalid=True)
    assert [s.line for s in result.samples] == [2]
    assert reasons(result) == [(1, "not valid JSON (Expecting value at column 1)")]


def test_read_all_file_without_valid_samples(tmp_path: Path) -> None:
    good = write_lines(tmp_path / "good.jsonl", [{"prompt": "x"}])
    bad = write_lines(tmp_path / "bad.jsonl", ["nope"])
    empty = write_lines(tmp_path / "empty.jsonl", [])
    with pytest.raises(InputError) as info:
        read_all([str(good), str(bad), str(empty)], skip_invalid=True)
    assert str(info.value) == f"{bad}: no valid samples\n{empty}: no valid samples"
    with pytest.raises(InputError) as info:
        read_all([str(good), str(bad)], skip_invalid=False)
    assert str(info.value).splitlines() == [
        f"{bad}:1: not valid JSON (Expecting value at column 1)",
        f"{bad}: no valid samples",
        "use --skip-invalid to skip bad lines",
    ]


def test_read_all_duplicates_are_not_fatal(tmp_path: Path) -> None:
    a = write_lines(tmp_path / "a.jsonl", [{"id": 1, "prompt": "x"}, {"id": 1, "prompt": "y"}])
    [result] = read_all([str(a)], skip_invalid=False)
    assert len(result.samples) == 1 and len(result.duplicates) == 1


def test_read_all_reports_every_bad_argument_and_file(tmp_path: Path) -> None:
    with pytest.raises(InputError) as info:
        read_all(["my.data.jsonl", "x="], skip_invalid=True)
    assert [p.path for p in info.value.problems] == ["my.data.jsonl", "x="]
    with pytest.raises(InputError) as info:
        read_all([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], skip_invalid=True)
    assert str(info.value) == f"{tmp_path / 'a.jsonl'}: file not found\n{tmp_path / 'b.jsonl'}: file not found"


def test_read_all_checks_names(tmp_path: Path) -> None:
    a = write_lines(tmp_path / "a.jsonl", [{"prompt": "x"}])
    with pytest.raises(InputError, match='dataset name "a" is already used'):
        read_all([str(a), f"a={a}"], skip_invalid=False)


# --- fuzz -------------------------------------------------------------------------------------------------------

lines = st.one_of(
    plausible.map(lambda r: json.dumps(r).encode("utf-8")),
    plausible.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    records.map(lambda r: json.dumps(r).encode("utf-8")),
    records.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    json_values.map(lambda v: json.dumps(v).encode("utf-8")),
    st.text(max_size=20).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=20),
    st.sampled_from([b"", b" ", b"\r", b"\xef\xbb\xbf", b"NaN", b'{"prompt": "\\ud800"}', b"[" * 3000]),
).map(lambda b: b.replace(b"\n", b" "))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(lines, max_size=12), st.booleans())
def test_fuzz_read_dataset_accounts_for_every_line(tmp_path: Path, body: list[bytes], final_newline: bool) -> None:
    path = tmp_path / "fuzz.jsonl"
    data = b"\n".join(body) + (b"\n" if final_newline and body else b"")
    path.write_bytes(data)
    result = read_dataset("fuzz", path)

    physical = data.split(b"\n")
    if data.endswith(b"\n"):
        physical.pop()
    if physical and physical[0].startswith(b"\xef\xbb\xbf"):
        physical[0] = physical[0][3:]
    while physical and not physical[-1].strip():  # trailing blank lines are ignored
        physical.pop()
    # Every line is exactly one of: a sample, a bad line, a duplicate; bad lines are reported in file order.
    bad_lines = [p.line or 0 for p in result.invalid]
    accounted = [s.line for s in result.samples] + bad_lines + [p.line or 0 for p in result.duplicates]
    assert sorted(accounted) == list(range(1, len(physical) + 1))
    assert bad_lines == sorted(bad_lines)
    for p, line in zip(result.invalid, bad_lines, strict=True):
        assert p.reason and str(p).startswith(f"{path}:{line}: ")
        str(p).encode("utf-8")  # printable: no lone surrogates in messages
        assert (p.reason == "empty line") == (not physical[line - 1].strip())
    seen = set()
    for s in result.samples:
        assert s.id not in seen and isinstance(s.id, str) and 0 < len(s.id) <= 256
        seen.add(s.id)
        json.dumps(s.messages, ensure_ascii=False, allow_nan=False).encode("utf-8")
        assert s.messages and s.messages[-1]["role"] in ("user", "tool")
        assert any(m["role"] == "user" for m in s.messages)
        assert all(m["role"] in ("system", "user", "assistant", "tool") for m in s.messages)
        assert all(isinstance(m.get("content"), str) or m["role"] == "assistant" for m in s.messages)
