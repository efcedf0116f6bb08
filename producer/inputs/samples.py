"""What reading a dataset yields: samples, the problems found on the way, and where each one is.

A place in a dataset is a path plus a 1-based number whose unit depends on the format: a ``line`` for JSONL and
JSON arrays (printed ``file:12: reason``), a ``row`` for Parquet and Hugging Face datasets (printed
``path: row 12: reason``). A folder dataset holds several files, so every sample and problem names its own file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

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
