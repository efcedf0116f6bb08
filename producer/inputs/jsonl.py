"""JSON Lines and JSON-array files, read record by record with the line each record is on.

JSONL: one record a line. Line numbers count ``\\n`` only (the file is split as bytes), so a JSON string holding
U+2028 stays one line. A UTF-8 BOM at the start is skipped. Each line is decoded on its own: one bad line does not
spoil the file. Blank (whitespace-only) lines at the end are ignored; a blank line followed by a record is an
``empty line``, because in the middle of a file it usually means a record was lost or split.

JSON array: the file is one array of records, which may span lines (pretty-printed). A record is reported at the
line where it starts (its ``{``), counting ``\\n`` as for JSONL. A record that parses but is invalid (wrong shape,
NaN, an integer too long) is a bad record like a bad JSONL line; but bad UTF-8 or broken JSON syntax leave no way to
know where the next record starts, so they make the whole file unreadable: ``file:LINE: reason`` at the error's
own line, fatal even with ``--skip-invalid``. The file is read whole into memory.

NaN/Infinity literals and ``\\ud800``-style unpaired surrogates are rejected: neither survives JSON/UTF-8
encoding downstream.
"""
from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, BinaryIO, Iterable, NoReturn

from producer.inputs.records import FieldMapping, RecordError, normalize
from producer.inputs.samples import Collector, InputError, Problem, file_error

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
