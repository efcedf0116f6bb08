"""The RQ job functions. ``worker.Worker`` runs only the names in ALLOWED."""
from __future__ import annotations

from typing import Any

from budget.payload import CONVERSATION_VERSION, JOB_FUNCTION, REASONING_PARSERS, VERSION, VERSIONS, ChunkPayload
from worker import runtime


def run_chunk(chunk: ChunkPayload) -> dict[str, Any]:
    """Generate and commit one chunk of samples. Returns a small report (RQ keeps it as the job result)."""
    if not isinstance(chunk, dict) or chunk.get("v") not in VERSIONS:
        raise ValueError(f"unsupported chunk payload (expected a version in {VERSIONS})")
    if chunk.get("v") == CONVERSATION_VERSION and not chunk.get("conversation") or \
            chunk.get("v") == VERSION and chunk.get("conversation"):
        raise ValueError(f"unsupported chunk payload: version {CONVERSATION_VERSION} and a conversation block go "
                         "together")
    parser = chunk.get("reasoning_parser")
    if parser is not None and parser not in REASONING_PARSERS:
        # Refused before anything is generated: a newer producer's parser, which this worker cannot apply.
        raise ValueError(f"unsupported chunk payload: reasoning_parser {parser!r} is not one this worker knows "
                         f"({', '.join(REASONING_PARSERS)}); upgrade the worker")
    return runtime.current().run_chunk(chunk).as_dict()


ALLOWED = frozenset({JOB_FUNCTION})
