"""Log lines of the workers and of ``produce``: one line per event, as text or as JSON (``BUDGETQ_LOG_FORMAT``).

JSON: one object per line with ``ts`` (UTC, ISO 8601 with milliseconds), ``level`` (``debug``, ``info``,
``warning``, ``error``, ``critical``), ``logger``, ``msg``, then the event's extra fields (``log.info(...,
extra={"dataset": name})``), and ``exc`` with the traceback when there is one. A traceback stays inside its
line (JSON escapes the newlines), so a log shipper never splits an event.

Both formats mask the password of any URL in a message (``redis://user:***@host``): the Redis URL is the one
secret budgetq is ever handed on a command line, and a library's error message may quote it.

Shared by the workers (worker/rqworker.py) and ``produce`` (producer/cli.py); it imports nothing of either.
"""
from __future__ import annotations

import json
import logging
import re
import sys
from datetime import datetime, timezone
from typing import Any, Final, TextIO

FORMATS: Final = ("text", "json")
#: A URL's ``user:password@`` part: the password is replaced by ***.
_URL_PASSWORD: Final = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]*:)[^\s@/]+@")
#: LogRecord attributes that are not an event's extra fields.
_RECORD_ATTRS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}
_MARK: Final = "_budgetq_handler"


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ***."""
    return _URL_PASSWORD.sub(r"\g<head>***@", text)


def parse_format(value: str | None, name: str = "BUDGETQ_LOG_FORMAT") -> str:
    fmt = (value or "text").strip().lower() or "text"
    if fmt not in FORMATS:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(FORMATS)}")
    return fmt


def _jsonable(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return redact(str(value))


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, the extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and not key.startswith("_") and key not in out:
                out[key] = _jsonable(value)
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """A classic format string; URL passwords masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class PlainFormatter(TextFormatter):
    """The message alone, as ``produce`` always printed it; ``debug: `` before debug lines."""

    def __init__(self) -> None:
        super().__init__("%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return "debug: " + text if record.levelno < logging.INFO else text


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the event (click's test runner swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def make_formatter(fmt: str, text: logging.Formatter | None = None) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else (text or PlainFormatter())


def configure(name: str, *, fmt: str, level: int | str, text: logging.Formatter | None = None) -> logging.Logger:
    """Send logger ``name``'s records (and its children's) to stderr, one line each, in ``fmt``; replaces the
    handler a previous call installed, so it can be called once per command."""
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        if getattr(handler, _MARK, False):
            logger.removeHandler(handler)
    handler = StderrHandler()
    setattr(handler, _MARK, True)
    handler.setFormatter(make_formatter(fmt, text))
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    logger.propagate = False
    return logger
