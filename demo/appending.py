"""Reading files that other processes are still appending to (produce's outputs, a worker's log): whole lines
only. Tests, the chaos scenarios and the benchmarks read them while the dev stack (demo/stack.py) runs."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def complete_lines(path: Path) -> list[str]:
    """The lines of ``path`` that end in a newline, decoded: what a reader of a file another process is still
    appending to may use. The last line of such a file can be half written (no trailing newline yet, perhaps cut
    inside a UTF-8 sequence), so everything after the last newline is left for the next read. A writer that has
    finished ends its file with a newline, so nothing of a finished file is lost."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    end = data.rfind(b"\n")
    return data[:end + 1].decode("utf-8", errors="replace").splitlines() if end >= 0 else []


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, which ``produce`` may still be appending to: an unterminated last line is
    not read yet (see `complete_lines`); a torn line in a finished file shows up as a missing record."""
    return [json.loads(line) for line in complete_lines(path) if line.strip()]
