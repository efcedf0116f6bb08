"""The RQ job functions. ``worker.Worker`` runs only the names in ALLOWED."""
from __future__ import annotations

from typing import Any

from budget.payload import JOB_FUNCTION, VERSION, ChunkPayload
from worker import runtime


def run_chunk(chunk: ChunkPayload) -> dict[str, Any]:
    """Generate and commit one chunk of samples. Returns a small report (RQ keeps it as the job result)."""
    if not isinstance(chunk, dict) or chunk.get("v") != VERSION:
        raise ValueError(f"unsupported chunk payload (expected version {VERSION})")
    return runtime.current().run_chunk(chunk).as_dict()


ALLOWED = frozenset({JOB_FUNCTION})
