"""The test helpers that read files other processes are still writing (tests/procs.py)."""
from __future__ import annotations

import json
from pathlib import Path

from tests.procs import Workers, complete_lines, read_jsonl


def test_read_jsonl_leaves_a_half_written_last_line_for_the_next_read(tmp_path: Path) -> None:
    path = tmp_path / "raw_responses.jsonl"
    assert read_jsonl(path) == []
    whole = json.dumps({"id": "a", "response": "é"}, ensure_ascii=False).encode() + b"\n"
    torn = json.dumps({"id": "b", "response": "日本"}, ensure_ascii=False).encode()
    path.write_bytes(whole + torn[:-3])  # cut inside a UTF-8 sequence, as a reader can see it mid-write
    assert [x["id"] for x in read_jsonl(path)] == ["a"]
    path.write_bytes(whole + torn)  # the whole line is written, the newline not yet
    assert [x["id"] for x in read_jsonl(path)] == ["a"]
    path.write_bytes(whole + torn + b"\n")
    assert [x["id"] for x in read_jsonl(path)] == ["a", "b"]


def test_a_workers_log_is_matched_line_by_line(tmp_path: Path) -> None:
    (tmp_path / "w0.log").write_bytes(b"started\ncommitted 1")  # "committed 12" is being written
    pool = Workers("redis://127.0.0.1:1/0", "http://127.0.0.1:1", tmp_path)
    assert pool.log("w0") == "started\n"
    assert complete_lines(tmp_path / "w0.log") == ["started"]
    assert pool.log("w0", partial=True).endswith("committed 1")
