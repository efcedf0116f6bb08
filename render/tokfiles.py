"""A tokenizer directory as the files a GPU worker needs to render with it, and back (docs/multiturn.md).

A worker renders a conversation's later turns with the run's own tokenizer, but a GPU host has only Redis and the
SGLang URL, not the producer's ``--tokenizer`` directory. So the producer packs the files that decide the ids
(`pack`: name -> zlib bytes; budget/runstate.py keeps them in Redis under the run's fingerprint) and a worker
writes them back to a private cache directory (`unpack`) that transformers loads with ``local_files_only``.

Pure file work: no Redis, no transformers. Names are checked on both sides (`allowed_name`): a name read back
from Redis becomes a path, so only the plain file names listed here are ever written.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Final, Mapping

#: The files of a tokenizer directory that the rendering reads: the fast tokenizer itself, its config (chat
#: template, special tokens, model_max_length), a separate chat template (``chat_template.jinja``, ``.json``),
#: added tokens, and generation_config.json. Model weights and config.json are never packed.
NAMES: Final = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "generation_config.json")
#: The chat template file transformers reads before tokenizer_config.json's ``chat_template``.
CHAT_TEMPLATE_FILE: Final = "chat_template.jinja"
_CHAT_TEMPLATE: Final = re.compile(r"chat_template(\.[A-Za-z0-9_-]+)?\.(jinja|json)")
#: Without these a fast tokenizer cannot be rebuilt from the files alone.
REQUIRED: Final = ("tokenizer.json", "tokenizer_config.json")
#: The most file bytes (uncompressed) a run may keep in Redis: a real 150K-vocabulary tokenizer.json is ~10 MiB.
MAX_BYTES: Final = 64 * 1024 * 1024
#: zlib level: level 1 is within a few percent of level 6 on tokenizer JSON and several times faster.
LEVEL: Final = 1


class TokenizerFilesError(Exception):
    """Files that cannot be packed or unpacked; the message names the directory or file."""


def allowed_name(name: str) -> bool:
    """A file name this module packs and unpacks: one of NAMES or a chat template file, never a path."""
    return name in NAMES or bool(_CHAT_TEMPLATE.fullmatch(name))


def pack(directory: str | Path, limit: int = MAX_BYTES, *, chat_template: str | None = None) -> dict[str, bytes]:
    """The tokenizer files of ``directory`` (those of NAMES and chat_template.* it holds), each zlib-compressed.
    ``chat_template`` (a run's ``--chat-template`` text) replaces the directory's chat_template.* files as its
    ``chat_template.jinja``, which transformers prefers to a template in tokenizer_config.json: the worker then
    loads the run's template.

    Raises TokenizerFilesError when REQUIRED files are missing (a slow tokenizer: vocab.json/merges.txt only) or
    the files hold more than ``limit`` bytes, naming the directory and the sizes."""
    root = Path(directory)
    if not root.is_dir():
        raise TokenizerFilesError(f"tokenizer directory not found: {root}")
    files = sorted(p for p in root.iterdir() if allowed_name(p.name) and p.is_file()  # symlinks: hub snapshots
                   and not (chat_template is not None and _CHAT_TEMPLATE.fullmatch(p.name)))
    missing = [n for n in REQUIRED if not (root / n).is_file()]
    if missing:
        raise TokenizerFilesError(f"{root}: no {', '.join(missing)}: a worker can render only with a fast "
                                  "tokenizer's tokenizer.json and its tokenizer_config.json")
    template = {} if chat_template is None else {CHAT_TEMPLATE_FILE: chat_template.encode("utf-8")}
    total = sum(p.stat().st_size for p in files) + sum(len(data) for data in template.values())
    if total > limit:
        raise TokenizerFilesError(f"{root}: the tokenizer files hold {total:,} bytes "
                                  f"({', '.join(sorted([*(p.name for p in files), *template]))}), more than the "
                                  f"{limit:,} bytes budgetq keeps in Redis for a run's tokenizer")
    packed = {p.name: zlib.compress(p.read_bytes(), LEVEL) for p in files}
    return {**packed, **{name: zlib.compress(data, LEVEL) for name, data in template.items()}}


def _inflate(name: str, data: bytes, room: int) -> bytes:
    """``data`` decompressed, refusing more than ``room`` bytes (a hash edited into a zip bomb stays small)."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, room + 1)
    except zlib.error as exc:
        raise TokenizerFilesError(f"{name}: not zlib data ({exc})") from None
    if len(out) > room or inflater.unconsumed_tail:
        raise TokenizerFilesError(f"{name}: more than {room:,} bytes uncompressed")
    if not inflater.eof:
        raise TokenizerFilesError(f"{name}: truncated zlib data")
    return out


def unpack(files: Mapping[str, bytes], destination: str | Path, limit: int = MAX_BYTES) -> Path:
    """Write packed ``files`` to directory ``destination``, atomically: into a temporary sibling first, renamed
    into place once every file is written, so another process (or thread) never loads a half-written directory.
    If ``destination`` already exists (another worker process won the race), it is kept and returned as is.

    Raises TokenizerFilesError for a name that is not a tokenizer file name, bad zlib data or more than
    ``limit`` bytes in all."""
    final = Path(destination)
    bad = sorted(n for n in files if not allowed_name(n))
    if bad:
        raise TokenizerFilesError(f"not tokenizer file names: {', '.join(repr(n) for n in bad)}")
    missing = [n for n in REQUIRED if n not in files]
    if missing:
        raise TokenizerFilesError(f"no {', '.join(missing)} among the files ({', '.join(sorted(files))})")
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        room = limit
        for name in sorted(files):
            raw = _inflate(name, files[name], room)
            room -= len(raw)
            with open(staging / name, "wb") as fh:
                fh.write(raw)
                fh.flush()
                os.fsync(fh.fileno())
        try:
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():
                raise
            shutil.rmtree(staging, ignore_errors=True)  # lost the race: the winner's files are the same files
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def discard(directory: str | Path) -> None:
    """Remove an unpacked directory that turned out bad (moved aside first, so nothing loads it half-deleted)."""
    path = Path(directory)
    if not path.exists():
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale.", dir=path.parent))
    try:
        os.rename(path, aside / path.name)
    except OSError:
        pass  # another process moved it already
    shutil.rmtree(aside, ignore_errors=True)
