"""The files an export reads and writes: ``raw_responses.jsonl`` read record by record and checked field by field
(errors name file, line and field), ``run.json``, ``failed.jsonl``, and the atomic write (temporary file beside
the destination, fsynced, renamed). Split from producer/export/writer.py, which uses them."""
from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Final, Iterator, Mapping

from producer.errors import UsageError
from producer.generations import record_key
from producer.results import FAILED_FILE, RESULTS, RUN, ReadEnd, iter_results

MANIFEST: Final = "manifest.json"
DEFAULT_THINK: Final = ("<think>", "</think>")
#: What a record must hold, and what every turn of it must hold.
_REQUIRED: Final[dict[str, type]] = {"id": str, "messages": list, "turns": list, "completion_tokens": int}
_REQUIRED_TURN: Final[dict[str, type]] = {
    "response": str, "content": str, "finish_reason": str, "prompt_tokens": int, "completion_tokens": int,
}


class ExportError(UsageError):
    """A user error (missing or malformed output files, bad options, wrong tokenizer), fit to show as is (exit 2)."""


class Results:
    """The records of raw_responses.jsonl (producer/results.py ``iter_results``) with their line numbers, checked;
    remembers whether the last line was torn. A line that is not a record is an error
    naming it, where the collector would cut the file there: an export never skips what it cannot read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.torn_tail = False

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        end = ReadEnd()
        for result in iter_results(self.path, end):
            check_record(result.record, f"{self.path}:{result.number}")
            yield result.number, result.record
        self.torn_tail = end.torn  # a crash mid-write; the result is still in Redis
        if end.bad_line is not None:
            where = f"{self.path}:{end.bad_line}"
            if end.json_error is not None:
                raise ExportError(f"{where}: not valid JSON ({end.json_error})")
            check_record(end.bad_value, where)  # names the field at fault
            raise ExportError(f"{where}: generation must be a whole number")  # what check_record leaves to record_key


def _check_fields(obj: Mapping[str, Any], required: Mapping[str, type], where: str) -> None:
    for key, kind in required.items():
        value = obj.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ExportError(f"{where}: {key} missing or not a {kind.__name__}")
    if obj.get("reasoning") is not None and not isinstance(obj["reasoning"], str):
        raise ExportError(f"{where}: reasoning must be a string or null")


def check_record(rec: Any, where: str) -> None:
    """A record as written; the error names the file, the line and the field."""
    if not isinstance(rec, dict):
        raise ExportError(f"{where}: expected a JSON object")
    _check_fields(rec, _REQUIRED, where)
    if not rec["turns"]:
        raise ExportError(f"{where}: turns is empty")
    for n, turn in enumerate(rec["turns"]):
        if not isinstance(turn, dict):
            raise ExportError(f"{where}: turns[{n}]: expected a JSON object")
        _check_fields(turn, _REQUIRED_TURN, f"{where}: turns[{n}]")
        out = turn.get("output_ids")
        if out is not None and (not isinstance(out, list) or not all(type(i) is int for i in out)):
            raise ExportError(f"{where}: turns[{n}]: output_ids must be a list of integers or null")


def read_run_json(dataset_dir: Path) -> dict[str, Any]:
    path = dataset_dir / RUN
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path} not found: {dataset_dir} is not a budgetq dataset output directory") from None
    except ValueError as exc:
        raise ExportError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return settings


def markers(settings: Mapping[str, Any]) -> tuple[str, str]:
    from producer.parsers import PARSER_MARKERS
    parser_markers = PARSER_MARKERS.get(str(settings.get("reasoning_parser")))
    if parser_markers is not None and parser_markers.start != DEFAULT_THINK[0]:  # Kimi's ◁think▷
        return parser_markers.start, parser_markers.end
    think = settings.get("think")
    if isinstance(think, list) and len(think) == 2 and all(isinstance(t, str) and t for t in think):
        return think[0], think[1]
    return DEFAULT_THINK


def failed_ids(dataset_dir: Path) -> set[str]:
    path = dataset_dir / FAILED_FILE
    if not path.is_file():
        return set()
    ids: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids.add(record_key(json.loads(line)))
        except (ValueError, KeyError, TypeError):
            raise ExportError(f"{path}:{number}: expected a JSON object with an id") from None
    return ids


def check_dest(dest: Path, dataset_dir: Path) -> None:
    if dest.is_dir():
        raise ExportError(f"{dest} is a directory: give the path of the file to write")
    own = {(dataset_dir / name).resolve() for name in (RESULTS, FAILED_FILE, RUN, MANIFEST)}
    if dest.resolve() in own:
        raise ExportError(f"{dest} is one of the dataset's own files: export elsewhere")


@contextmanager
def atomic(dest: Path) -> Iterator[IO[str]]:
    """A text file that appears at ``dest`` complete (fsynced, then renamed) or not at all."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A unique name: two exports to one path must not write into each other's temporary file.
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8", newline="\n") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

