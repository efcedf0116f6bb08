"""Who sends each Redis command on a ``bq:`` key: redis-py's send paths wrapped to note the first source file on
the stack outside redis-py (tests/redis/test_key_ownership.py). Commands still go to the real redis-server.

In a test process `install` wraps them in place. In a subprocess (an ``rq worker``), `sitecustomize_dir` writes
a ``sitecustomize.py`` that installs it at interpreter start with a file sink: put that directory first on the
worker's PYTHONPATH, and read the file with `read_sink`.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import redis
import redis.client

ROOT = Path(__file__).resolve().parent.parent
REDIS_PKG = Path(redis.__file__).resolve().parent
SINK_ENV = "BUDGETQ_TEST_KEY_SENDERS"
_SEND_PATHS = ((redis.Redis, "execute_command"), (redis.client.Pipeline, "pipeline_execute_command"),
               (redis.client.Pipeline, "immediate_execute_command"))


@functools.lru_cache(maxsize=4096)
def _where(filename: str) -> tuple[bool, str]:
    """(is it redis-py's own code, the file relative to the repository when inside it)."""
    path = Path(filename).resolve()
    return path.is_relative_to(REDIS_PKG), str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def sender(args: tuple[Any, ...], depth: int) -> str | None:
    """The file that asked for this command if it touches a ``bq:`` key, else None."""
    if not any(isinstance(a, (str, bytes)) and a[:3] in ("bq:", b"bq:") for a in args[1:]):
        return None
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None and _where(frame.f_code.co_filename)[0]:
        frame = frame.f_back
    return _where(frame.f_code.co_filename)[1] if frame is not None else "?"


def install(note: Callable[[str, tuple[Any, ...]], None]) -> Callable[[], None]:
    """Wrap the send paths; ``note(file, args)`` for each command on a bq: key. Returns the undo."""
    originals = [(cls, name, getattr(cls, name)) for cls, name in _SEND_PATHS]
    for cls, name, original in originals:
        def wrapped(self: Any, *args: Any, __original: Any = original, **options: Any) -> Any:
            who = sender(args, 2)
            if who is not None:
                note(who, args)
            return __original(self, *args, **options)

        setattr(cls, name, wrapped)

    def undo() -> None:
        for cls, name, original in originals:
            setattr(cls, name, original)
    return undo


def install_file_sink(path: str) -> None:
    """Append ``file<TAB>command`` per command on a bq: key to ``path`` (a line each: appends do not mix)."""
    def note(who: str, args: tuple[Any, ...]) -> None:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{who}\t{args[0]!s}\n")
    install(note)


def sitecustomize_dir(where: Path) -> Path:
    """A directory holding a sitecustomize.py that installs the file sink named by $BUDGETQ_TEST_KEY_SENDERS."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"if os.environ.get({SINK_ENV!r}):\n"
        f"    sys.path.insert(0, {str(ROOT)!r})\n"
        "    from tests.key_senders import install_file_sink\n"
        f"    install_file_sink(os.environ[{SINK_ENV!r}])\n")
    return where


def read_sink(path: Path) -> dict[str, int]:
    """file -> commands on bq: keys it sent, from a file sink."""
    counts: dict[str, int] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            who, _, _ = line.partition("\t")
            counts[who] = counts.get(who, 0) + 1
    return counts


def env_for_sink(sink: Path, site_dir: Path) -> dict[str, str]:
    """The environment additions that make a child Python process record into ``sink``."""
    return {SINK_ENV: str(sink), "PYTHONPATH": os.pathsep.join([str(site_dir), os.environ.get("PYTHONPATH", "")])}
