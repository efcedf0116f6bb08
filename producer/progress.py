"""Progress bars on a terminal for the long phases of ``produce``: validating, rendering, enqueueing.

100,000 prompts take about a minute to render and seconds to read and to enqueue; without a bar a user cannot
tell a slow run from a stuck one. Bars go to stderr (stdout carries the summary table and ``--json``), and only
when the caller says so: ``produce`` shows them when stderr is a terminal and ``--quiet`` is not given.
"""
from __future__ import annotations

from typing import Any, Protocol


class Bar(Protocol):
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int | None, what: str, *, show: bool, unit: str = " prompts") -> Bar:
    """A tqdm bar on stderr (``total`` None: a counter and a rate); a bar that does nothing when not shown."""
    if not show:
        return _NoBar()
    from tqdm import tqdm
    bar: Any = tqdm(total=total, desc=what, unit=unit, leave=False, mininterval=0.5)
    return bar
