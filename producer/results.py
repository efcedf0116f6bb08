"""The output files of a dataset, the one reader of ``raw_responses.jsonl`` (`iter_results`), and the move of
committed results from Redis onto disk.

Order of operations is what makes collection exactly-once: a result is written, flushed and fsynced before
it is deleted from the Redis stream; a crash in between leaves it in both, and the ids already in the file
(loaded when the file is opened) keep the next collector from writing it twice. A torn last line (a crash
mid-write) is cut off when the file is opened, before anything is appended.

What an export reads and writes is here too: ``raw_responses.jsonl`` read record by record and checked field by
field (`Results`: errors name file, line and field), ``run.json``, ``failed.jsonl``, and the atomic write
(`atomic`: a temporary file beside the destination, fsynced, renamed).
"""
from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Final, Iterable, Iterator, Mapping

from budget import record
from budget.record import OTHER_VERSION
from budget.runstate import RESULTS_BATCH, RunState
from producer.errors import UsageError
from producer.generations import record_key, split_key

RESULTS = "raw_responses.jsonl"
FAILED_FILE = "failed.jsonl"
RUN = "run.json"


@dataclass(frozen=True)
class Result:
    """One complete record of a results file, as written, with its line number (from 1), its bytes (the newline
    included), its sample key and its count."""

    number: int
    line: bytes
    record: dict[str, Any]
    key: str  # producer/generations.py record_key: the prompt's id and the generation
    tokens: int  # completion_tokens

    @property
    def text(self) -> str:
        """The line as written, without its newline."""
        return self.line.decode("utf-8").rstrip("\n")


@dataclass
class ReadEnd:
    """Why `iter_results` stopped before the end of the file, if it did; filled in as it reads."""

    #: The last line had no newline: a crash mid-write. Its result is still in Redis (it is deleted from the stream
    #: only after the fsync), so the line is not a record yet.
    torn: bool = False
    #: The number of the first line that is not a record (not JSON, or without an ``id`` and a
    #: ``completion_tokens`` count): nothing after it is trusted. None: every line before the end (or the torn
    #: tail) was a record.
    bad_line: int | None = None
    #: Why that line is not JSON (the decoder's message); None when it is JSON (then `bad_value` holds it).
    json_error: str | None = None
    bad_value: Any = None


def iter_results(path: Path, end: ReadEnd | None = None) -> Iterator[Result]:
    """The records of a results file (``raw_responses.jsonl``) in order, read as every reader of the file reads it:
    up to a torn last line (no newline: a crash mid-write) or the first line that is not a record, whichever comes
    first; ``end`` says which. The collector cuts the file there (`ResultsFile`), a plan stops counting there, and
    an export refuses the file at a bad line (producer/results.py ``Results``). A record of another
    ``record_version`` raises UsageError (exit 2) naming the file and line: nothing reads it, nothing cuts it."""
    end = ReadEnd() if end is None else end
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n"):
                end.torn = True
                return
            try:
                rec = json.loads(raw)
            except ValueError as exc:
                end.bad_line, end.json_error = number, str(exc)
                return
            try:
                key, tokens = record_key(rec), int(rec["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                end.bad_line, end.bad_value = number, rec
                return
            if rec.get("record_version") != record.RECORD_VERSION:
                raise UsageError(f"{path}:{number}: a record of record_version {rec.get('record_version')!r}, "
                                 f"{OTHER_VERSION}")
            yield Result(number, raw, rec, key, tokens)


def check_version(path: Path) -> None:
    """Refuse (UsageError, exit 2) a results file whose first record is of another version: attach looks before it
    writes anything; `iter_results` checks every line when the file is opened."""
    if path.exists():
        next(iter_results(path), None)

class ResultsFile:
    """``out/<dataset>/raw_responses.jsonl``: append-only, fsynced, with the ids (and tokens) it holds.

    An id is written once, except after a record with ``stopped_by: failed`` (a multi-turn conversation a turn of
    which failed): a rerun's record of it is appended and supersedes it (readers keep an id's last record), and
    ``tokens`` holds the last record's count."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tokens: dict[str, int] = {}
        #: id -> the line of its last record, for ids whose last record is a failed conversation: the one kind a
        #: new record may supersede; the same line again is a resend (a retry after the fsync), not written twice.
        self.superseded: dict[str, str] = {}
        self.truncated_bytes = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._load()
        self._fh = open(path, "ab")

    def _load(self) -> None:
        """Read the file's records and cut what follows them: a torn tail (a crash mid-write), or everything from
        a line that is not a record on (nothing after a line we cannot read is trusted)."""
        if not self.path.exists():
            return
        good = 0
        for result in iter_results(self.path):
            self._note(result.key, result.tokens, result.record, result.text)
            good += len(result.line)
        size = self.path.stat().st_size
        if good < size:
            self.truncated_bytes = size - good
            with open(self.path, "r+b") as fh:
                fh.truncate(good)
                fh.flush()
                os.fsync(fh.fileno())

    def _note(self, sid: str, tokens: int, rec: dict[str, Any], line: str) -> bool:
        """Take ``rec`` (serialized as ``line``) as ``sid``'s last record, if the file accepts it: a new id, or a
        new record superseding a failed conversation. False: already on file, so not written again."""
        if sid in self.tokens and self.superseded.get(sid, line) == line:
            return False
        self.tokens[sid] = tokens
        if rec.get("stopped_by") == record.FAILED:
            self.superseded[sid] = line
        else:
            self.superseded.pop(sid, None)
        return True

    def append(self, records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write (and fsync) the records the file accepts; returns those, in order."""
        lines, written = [], []
        for rec in records:
            line = json.dumps(record.ordered(rec), ensure_ascii=False)
            if not self._note(record_key(rec), int(rec["completion_tokens"]), rec, line):
                continue
            written.append(rec)
            lines.append(line + "\n")
        if lines:
            self._fh.write("".join(lines).encode())
            self._fh.flush()
            os.fsync(self._fh.fileno())
        return written

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())

    def close(self) -> None:
        self._fh.close()


def collect(store: RunState, dataset: str, out: ResultsFile,
            messages_for: Callable[[str], Any], batch: int = RESULTS_BATCH) -> list[dict[str, Any]]:
    """Move every committed result of ``dataset`` from its Redis stream into ``out``, adding each record's prompt
    ``messages`` (the worker's record has every other field: the data flows one way). Returns the records newly
    written. Ids read from the stream that were already on disk (a retry after a Redis error between the
    fsync and the XDEL) are not returned: callers treat ``out.tokens`` as the set of samples done."""
    written: list[dict[str, Any]] = []
    while True:
        entries = store.read_results(dataset, batch)
        if not entries:
            return written
        records = [entry_record(fields, messages_for) for _entry_id, fields in entries]
        written.extend(out.append(records))
        store.drop_results(dataset, [e[0] for e in entries])  # only after the fsync in append()


def entry_record(fields: dict[Any, Any], messages_for: Callable[[str], Any]) -> dict[str, Any]:
    """The record of one results stream entry. Two shapes: a response (``commit``: ``id``, ``r`` = the whole
    record without ``messages``), and a conversation (``end_conversation``: ``id``, ``r`` = the record's header,
    ``t0`` .. ``t{k-1}`` = its committed turns verbatim), which becomes one record version 2 with every turn and
    ``completion_tokens`` their sum, what the budget counted. ``messages`` are the dataset's prompt unless a
    conversation's header carries what was sent (docs/multiturn.md: later turns splice in tool results)."""
    text = {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in fields.items()}
    rec = json.loads(text["r"])
    if "t0" not in text:
        rec["messages"] = messages_for(rec["id"])
        return on_disk(rec)
    turns: list[dict[str, Any]] = []
    while f"t{len(turns)}" in text:
        turns.append(json.loads(text[f"t{len(turns)}"]))
    sid = text["id"].decode() if isinstance(text["id"], bytes) else str(text["id"])
    rec.setdefault("record_version", record.RECORD_VERSION)
    rec["id"] = sid
    if rec.get("messages") is None:
        rec["messages"] = messages_for(sid)
    rec["turns"] = turns
    rec["completion_tokens"] = sum(int(t["completion_tokens"]) for t in turns)
    return on_disk(rec)


def on_disk(rec: dict[str, Any]) -> dict[str, Any]:
    """A worker's record (``id``: the sample key) as it is written: ``id`` the prompt's and ``generation`` beside
    it (producer/generations.py), so every reader of the file groups a prompt's generations by its own id."""
    prompt, generation = split_key(str(rec["id"]))
    rec["id"] = prompt
    rec["generation"] = generation
    return rec


def failed_line(key: str, failure: dict[str, Any]) -> dict[str, Any]:
    """A failed.jsonl line of sample ``key``: the prompt's ``id`` and its ``generation``, then why it failed."""
    prompt, generation = split_key(key)
    return {**failure, "id": prompt, "generation": generation}


def write_failed(path: Path, failures: dict[str, dict[str, Any]]) -> None:
    """Rewrite failed.jsonl from Redis' failed hash (atomic rename); remove it when nothing failed."""
    if not failures:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for sid in sorted(failures):
            fh.write(json.dumps(failed_line(sid, failures[sid]), ensure_ascii=False) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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
    from producer.settings import PARSER_MARKERS
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
