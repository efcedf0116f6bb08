"""The run's Renderer on a GPU worker, from the tokenizer files in Redis (docs/multiturn.md, "Where rendering
happens"): worker/turns.py renders a conversation's turns i > 0 with it.

`renderer_for(client, fingerprint, ...)` fetches ``bq:tok:{fingerprint}`` (budget/runstate.py), writes the files
to ``$TMPDIR/budgetq-tok/{fingerprint}/`` (render/tokfiles.py: a temporary directory renamed into place; reused
when present), loads them with transformers offline (render/chat.py ``load_tokenizer``, ``local_files_only``),
builds the Renderer with the run's chat_template_kwargs and checks that its fingerprint is the one asked for. One
Renderer per process per (fingerprint, markers), built once: loading costs about a second.

Every failure is a `TokenizerFault`, a fault of this worker's configuration or of the run's setup (no files in
Redis, files that give another fingerprint, a cache directory it may not trust), never of the samples: the caller
gives the chunk back, as for a refused API key, and no sample is failed for it. A fingerprint mismatch is
`TokenizerMismatch`. transformers is imported on the first call only (a single-turn run never makes one).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from budget import runstate

if TYPE_CHECKING:
    import redis

    from render.chat import Renderer, ThinkMarkers

log = logging.getLogger("budgetq.worker")

#: Under the temporary directory ($TMPDIR, else /tmp): one subdirectory per fingerprint.
CACHE_DIR_NAME = "budgetq-tok"


class TokenizerFault(Exception):
    """This worker cannot render the run's conversations: a configuration fault (give the chunk back)."""


class TokenizerMismatch(TokenizerFault):
    """The files from Redis load into a tokenizer whose fingerprint is not the run's."""


_lock = threading.Lock()
_renderers: dict[tuple[str, str], "Renderer"] = {}


def cache_root() -> Path:
    """``$TMPDIR/budgetq-tok``, created private (0700). Refused when it is not ours: in a shared /tmp another user
    could have made it, and what is loaded from it must be the run's files."""
    root = Path(tempfile.gettempdir()) / CACHE_DIR_NAME
    root.mkdir(mode=0o700, exist_ok=True)
    st = root.lstat()
    if root.is_symlink() or not root.is_dir() or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise TokenizerFault(f"{root}: not a directory this worker owns and alone may write; remove it or point "
                             "TMPDIR elsewhere")
    return root


def renderer_for(client: "redis.Redis", fingerprint: str, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                 opens_markers: "ThinkMarkers | None" = None, root: Path | None = None,
                 files: str | None = None) -> "Renderer":
    """The Renderer of the run whose settings say ``tokenizer: fingerprint`` (and these chat_template_kwargs;
    ``opens_markers`` as the producer's, for a parser with markers of its own). ``files``: the fingerprint the
    tokenizer files are stored under, when it is not ``fingerprint`` (a sample of a template kwargs mix renders
    with the run's files and kwargs of its own). Raises TokenizerFault."""
    markers = "" if opens_markers is None else json.dumps([opens_markers.start, opens_markers.end])
    with _lock:  # rendering runs in threads; one load per fingerprint, whoever asks first
        cached = _renderers.get((fingerprint, markers))
        if cached is None:
            cached = _build(client, fingerprint, chat_template_kwargs, opens_markers, root or cache_root(),
                            files or fingerprint)
            _renderers[(fingerprint, markers)] = cached
        return cached


def _build(client: "redis.Redis", fingerprint: str, kwargs: Mapping[str, Any] | None,
           opens_markers: "ThinkMarkers | None", root: Path, files_key: str) -> "Renderer":
    from render import tokfiles
    try:
        directory = root / files_key
        if directory.is_dir():
            try:
                return _load(directory, fingerprint, kwargs, opens_markers)
            except TokenizerFault as exc:  # a stale or damaged local copy: Redis holds the run's files
                log.warning("tokenizer cache %s is not usable (%s): fetching it again", directory, exc)
                tokfiles.discard(directory)
        files = runstate.fetch_files(client, files_key)
        if not files:
            raise TokenizerFault(f"Redis holds no tokenizer files for fingerprint {files_key[:12]} "
                                 "(the run's produce has not stored them)")
        tokfiles.unpack(files, directory)
        renderer = _load(directory, fingerprint, kwargs, opens_markers)
    except (tokfiles.TokenizerFilesError, runstate.TokenizerStoreError, ValueError, OSError) as exc:
        raise TokenizerFault(f"tokenizer {fingerprint[:12]}: {exc}") from exc
    log.info("tokenizer %s loaded from Redis into %s", fingerprint[:12], directory)
    return renderer


def _load(directory: Path, fingerprint: str, kwargs: Mapping[str, Any] | None,
          opens_markers: "ThinkMarkers | None") -> "Renderer":
    from render.chat import Renderer, RenderError, load_tokenizer
    try:
        renderer = Renderer(load_tokenizer(directory), chat_template_kwargs=kwargs, opens_markers=opens_markers)
    except RenderError as exc:
        raise TokenizerFault(str(exc)) from exc
    got = renderer.fingerprint()
    if got != fingerprint:
        raise TokenizerMismatch(f"the tokenizer files in {directory} give fingerprint {got[:12]}, not the run's "
                                f"{fingerprint[:12]}: another tokenizer, template or chat_template_kwargs")
    return renderer


def forget() -> None:
    """Drop the loaded Renderers (tests)."""
    with _lock:
        _renderers.clear()
