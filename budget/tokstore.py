"""A run's tokenizer files in Redis (``bq:tok:{fingerprint}``, budget/keys.py): written by the producer, read by
the GPU workers that render a conversation's later turns (docs/multiturn.md, "Where rendering happens").

Why plain commands and not a script: the hash is content-addressed (the key is the Renderer fingerprint, which the
worker recomputes from the files it gets) and immutable, so there is no decision to make. Every file is written
with HSETNX in one MULTI/EXEC: a second ``produce`` of the same run, or a concurrent one, leaves the first copy as
it was, and a reader never sees part of a set. What the files are, and their size limit, is render/tokfiles.py's.
"""
from __future__ import annotations

from typing import Any, Mapping

import redis

from budget import keys

#: The most bytes (compressed, as stored) one tokenizer's hash may hold: render/tokfiles.py refuses more than
#: 64 MiB of file bytes before compressing; this is the same bound on whatever a caller hands in.
MAX_STORED_BYTES = 64 * 1024 * 1024


class TokenizerStoreError(Exception):
    """Files refused for Redis; the message says why."""


def store_files(client: "redis.Redis", fingerprint: str, files: Mapping[str, bytes]) -> int:
    """Keep ``files`` (name -> zlib bytes) as the tokenizer files of ``fingerprint``; returns how many fields
    were new (0 when this run's files were stored already). Raises TokenizerStoreError above MAX_STORED_BYTES
    or for no files, ValueError for a fingerprint that is not a sha256 hex digest."""
    key = keys.tokenizer_files(fingerprint)
    if not files:
        raise TokenizerStoreError(f"no tokenizer files to store for fingerprint {fingerprint[:12]}")
    size = sum(len(v) for v in files.values())
    if size > MAX_STORED_BYTES:
        raise TokenizerStoreError(f"the tokenizer files take {size:,} bytes compressed, more than the "
                                  f"{MAX_STORED_BYTES:,} budgetq keeps in Redis for a run's tokenizer")
    with client.pipeline(transaction=True) as p:
        for name in sorted(files):
            p.hsetnx(key, name, files[name])
        return sum(int(x) for x in p.execute())


def fetch_files(client: "redis.Redis", fingerprint: str) -> dict[str, bytes]:
    """The stored files of ``fingerprint`` (name -> zlib bytes); empty when none were stored."""
    raw: Any = client.hgetall(keys.tokenizer_files(fingerprint))
    if any(not isinstance(v, bytes) for v in raw.values()):
        raise TokenizerStoreError("the tokenizer files are binary: read them with a client without "
                                  "decode_responses")
    return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw.items()}
