"""The RQ job functions. ``worker.Worker`` runs only the names in ALLOWED."""
from __future__ import annotations

from typing import Any

from budget.payload import JOB_FUNCTION, OTHER_VERSION, REASONING_PARSERS, VERSION, ChunkPayload
from worker import runtime


def run_chunk(chunk: ChunkPayload) -> dict[str, Any]:
    """Generate and commit one chunk of samples. Returns a small report (RQ keeps it as the job result).

    Refused before anything is generated: a payload of another run format (budget/payload.py VERSION), a
    reasoning parser this worker does not know, a multi-turn sample without the chunk's conversation block."""
    if not isinstance(chunk, dict) or chunk.get("v") != VERSION:
        version = chunk.get("v") if isinstance(chunk, dict) else None
        raise ValueError(f"unsupported chunk payload: version {version!r}, this worker runs {VERSION}: {OTHER_VERSION}")
    parser = chunk.get("reasoning_parser")
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unsupported chunk payload: reasoning_parser {parser!r} is not one this worker knows "
                         f"({', '.join(REASONING_PARSERS)}); upgrade the worker")
    if "conversation" not in chunk and any(s.get("turns", 1) > 1 for s in chunk.get("samples", [])):
        raise ValueError("unsupported chunk payload: multi-turn samples without a conversation block")
    return runtime.current().run_chunk(chunk).as_dict()


ALLOWED = frozenset({JOB_FUNCTION})
