"""Read prompt datasets (JSONL) into validated, normalized chat samples.

Every sample that reaches the queue spends budget and a worker's time, so a malformed line is caught here, where
it can be reported as ``file:line: reason``, rather than as a failed job later.

One JSON object per line with exactly one of:

* ``messages``: OpenAI-style turns ``{"role": system|user|assistant|tool, "content": ..., ...}``. Extra keys
  (``tool_calls``, ``name``, ``tool_call_id``, ``reasoning_content``...) are kept untouched: chat templates use
  them. Content given as a list of ``{"type": "text", "text": ...}`` parts is joined with a single space, as
  SGLang does for string-content templates; any other part type is invalid. Content may be null (or absent) only
  on an assistant turn that has ``tool_calls``.
* ``prompt``: a non-blank string, becoming one user turn.
* ``conversations``: ShareGPT turns ``{"from": ..., "value": str}``; roles are mapped by ``SHAREGPT_ROLES``.

Decisions (the lead may revisit them):

* A field whose value is null counts as absent (exports of mixed datasets fill missing columns with null). Other
  top-level keys are ignored.
* Trailing assistant turns are the old answer and are dropped; what remains must contain a user turn and end with a
  user or tool turn. Turns are validated before dropping, so a malformed old answer still makes the line invalid.
* Blank (whitespace-only) lines at the end of the file are ignored; a blank line followed by a record is reported
  as ``empty line``, because in the middle of a file it usually means a record was lost or split.
* Line numbers count ``\\n`` only (the file is split as bytes), so a JSON string holding U+2028 stays one line.
  A UTF-8 BOM at the start of the file is skipped. Each line is decoded on its own: one bad line does not spoil
  the file.
* ``id`` is a non-empty string or an integer (kept as its decimal string), at most 256 characters, with no control
  characters. Without one, the id is ``"h"`` + the first 16 hex digits of the SHA-256 of the canonical JSON of
  the returned messages: the letter keeps it apart from integer ids, and hashing what is actually sent means two
  records with the same prompt (whatever their old answers) are duplicates.
* Duplicate ids: the first wins; later ones are reported in ``ReadResult.duplicates``, which is not an error.
* NaN/Infinity literals and ``\\ud800``-style unpaired surrogates are rejected: neither survives JSON/UTF-8
  encoding downstream.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""Dataset names become parts of Redis keys, RQ job ids and output paths: keep them to a safe alphabet."""
MAX_ID_LEN = 256
MAX_LISTED_PER_FILE = 50
"""Bad lines listed per file in an InputError; a 100k-line file of the wrong format needs no 100k-line message."""
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "function_call": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool",
}
RECORD_FIELDS = ("messages", "prompt", "conversations")
_BOM = b"\xef\xbb\xbf"
_ID_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")
_SURROGATE_ESCAPE_RE = re.compile(r"\\u[dD]")
_NAME_RULE = 'letters, digits, "_" and "-" only, 1 to 64 characters'


@dataclass(frozen=True)
class Sample:
    """One valid prompt: what the producer renders and enqueues."""

    id: str
    messages: list[dict[str, Any]]
    line: int


@dataclass(frozen=True)
class Problem:
    """Something wrong with a file (line is None) or one of its lines."""

    path: str
    line: int | None
    reason: str

    def __str__(self) -> str:
        if self.line is None:
            return f"{self.path}: {self.reason}"
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class ReadResult:
    """One dataset file, read: its samples plus whatever was wrong with it."""

    name: str
    path: Path
    samples: list[Sample]
    invalid: list[Problem]
    duplicates: list[Problem]


class InputError(Exception):
    """A user error in the datasets given; ``str(e)`` is the full message, ``problems`` the structured list."""

    def __init__(self, problems: list[Problem], message: str | None = None) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(map(str, self.problems)) if message is None else message)


class _Invalid(Exception):
    """Why one line is rejected; internal flow control, caught per line."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _reject_constant(name: str) -> NoReturn:
    raise _Invalid(f"not valid JSON ({name} is not allowed)")


# Built once: json.loads/json.dumps with options build a new decoder/encoder per call, a cost at 100k lines.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def valid_name(name: str) -> bool:
    """True if ``name`` can be a dataset name (also used for ``--budget NAME=AMOUNT``)."""
    return NAME_RE.fullmatch(name) is not None


def parse_dataset_arg(arg: str) -> tuple[str, Path]:
    """Split ``NAME=PATH`` or ``PATH`` (the name is then the file's stem).

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
    if not valid_name(path.stem):
        raise InputError([Problem(arg, None, f'the file name "{path.stem}" cannot be a dataset name '
                                             f"({_NAME_RULE}); give one as NAME=PATH")])
    return path.stem, path


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long, a NUL byte: not an existing file either way
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


def read_dataset(name: str, path: Path) -> ReadResult:
    """Read one file. Bad lines and duplicates are collected, never raised; only an unreadable file raises."""
    result = ReadResult(name, path, [], [], [])
    try:
        f = open(path, "rb")
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise _file_error(str(path), e) from None
    with f:
        try:
            _read_lines(f, result)
        except OSError as e:
            raise _file_error(str(path), e) from None
    return result


def _read_lines(f: BinaryIO, result: ReadResult) -> None:
    where = str(result.path)
    first_line: dict[str, int] = {}
    blanks: list[int] = []  # blank lines are only an error if a record follows them
    for lineno, raw in enumerate(f, 1):  # binary iteration splits on b"\n" only, and any line length works
        if lineno == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        if not raw.strip():
            blanks.append(lineno)
            continue
        result.invalid.extend(Problem(where, n, "empty line") for n in blanks)
        blanks.clear()
        try:
            sample_id, messages = _parse_line(raw)
        except _Invalid as e:
            result.invalid.append(Problem(where, lineno, e.reason))
            continue
        first = first_line.setdefault(sample_id, lineno)
        if first != lineno:
            result.duplicates.append(Problem(where, lineno, f'duplicate id "{sample_id}" (first seen on line {first})'))
        else:
            result.samples.append(Sample(sample_id, messages, lineno))


def _file_error(where: str, e: Exception) -> InputError:
    if isinstance(e, FileNotFoundError):
        reason = "file not found"
    elif isinstance(e, IsADirectoryError):
        reason = "is a directory, not a file"
    elif isinstance(e, PermissionError):
        reason = "permission denied"
    elif isinstance(e, OSError):
        reason = f"cannot read ({e.strerror or e})"
    else:
        reason = f"invalid path ({e})"
    return InputError([Problem(where, None, reason)])


def read_all(args: list[str], skip_invalid: bool) -> list[ReadResult]:
    """Parse dataset arguments and read every file, raising one InputError that lists everything wrong.

    Bad lines are fatal unless ``skip_invalid``; a file without a single valid sample always is.
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
            results.append(read_dataset(name, path))
        except InputError as e:
            problems.extend(e.problems)
    if problems:
        raise InputError(problems)

    lines: list[str] = []
    listed_bad_lines = False
    for r in results:
        if r.invalid and not skip_invalid:
            listed_bad_lines = True
            problems.extend(r.invalid)
            lines.extend(map(str, r.invalid[:MAX_LISTED_PER_FILE]))
            if len(r.invalid) > MAX_LISTED_PER_FILE:
                lines.append(f"{r.path}: ... and {len(r.invalid) - MAX_LISTED_PER_FILE} more invalid lines")
        if not r.samples:
            problem = Problem(str(r.path), None, "no valid samples")
            problems.append(problem)
            lines.append(str(problem))
    if problems:
        if listed_bad_lines:
            lines.append("use --skip-invalid to skip bad lines")
        raise InputError(problems, "\n".join(lines))
    return results


def _parse_line(raw: bytes) -> tuple[str, list[dict[str, Any]]]:
    """Decode, parse and normalize one non-blank line into (id, messages); raises _Invalid with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Invalid(f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at position {e.start + 1})") from None
    try:
        obj = _DECODER.decode(text)
    except json.JSONDecodeError as e:
        raise _Invalid(f"not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise _Invalid("not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of thousands of digits
        raise _Invalid(f"not valid JSON ({_first_sentence(str(e))})") from None
    if type(obj) is not dict:
        raise _Invalid("not a JSON object")
    present = [k for k in RECORD_FIELDS if obj.get(k) is not None]
    if len(present) > 1:
        raise _Invalid('more than one of "messages", "prompt", "conversations"')
    if not present:
        nulls = [k for k in RECORD_FIELDS if k in obj]
        raise _Invalid(f'"{nulls[0]}" is null' if nulls else 'no "messages", "prompt" or "conversations" field')
    sample_id = _check_id(obj.get("id"))
    field = present[0]
    value = obj[field]
    if field == "messages":
        messages = _from_messages(value)
    elif field == "prompt":
        if type(value) is not str:
            raise _Invalid(f"prompt: expected a string, got {_kind(value)}")
        if not value.strip():
            raise _Invalid("prompt: empty string")
        messages = [{"role": "user", "content": value}]
    else:
        messages = _from_sharegpt(value)
    _drop_old_answer(messages, field)
    # Only a "\ud8xx" escape can smuggle in an unpaired surrogate, so the costly check runs only then.
    if _SURROGATE_ESCAPE_RE.search(text):
        _check_encodable(messages, field)
    if sample_id is None:
        canonical = _CANONICAL.encode(messages).encode("utf-8")
        sample_id = "h" + hashlib.sha256(canonical).hexdigest()[:16]
    return sample_id, messages


def _check_id(value: object) -> str | None:
    if value is None:
        return None
    if type(value) is int:
        text = str(value)
    elif type(value) is str:
        text = value
        if not text:
            raise _Invalid('"id" must not be empty')
        if _ID_CONTROL_RE.search(text):
            raise _Invalid('"id" must not contain control characters')
        if _SURROGATE_RE.search(text):
            raise _Invalid('"id" contains an unpaired surrogate (\\ud800-\\udfff escape)')
    else:
        raise _Invalid(f'"id" must be a string or an integer, got {_kind(value)}')
    if len(text) > MAX_ID_LEN:
        raise _Invalid(f'"id" is longer than {MAX_ID_LEN} characters')
    return text


def _from_messages(value: object) -> list[dict[str, Any]]:
    if type(value) is not list:
        raise _Invalid(f"messages: expected a list, got {_kind(value)}")
    if not value:
        raise _Invalid("messages: empty list")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if type(m) is not dict:
            raise _Invalid(f"{where}: expected an object, got {_kind(m)}")
        role = m.get("role")
        if type(role) is not str or role not in ROLES:
            if "role" not in m:
                raise _Invalid(f"{where}.role: missing")
            raise _Invalid(f"{where}.role: expected one of {', '.join(ROLES)}, got {_show(role)}")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and type(tool_calls) is not list:
            raise _Invalid(f"{where}.tool_calls: expected a list, got {_kind(tool_calls)}")
        content = m.get("content")
        if type(content) is list:
            m = {**m, "content": _join_text_parts(content, where)}
        elif content is None:
            if role != "assistant" or not tool_calls:
                state = "null" if "content" in m else "missing"
                raise _Invalid(f"{where}.content: {state} (allowed only on an assistant turn with tool_calls)")
        elif type(content) is not str:
            raise _Invalid(f"{where}.content: expected a string, a list of text parts or null, got {_kind(content)}")
        out.append(m)
    return out


def _join_text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if type(part) is not dict:
            raise _Invalid(f"{where}.content[{j}]: expected an object, got {_kind(part)}")
        if part.get("type") != "text":
            raise _Invalid(f"{where}.content[{j}]: only text parts are supported, got type {_show(part.get('type'))}")
        text = part.get("text")
        if type(text) is not str:
            raise _Invalid(f"{where}.content[{j}].text: expected a string, got {_kind(text)}")
        texts.append(text)
    return " ".join(texts)


def _from_sharegpt(value: object) -> list[dict[str, Any]]:
    if type(value) is not list:
        raise _Invalid(f"conversations: expected a list, got {_kind(value)}")
    if not value:
        raise _Invalid("conversations: empty list")
    out = []
    for i, turn in enumerate(value):
        where = f"conversations[{i}]"
        if type(turn) is not dict:
            raise _Invalid(f"{where}: expected an object, got {_kind(turn)}")
        source = turn.get("from")
        role = SHAREGPT_ROLES.get(source) if type(source) is str else None
        if role is None:
            if "from" not in turn:
                raise _Invalid(f"{where}.from: missing")
            raise _Invalid(f"{where}.from: expected one of {', '.join(SHAREGPT_ROLES)}, got {_show(source)}")
        text = turn.get("value")
        if type(text) is not str:
            raise _Invalid(f"{where}.value: expected a string, got {_kind(text)}")
        out.append({"role": role, "content": text})
    return out


def _drop_old_answer(messages: list[dict[str, Any]], field: str) -> None:
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise _Invalid(f"{field}: no user turn")
    last = messages[-1]["role"]
    if last not in ("user", "tool"):
        raise _Invalid(f"{field}: must end with a user or tool turn (after dropping the old answer), "
                       f"ends with a {last} turn")


def _check_encodable(messages: list[dict[str, Any]], field: str) -> None:
    for i, m in enumerate(messages):
        try:
            json.dumps(m, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            where = field if field == "prompt" else f"{field}[{i}]"
            raise _Invalid(f"{where}: contains an unpaired surrogate (\\ud800-\\udfff escape), "
                           "which cannot be encoded as UTF-8") from None


_KINDS = {dict: "object", list: "list", str: "string", int: "integer", float: "number", bool: "boolean"}


def _kind(value: object) -> str:
    return "null" if value is None else _KINDS.get(type(value), type(value).__name__)


def _show(value: object, limit: int = 40) -> str:
    """A short, printable rendering of a bad value for a message (it may be huge or hold a lone surrogate)."""
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > limit:
        text = text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _first_sentence(text: str) -> str:
    return text.split(":")[0]
