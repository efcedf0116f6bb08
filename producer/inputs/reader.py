"""Read prompt datasets into validated, normalized chat samples: the producer's entry to its inputs.

Every sample that reaches the queue spends budget and a worker's time, so a malformed record is caught here, where
it can be reported as ``file:line: reason`` (JSONL, JSON arrays) or ``path: row N: reason`` (Parquet, Hugging Face
datasets), rather than as a failed job later. docs/inputs.md describes formats, field mapping and rules.

The format is chosen by the path: a folder written by ``save_to_disk`` (it holds ``state.json`` or
``dataset_dict.json``) is a Hugging Face dataset; any other folder is read as all its ``.jsonl``, ``.json`` and
``.parquet`` files, recursively, in path order, skipping hidden ones, as one dataset; a ``.parquet`` file is
Parquet; a ``.json`` file a JSON array (JSON Lines if it does not start with ``[``); any other file JSON Lines.
What each record may hold is ``producer.inputs.records``; JSON files are read here (below), the columnar formats in
``producer.inputs.columnar``.

Duplicate ids: the first wins; later ones are reported in ``ReadResult.duplicates``, which is not an error.

JSON Lines and JSON-array files are read record by record with the line each record is on.
JSONL: one record a line. Line numbers count ``\n`` only (the file is split as bytes), so a JSON string holding
U+2028 stays one line. A UTF-8 BOM at the start is skipped. Each line is decoded on its own: one bad line does not
spoil the file. Blank (whitespace-only) lines at the end are ignored; a blank line followed by a record is an
``empty line``, because in the middle of a file it usually means a record was lost or split.

JSON array: the file is one array of records, which may span lines (pretty-printed). A record is reported at the
line where it starts (its ``{``), counting ``\n`` as for JSONL. A record that parses but is invalid (wrong shape,
NaN, an integer too long) is a bad record like a bad JSONL line; but bad UTF-8 or broken JSON syntax leave no way to
know where the next record starts, so they make the whole file unreadable: ``file:LINE: reason`` at the error's
own line, fatal even with ``--skip-invalid``. The file is read whole into memory.

NaN/Infinity literals and ``\ud800``-style unpaired surrogates are rejected: neither survives JSON/UTF-8
encoding downstream.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, NoReturn

from budget.keys import DATASET_NAME_RULE, valid_dataset_name
from producer.inputs.records import (
    DEFAULT_MAPPING,
    Collector,
    FieldMapping,
    InputError,
    Problem,
    ReadResult,
    RecordError,
    Sample,
    file_error,
    normalize,
)

__all__ = ["FieldMapping", "InputError", "Problem", "ReadResult", "Sample", "check_unique_names",
           "parse_dataset_arg", "read_all", "read_dataset", "valid_name"]

MAX_LISTED_PER_FILE = 50
"""Bad records listed per dataset in an InputError; a 100k-line file of the wrong format needs no 100k-line message."""
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
"""The files a plain folder dataset is made of."""
SAVED_MARKERS = ("state.json", "dataset_dict.json")
"""Files that make a folder a Hugging Face ``save_to_disk`` dataset."""
SPLIT_WORDS = {
    "train": "train", "training": "train",
    "validation": "validation", "valid": "validation", "dev": "validation", "val": "validation",
    "test": "test", "testing": "test", "eval": "test", "evaluation": "test",
}
"""Words naming a split in a data file's path, as the Hugging Face hub's folder convention reads them."""
_NAME_RULE = DATASET_NAME_RULE
_WORD_RE = re.compile(r"[a-z]+")


def valid_name(name: str) -> bool:
    """True if ``name`` can be a dataset name (also used for ``--budget NAME=AMOUNT``)."""
    return valid_dataset_name(name)


def parse_dataset_arg(arg: str) -> tuple[str, Path]:
    """Split ``NAME=PATH`` or ``PATH`` (the name is then the file's stem, or an existing folder's name).

    Paths may contain "=" (``lr=0.1/data.jsonl``): the text before the first "=" is a name only if it is a valid
    name and something follows; and if that path does not exist while the whole argument does, the whole argument
    is the path. ``./a=b.jsonl`` always means a path.
    """
    if not arg:
        raise InputError([Problem('""', None, "empty dataset argument: expected NAME=PATH or PATH")])
    name, sep, rest = arg.partition("=")
    if sep and valid_name(name):
        if not rest:
            raise InputError([Problem(arg, None, 'no path after "=" (expected NAME=PATH)')])
        if _exists(Path(rest)) or not _exists(Path(arg)):
            return name, Path(rest)
    path = Path(arg)
    is_dir = _is_dir(path)
    stem = (path.name or path.resolve().name) if is_dir else path.stem  # a folder "v1.2" keeps its dot; "." its name
    if not valid_name(stem):
        what = "folder" if is_dir else "file"
        raise InputError([Problem(arg, None, f'the {what} name "{stem}" cannot be a dataset name '
                                             f"({_NAME_RULE}); give one as NAME=PATH")])
    return stem, path


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte: not an existing file either way
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


def check_unique_names(pairs: list[tuple[str, Path]]) -> None:
    """Reject two datasets with one name; names differing only in case clash too (case-insensitive filesystems)."""
    seen: dict[str, tuple[str, Path]] = {}
    problems = []
    for name, path in pairs:
        key = name.lower()
        if key in seen:
            first_name, first_path = seen[key]
            problems.append(Problem(str(path), None, f'dataset name "{name}" is already used by {first_path} '
                                                     f'(as "{first_name}"); name one of them with NAME=PATH'))
        else:
            seen[key] = (name, path)
    if problems:
        raise InputError(problems)


def read_dataset(name: str, path: Path, *, mapping: FieldMapping = DEFAULT_MAPPING,
                 progress: Callable[[int], None] | None = None) -> ReadResult:
    """Read one dataset, a file or a folder, in the format its path says (see the module doc).

    Bad records and duplicates are collected, never raised; a dataset that cannot be read at all raises
    InputError: a missing or unreadable file, broken JSON syntax in a JSON array, a Parquet file or Hugging Face
    dataset without any record column, or one given without pyarrow/datasets installed.
    """
    result = ReadResult(name, path, [], [], [])
    sink = Collector(result, progress)
    if _is_dir(path):
        _read_folder(path, sink, mapping)
    else:
        _read_file(path, sink, mapping)
    sink.report_progress()
    return result


def _read_file(path: Path, sink: Collector, mapping: FieldMapping) -> None:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        from producer.inputs.columnar import read_parquet  # pyarrow is imported only for a Parquet input

        read_parquet(path, sink, mapping)
    elif suffix == ".json":
        read_json(path, sink, mapping)
    else:
        read_jsonl(path, sink, mapping)


def _read_folder(path: Path, sink: Collector, mapping: FieldMapping) -> None:
    where = str(path)
    if any((path / marker).is_file() for marker in SAVED_MARKERS):
        from producer.inputs.columnar import read_saved  # datasets is imported only for a save_to_disk folder

        read_saved(path, sink, mapping)
        return
    try:
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in DATA_SUFFIXES and p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    except OSError as e:
        raise file_error(where, e) from None
    if not files:
        raise InputError([Problem(where, None, "a folder without data files (.jsonl, .json, .parquet) that is not "
                                               "a Hugging Face save_to_disk dataset either")])
    splits: dict[str, Path] = {}
    for file in files:
        words = _WORD_RE.findall(file.relative_to(path).as_posix().lower())
        split = next((SPLIT_WORDS[w] for w in words if w in SPLIT_WORDS), None)
        if split is not None:
            splits.setdefault(split, file)
    if len(splits) > 1:
        shown = ", ".join(f"{s} ({f.relative_to(path)})" for s, f in sorted(splits.items()))
        raise InputError([Problem(where, None, f"holds files of several splits: {shown}; a dataset is one split: "
                                               "give a folder or file holding only one")])
    for file in files:
        _read_file(file, sink, mapping)


def read_all(args: list[str], skip_invalid: bool, *, mapping: FieldMapping = DEFAULT_MAPPING,
             progress: Callable[[int], None] | None = None) -> list[ReadResult]:
    """Parse dataset arguments and read every dataset, raising one InputError that lists everything wrong.

    Bad records are fatal unless ``skip_invalid``; a dataset without a single valid sample always is.
    ``progress`` is called with the number of records read (valid or not) as reading goes.
    """
    pairs = []
    problems: list[Problem] = []
    for arg in args:
        try:
            pairs.append(parse_dataset_arg(arg))
        except InputError as e:
            problems.extend(e.problems)
    if problems:
        raise InputError(problems)
    check_unique_names(pairs)
    results = []
    for name, path in pairs:
        try:
            results.append(read_dataset(name, path, mapping=mapping, progress=progress))
        except InputError as e:
            problems.extend(e.problems)
    if problems:
        raise InputError(problems)

    lines: list[str] = []
    listed: list[Problem] = []
    for r in results:
        if r.invalid and not skip_invalid:
            problems.extend(r.invalid)
            listed.extend(r.invalid)
            lines.extend(map(str, r.invalid[:MAX_LISTED_PER_FILE]))
            if len(r.invalid) > MAX_LISTED_PER_FILE:
                lines.append(f"{r.path}: ... and {len(r.invalid) - MAX_LISTED_PER_FILE} more invalid "
                             f"{_records_word(r.invalid)}")
        if not r.samples:
            problem = Problem(str(r.path), None, "no valid samples")
            problems.append(problem)
            lines.append(str(problem))
    if problems:
        if listed:
            lines.append(f"use --skip-invalid to skip bad {_records_word(listed)}")
        raise InputError(problems, "\n".join(lines))
    return results


def _records_word(problems: list[Problem]) -> str:
    units = {p.unit for p in problems}
    return "lines" if units == {"line"} else "rows" if units == {"row"} else "records"


BOM = b"\xef\xbb\xbf"
_SURROGATE_ESCAPE_RE = re.compile(r"\\u[dD]")
_WHITESPACE_RE = re.compile(r"[ \t\n\r]*")


def _reject_constant(name: str) -> NoReturn:
    raise RecordError(f"not valid JSON ({name} is not allowed)")


# Built once: json.loads with options builds a new decoder per call, a cost at 100k lines.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def read_jsonl(path: Path, sink: Collector, mapping: FieldMapping) -> None:
    """Read a JSONL file into ``sink``; only a file that cannot be opened or read raises (InputError)."""
    try:
        f = open(path, "rb")
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise file_error(str(path), e) from None
    with f:
        try:
            read_lines(f, str(path), sink, mapping)
        except OSError as e:
            raise file_error(str(path), e) from None


def read_lines(lines: BinaryIO | Iterable[bytes], where: str, sink: Collector, mapping: FieldMapping) -> None:
    """Read JSONL from an iterable of ``\\n``-terminated byte lines (a binary file: any line length works)."""
    blanks: list[int] = []  # blank lines are only an error if a record follows them
    for lineno, raw in enumerate(lines, 1):
        if lineno == 1 and raw.startswith(BOM):
            raw = raw[len(BOM):]
        if not raw.strip():
            blanks.append(lineno)
            continue
        for n in blanks:
            sink.reject(where, n, "line", "empty line")
        blanks.clear()
        try:
            sample_id, messages, tools = _parse_line(raw, mapping)
        except RecordError as e:
            sink.reject(where, lineno, "line", e.reason)
            continue
        sink.add(where, lineno, "line", sample_id, messages, tools)


def _parse_line(raw: bytes, mapping: FieldMapping
                ) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at position {e.start + 1})") from None
    try:
        obj = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise RecordError(_syntax_reason(e)) from None
    except RecursionError:
        raise RecordError("not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of thousands of digits
        raise RecordError(f"not valid JSON ({_first_sentence(str(e))})") from None
    # Only a "\ud8xx" escape can smuggle in an unpaired surrogate, so the costly check runs only then.
    return normalize(obj, mapping, surrogates=_SURROGATE_ESCAPE_RE.search(text) is not None)


def read_json(path: Path, sink: Collector, mapping: FieldMapping) -> None:
    """Read a ``.json`` file: a JSON array of records, or JSON Lines if it does not start with ``[``."""
    where = str(path)
    try:
        data = path.read_bytes()
    except (OSError, ValueError) as e:
        raise file_error(where, e) from None
    if data.startswith(BOM):
        data = data[len(BOM):]
    if not data.lstrip(b" \t\r\n").startswith(b"["):
        read_lines(io.BytesIO(data), where, sink, mapping)  # BytesIO splits on "\n" only, like a file
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        column = e.start - data.rfind(b"\n", 0, e.start)
        raise _fatal(where, data.count(b"\n", 0, e.start) + 1,
                     f"not valid UTF-8 (byte 0x{data[e.start]:02x} at column {column})") from None
    _read_array(text, where, sink, mapping)


def _read_array(text: str, where: str, sink: Collector, mapping: FieldMapping) -> None:
    # Bad constants and huge integers reject their record, not the file: the decoder notes them and goes on.
    flaws: list[str] = []

    def constant(name: str) -> None:
        flaws.append(f"not valid JSON ({name} is not allowed)")

    def integer(digits: str) -> int:
        try:
            return int(digits)
        except ValueError as e:
            flaws.append(f"not valid JSON ({_first_sentence(str(e))})")
            return 0

    decoder = json.JSONDecoder(parse_constant=constant, parse_int=integer)
    pos = _skip_space(text, _skip_space(text, 0) + 1)  # past the "[" the caller saw
    if text.startswith("]", pos):
        _expect_end(text, pos + 1, where)
        return
    lineno, counted = 1, 0
    while True:
        lineno += text.count("\n", counted, pos)
        counted = pos
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise _fatal(where, e.lineno, _syntax_reason(e)) from None
        except RecursionError:
            raise _fatal(where, lineno, "not valid JSON (nested too deeply)") from None
        if flaws:
            sink.reject(where, lineno, "line", flaws[0])
            flaws.clear()
        else:
            try:
                sample_id, messages, tools = normalize(obj, mapping,
                                                       surrogates=_SURROGATE_ESCAPE_RE.search(text, pos, end)
                                                       is not None)
            except RecordError as e:
                sink.reject(where, lineno, "line", e.reason)
            else:
                sink.add(where, lineno, "line", sample_id, messages, tools)
        pos = _skip_space(text, end)
        if text.startswith(",", pos):
            pos = _skip_space(text, pos + 1)
        elif text.startswith("]", pos):
            _expect_end(text, pos + 1, where)
            return
        else:
            _syntax_error(text, pos, where, "Expecting ',' delimiter" if pos < len(text) else "Unterminated array")


def _skip_space(text: str, pos: int) -> int:
    match = _WHITESPACE_RE.match(text, pos)
    return match.end() if match else pos


def _expect_end(text: str, pos: int, where: str) -> None:
    pos = _skip_space(text, pos)
    if pos < len(text):
        _syntax_error(text, pos, where, "Extra data")


def _syntax_error(text: str, pos: int, where: str, msg: str) -> NoReturn:
    e = json.JSONDecodeError(msg, text, pos)
    raise _fatal(where, e.lineno, _syntax_reason(e))


def _syntax_reason(e: json.JSONDecodeError) -> str:
    # Some of json's messages end in "at" ("Invalid control character at", "Unterminated string starting at"):
    # the column follows that "at" rather than doubling it.
    msg = e.msg.removesuffix(" at")
    return f"not valid JSON ({msg} at column {e.colno})"


def _fatal(where: str, line: int, reason: str) -> InputError:
    return InputError([Problem(where, line, reason)])


def _first_sentence(text: str) -> str:
    return text.split(":")[0]
