"""The producer's name for render.modeldir (moved to render/ with the rendering it serves: `load_tokenizer`
resolves ``--tokenizer`` with it, in the producer and in a worker alike).

Re-exported so that code and tests importing ``producer.modeldir`` keep working unchanged.
"""
from __future__ import annotations

from render.modeldir import (
    CONTEXT_LENGTH_KEYS,
    MAX_SANE_CONTEXT,
    TEXT_CONFIG_KEYS,
    Context,
    ModelDirError,
    config_context,
    hub_cache_dir,
    hub_snapshot,
    is_hub_id,
    resolve_tokenizer,
    sane_context,
)

__all__ = ["CONTEXT_LENGTH_KEYS", "MAX_SANE_CONTEXT", "TEXT_CONFIG_KEYS", "Context", "ModelDirError",
           "config_context", "hub_cache_dir", "hub_snapshot", "is_hub_id", "resolve_tokenizer", "sane_context"]
