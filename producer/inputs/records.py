"""One dataset record -> ``(id, messages)``: the validation and normalisation every input format shares.

A record is a mapping with exactly one of three fields (their names set by ``FieldMapping``):

* messages: OpenAI-style turns ``{"role": system|user|assistant|tool, "content": ..., ...}``. Extra keys
  (``tool_calls``, ``name``, ``tool_call_id``, ``reasoning_content``...) are kept untouched: chat templates use
  them. Content given as a list of ``{"type": "text", "text": ...}`` parts is joined with a single space, as
  SGLang does for string-content templates; any other part type is invalid. Content may be null (or absent) only
  on an assistant turn that has ``tool_calls``.
* prompt: a non-blank string, becoming one user turn.
* conversations: ShareGPT turns ``{"from": ..., "value": str}``; roles are mapped by ``SHAREGPT_ROLES``.

A record may also carry ``tools`` (``FieldMapping.tools_field``): the tool definitions its prompt is rendered with
(``apply_chat_template(tools=...)``: OpenAI ``{"type": "function", "function": {...}}`` objects, or whatever
objects the template reads), a list of objects or a JSON string of one (xlam stores them so); an empty list or
null is no tools. They are part of the prompt, so a derived id hashes them too.

A field whose value is null counts as absent; other fields are ignored. Trailing assistant turns are the old answer
and are dropped; what remains must contain a user turn and end with a user or tool turn (turns are validated
before dropping, so a malformed old answer still rejects the record). ``FieldMapping.system_prompt`` is then
prepended as a system turn, unless the conversation already has a system turn anywhere: theirs is kept.

The id is a non-empty string or an integer (kept as its decimal string), at most 256 characters, with no control
characters. Without one it is ``"h"`` + the first 16 hex digits of the SHA-256 of the canonical JSON of the
returned messages (system prompt included): the letter keeps it apart from integer ids, and hashing what is
actually sent makes two records with the same prompt duplicates, whatever their old answers.

Columnar sources (Parquet, Hugging Face datasets) give every row every struct field, filling the missing ones with
null; with ``columnar=True`` null-valued keys are dropped inside turns (except ``role`` and ``content``), so a turn
reads as it was written, and values JSON cannot carry (bytes, timestamps, NaN...) reject the row.

What reading a dataset yields is here too: samples, the problems found on the way, and where each one is. A place in a dataset is a path plus a 1-based number whose unit depends on the format: a ``line`` for JSONL and
JSON arrays (printed ``file:12: reason``), a ``row`` for Parquet and Hugging Face datasets (printed
``path: row 12: reason``). A folder dataset holds several files, so every sample and problem names its own file.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

MAX_ID_LEN = 256
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "function_call": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool",
}
_ID_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_SURROGATE_RE = re.compile(r"[\ud800-\udfff]")
_KEPT_WHEN_NULL = ("role", "content")
_CONTAINERS = (dict, list)
# Built once: json.dumps with options builds a new encoder per call, a cost at 100k records. It refuses NaN and
# non-JSON types, which only columnar rows can hold.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@dataclass(frozen=True)
class FieldMapping:
    """Which fields of a record hold what, and an optional system prompt for conversations without one.

    The defaults read the formats described above; a dataset with other names maps them, e.g.
    ``FieldMapping(messages_field="chat", id_field="uid")``. Raises ValueError for an unusable mapping.
    """

    messages_field: str = "messages"
    prompt_field: str = "prompt"
    conversations_field: str = "conversations"
    id_field: str = "id"
    system_prompt: str | None = None
    tools_field: str = "tools"

    def __post_init__(self) -> None:
        names = {"messages_field": self.messages_field, "prompt_field": self.prompt_field,
                 "conversations_field": self.conversations_field, "id_field": self.id_field,
                 "tools_field": self.tools_field}
        for option, value in names.items():
            if not isinstance(value, str) or not value:
                raise ValueError(f"{option}: expected a non-empty field name, got {value!r}")
        if len(set(names.values())) < len(names):
            raise ValueError("messages_field, prompt_field, conversations_field, id_field and tools_field must differ, got "
                             + ", ".join(f"{k}={v!r}" for k, v in names.items()))
        if self.system_prompt is not None:
            if not isinstance(self.system_prompt, str):
                raise ValueError(f"system_prompt: expected a string, got {type(self.system_prompt).__name__}")
            if _SURROGATE_RE.search(self.system_prompt):
                raise ValueError("system_prompt: not valid UTF-8 text (it holds an unpaired surrogate)")

    @property
    def record_fields(self) -> tuple[str, str, str]:
        return self.messages_field, self.prompt_field, self.conversations_field


DEFAULT_MAPPING = FieldMapping()


class RecordError(Exception):
    """Why one record is rejected: ``reason`` is what follows ``file:line:`` or ``path: row N:``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def normalize(obj: object, mapping: FieldMapping = DEFAULT_MAPPING, *, surrogates: bool = True,
              columnar: bool = False) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Validate one parsed record and return ``(id, messages, tools)`` (tools None: the record has none); raises
    RecordError with the reason.

    ``surrogates=False`` skips the unpaired-surrogate check, for callers that know none can be present (the check
    walks every string). ``columnar`` is for rows of Parquet and Hugging Face datasets (see the module doc).
    """
    if type(obj) is not dict:
        raise RecordError("not a JSON object")
    fields = mapping.record_fields
    present = [k for k in fields if obj.get(k) is not None]
    if len(present) > 1:
        raise RecordError("more than one of " + ", ".join(f'"{k}"' for k in fields))
    if not present:
        nulls = [f'"{k}"' for k in fields if k in obj]
        if not nulls:
            raise RecordError(f'no "{fields[0]}", "{fields[1]}" or "{fields[2]}" field')
        raise RecordError(f"{nulls[0]} is null" if len(nulls) == 1
                          else f"{', '.join(nulls[:-1])} and {nulls[-1]} are null")
    sample_id = _check_id(obj.get(mapping.id_field), mapping.id_field)
    field = present[0]
    value = obj[field]
    if field == mapping.messages_field:
        messages = _from_messages(value, field, columnar)
    elif field == mapping.prompt_field:
        if type(value) is not str:
            raise RecordError(f"{field}: expected a string, got {kind(value)}")
        if not value.strip():
            raise RecordError(f"{field}: empty string")
        messages = [{"role": "user", "content": value}]
    else:
        messages = _from_sharegpt(value, field)
    _drop_old_answer(messages, field)
    tools = _tools(obj.get(mapping.tools_field), mapping.tools_field, columnar)
    if surrogates:
        _check_encodable(messages, field, field == mapping.prompt_field)
        if tools is not None:
            _check_encodable(tools, mapping.tools_field, False)
    added = 0
    if mapping.system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": mapping.system_prompt})
        added = 1
    if sample_id is None or columnar:  # one encoding both checks a columnar row and derives the id
        canonical = _canonical(messages, field, added)
        if tools is not None:
            # Appended, so that a record without tools keeps the id it always had.
            canonical += _canonical(tools, mapping.tools_field, 0)
        if sample_id is None:
            sample_id = "h" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    return sample_id, messages, tools


def _tools(value: object, field: str, columnar: bool) -> list[dict[str, Any]] | None:
    """A record's tool definitions: a list of objects, or a JSON string of one; None for none."""
    if value is None:
        return None
    if type(value) is str:
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as e:
            reason = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise RecordError(f"{field}: a string that is not valid JSON ({reason})") from None
        if type(value) is not list:
            raise RecordError(f"{field}: a JSON string of {kind(value)}, expected a list of tool objects")
    elif type(value) is not list:
        raise RecordError(f"{field}: expected a list of tool objects or a JSON string of one, got {kind(value)}")
    for i, tool in enumerate(value):
        if type(tool) is not dict or not tool:
            got = "an empty object" if type(tool) is dict else kind(tool)
            raise RecordError(f"{field}[{i}]: expected a tool object, got {got}")
    tools: list[dict[str, Any]] = _without_nulls(value) if columnar else value
    return tools or None


def _check_id(value: object, name: str) -> str | None:
    if value is None:
        return None
    if type(value) is int:
        text = str(value)
    elif type(value) is str:
        text = value
        if not text:
            raise RecordError(f'"{name}" must not be empty')
        if _ID_CONTROL_RE.search(text):
            raise RecordError(f'"{name}" must not contain control characters')
        if _SURROGATE_RE.search(text):
            raise RecordError(f'"{name}" contains an unpaired surrogate (\\ud800-\\udfff escape)')
    else:
        raise RecordError(f'"{name}" must be a string or an integer, got {kind(value)}')
    if len(text) > MAX_ID_LEN:
        raise RecordError(f'"{name}" is longer than {MAX_ID_LEN} characters')
    return text


def _objects(value: object, field: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A conversation's turns, each with where it is (`messages[2]`) for the errors; both formats start so."""
    if type(value) is not list:
        raise RecordError(f"{field}: expected a list, got {kind(value)}")
    if not value:
        raise RecordError(f"{field}: empty list")
    for i, item in enumerate(value):
        where = f"{field}[{i}]"
        if type(item) is not dict:
            raise RecordError(f"{where}: expected an object, got {kind(item)}")
        yield where, item


def _from_messages(value: object, field: str, columnar: bool) -> list[dict[str, Any]]:
    out = []
    for where, m in _objects(value, field):
        if columnar:
            m = {k: _without_nulls(v) if type(v) in _CONTAINERS else v
                 for k, v in m.items() if v is not None or k in _KEPT_WHEN_NULL}
        role = m.get("role")
        if type(role) is not str or role not in ROLES:
            if "role" not in m:
                raise RecordError(f"{where}.role: missing")
            raise RecordError(f"{where}.role: expected one of {', '.join(ROLES)}, got {show(role)}")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and type(tool_calls) is not list:
            raise RecordError(f"{where}.tool_calls: expected a list, got {kind(tool_calls)}")
        content = m.get("content")
        if type(content) is list:
            m = {**m, "content": _join_text_parts(content, where)}
        elif content is None:
            if role != "assistant" or not tool_calls:
                state = "null" if "content" in m else "missing"
                raise RecordError(f"{where}.content: {state} (allowed only on an assistant turn with tool_calls)")
        elif type(content) is not str:
            raise RecordError(f"{where}.content: expected a string, a list of text parts or null, got {kind(content)}")
        out.append(m)
    return out


def _without_nulls(value: Any) -> Any:
    if type(value) is dict:
        return {k: _without_nulls(v) if type(v) in _CONTAINERS else v for k, v in value.items() if v is not None}
    return [_without_nulls(v) if type(v) in _CONTAINERS else v for v in value]


def _join_text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if type(part) is not dict:
            raise RecordError(f"{where}.content[{j}]: expected an object, got {kind(part)}")
        if part.get("type") != "text":
            raise RecordError(f"{where}.content[{j}]: only text parts are supported, got type {show(part.get('type'))}")
        text = part.get("text")
        if type(text) is not str:
            raise RecordError(f"{where}.content[{j}].text: expected a string, got {kind(text)}")
        texts.append(text)
    return " ".join(texts)


def _from_sharegpt(value: object, field: str) -> list[dict[str, Any]]:
    out = []
    for where, turn in _objects(value, field):
        source = turn.get("from")
        role = SHAREGPT_ROLES.get(source) if type(source) is str else None
        if role is None:
            if "from" not in turn:
                raise RecordError(f"{where}.from: missing")
            raise RecordError(f"{where}.from: expected one of {', '.join(SHAREGPT_ROLES)}, got {show(source)}")
        text = turn.get("value")
        if type(text) is not str:
            raise RecordError(f"{where}.value: expected a string, got {kind(text)}")
        out.append({"role": role, "content": text})
    return out


def _drop_old_answer(messages: list[dict[str, Any]], field: str) -> None:
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise RecordError(f"{field}: no user turn")
    last = messages[-1]["role"]
    if last not in ("user", "tool"):
        raise RecordError(f"{field}: must end with a user or tool turn (after dropping the old answer), "
                          f"ends with a {last} turn")


def _check_encodable(messages: list[dict[str, Any]], field: str, is_prompt: bool) -> None:
    for i, m in enumerate(messages):
        try:
            json.dumps(m, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            where = field if is_prompt else f"{field}[{i}]"
            raise RecordError(f"{where}: contains an unpaired surrogate (\\ud800-\\udfff escape), "
                              "which cannot be encoded as UTF-8") from None


def _canonical(messages: list[dict[str, Any]], field: str, added: int) -> str:
    """The canonical JSON of the messages; what JSON cannot carry (only a columnar row holds any) rejects the record,
    named by its path in the record (``added`` turns were prepended and are not in it)."""
    try:
        return _CANONICAL.encode(messages)  # in C: the walk below runs only for a row that fails
    except (TypeError, ValueError):
        for i, m in enumerate(messages[added:]):
            _check_json_value(m, f"{field}[{i}]")
        raise RecordError(f"{field}: holds a value that cannot be sent as JSON") from None


def _check_json_value(value: Any, where: str) -> None:
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return
    if t is float:
        if not math.isfinite(value):
            raise RecordError(f"{where}: {value} is not allowed (not valid in JSON)")
    elif t is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise RecordError(f"{where}: a key of type {type(k).__name__} cannot be sent as JSON")
            _check_json_value(v, f"{where}.{k}")
    elif t is list:
        for j, v in enumerate(value):
            _check_json_value(v, f"{where}[{j}]")
    else:
        raise RecordError(f"{where}: a value of type {t.__name__} cannot be sent as JSON")


_KINDS = {dict: "object", list: "list", str: "string", int: "integer", float: "number", bool: "boolean"}


def kind(value: object) -> str:
    """The JSON name of a value's type, for messages."""
    return "null" if value is None else _KINDS.get(type(value), type(value).__name__)


def show(value: object, limit: int = 40) -> str:
    """A short, printable rendering of a bad value for a message (it may be huge or hold a lone surrogate)."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    if len(text) > limit:
        text = text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


Unit = Literal["line", "row"]


@dataclass(frozen=True)
class Problem:
    """Something wrong with a file (line is None) or one of its lines or rows (see ``unit``)."""

    path: str
    line: int | None
    reason: str
    unit: Unit = "line"

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"

    @property
    def where(self) -> str:
        """``path``, ``path:LINE`` or ``path: row N``."""
        if self.line is None:
            return self.path
        if self.unit == "row":
            return f"{self.path}: row {self.line}"
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class Sample:
    """One valid prompt: what the producer renders and enqueues.

    ``line`` is the 1-based line (JSONL; for a JSON array the line where the record starts) or row (Parquet,
    Hugging Face datasets) of the sample in the file ``path``, as ``unit`` says.
    """

    id: str
    messages: list[dict[str, Any]]
    line: int
    path: str
    unit: Unit
    #: The record's tool definitions (producer/inputs/records.py), rendered into every turn's prompt; None: none.
    tools: list[dict[str, Any]] | None = None

    def problem(self, reason: str) -> Problem:
        """A problem located at this sample, e.g. a prompt that does not fit the context."""
        return Problem(self.path, self.line, reason, self.unit)


@dataclass
class ReadResult:
    """One dataset (a file or a folder), read: its samples plus whatever was wrong with it."""

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


class Collector:
    """Adds records to a ReadResult in reading order: the first sample of an id wins, later ones are duplicates.

    One collector spans every file of a folder dataset, so an id repeated across its files is a duplicate too.
    ``progress`` (a progress bar's ``update``) hears of the records read, every ``PROGRESS_EVERY`` records: every
    format reads through a collector, and a call per record would cost more than the bar is worth.
    """

    PROGRESS_EVERY = 1024

    def __init__(self, result: ReadResult, progress: Callable[[int], None] | None = None) -> None:
        self.result = result
        self._first: dict[str, Sample] = {}
        self._progress = progress
        self._unreported = 0

    def _count(self) -> None:
        self._unreported += 1
        if self._unreported >= self.PROGRESS_EVERY:
            self.report_progress()

    def report_progress(self) -> None:
        """Tell ``progress`` about the records not reported yet (also called once the dataset is read)."""
        if self._progress is not None and self._unreported:
            self._progress(self._unreported)
        self._unreported = 0

    def add(self, path: str, n: int, unit: Unit, sample_id: str, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None = None) -> None:
        self._count()
        first = self._first.get(sample_id)
        if first is None:
            sample = Sample(sample_id, messages, n, path, unit, tools)
            self._first[sample_id] = sample
            self.result.samples.append(sample)
            return
        seen = f"on {first.unit} {first.line}" if first.path == path else f"at {first.problem('').where}"
        self.result.duplicates.append(Problem(path, n, f'duplicate id "{sample_id}" (first seen {seen})', unit))

    def reject(self, path: str, n: int, unit: Unit, reason: str) -> None:
        self._count()
        self.result.invalid.append(Problem(path, n, reason, unit))


def file_error(where: str, e: Exception) -> InputError:
    """An InputError for a file that cannot be opened or read at all."""
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
