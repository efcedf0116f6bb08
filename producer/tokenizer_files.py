"""The producer's side of a run's tokenizer files in Redis (docs/multiturn.md, "Where rendering happens").

A GPU worker renders a multi-turn conversation's later turns, and a GPU host has no ``--tokenizer`` directory:
`produce` stores the files at attach, once per fingerprint, and the worker (worker/tokenizer_cache.py) loads them
and checks the fingerprint. Attach (producer/session/attach.py) calls `share_tokenizer` for a run with conversations of
more than one user turn; single-turn runs never store anything.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from budget import tokstore
from render import tokfiles
from render.modeldir import ModelDirError, resolve_tokenizer

if TYPE_CHECKING:
    import redis


class ShareError(Exception):
    """The tokenizer files cannot be stored (missing files, over the size limit); the message says why."""


def share_tokenizer(client: "redis.Redis", tokenizer: str | Path, fingerprint: str) -> int:
    """Store the tokenizer files of ``tokenizer`` (``--tokenizer``: a directory, or a hub id's cached snapshot)
    under ``fingerprint`` (the run's ``Renderer.fingerprint()``); returns the files newly stored (0: stored by an
    earlier run). Raises ShareError naming the directory."""
    try:
        return tokstore.store_files(client, fingerprint, tokfiles.pack(resolve_tokenizer(tokenizer)))
    except (ModelDirError, tokfiles.TokenizerFilesError, tokstore.TokenizerStoreError) as exc:
        raise ShareError(f"cannot share the tokenizer with the workers: {exc}") from None
