"""Model directories as they are on disk: where ``--tokenizer`` points, and the context length they state.

Two things real model repositories do that a hand-made tokenizer directory does not:

- **The tokenizer often does not know the context.** ``model_max_length`` is left unset in many
  tokenizer_config.json files, and transformers then reports its sentinel ``VERY_LARGE_INTEGER`` (``int(1e30)``).
  The model's ``config.json`` beside it says the context the weights were trained for, the value SGLang itself
  derives when it is started without ``--context-length``. `config_context` reads it as SGLang does
  (``sglang/srt/utils/hf_transformers_utils.py``, ``get_hf_text_config`` and ``get_context_length``): the text
  model's sub-config of a multimodal model (``text_config``, ...), the first of CONTEXT_LENGTH_KEYS, times the
  rope scaling factor unless the scaling already names its original length or is llama3's.
- **A hub id instead of a directory.** ``--tokenizer Qwen/Qwen3-8B`` names a repository that the Hugging Face
  tools keep in a local cache: ``<cache>/models--Qwen--Qwen3-8B/snapshots/<commit>/`` (files there are symlinks
  into ``../../blobs/``), ``refs/main`` holding the commit. `resolve_tokenizer` finds that snapshot offline;
  nothing is ever downloaded (``HF_HUB_OFFLINE`` semantics), and a missing entry is an error naming the cache.

Pure file reading: no transformers, no network, so it runs before anything else is loaded.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Mapping

#: SGLang's order: some configs have several of these and the first one wins.
CONTEXT_LENGTH_KEYS: Final = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                              "max_position_embeddings")
#: The sub-configs SGLang takes as the language model's of a multimodal model, in its order.
TEXT_CONFIG_KEYS: Final = ("text_config", "llm_config", "language_config", "thinker_config")
# transformers uses int(1e30) for "unknown"; no real model has a context of ten million tokens or more.
MAX_SANE_CONTEXT: Final = 10_000_000
_HUB_ID: Final = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelDirError(Exception):
    """A tokenizer argument or model directory that cannot be used; the message says where was looked."""


@dataclass(frozen=True)
class Context:
    """A context length and where it came from, as `produce` reports it."""

    tokens: int
    source: str  # "--max-context", "tokenizer model_max_length", "config.json max_position_embeddings", ...


def sane_context(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SANE_CONTEXT:
        return value
    if isinstance(value, float) and value.is_integer() and 1 <= value <= MAX_SANE_CONTEXT:
        return int(value)
    return None


# ---------------------------------------------------------------------------------------------- hub cache

def hub_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: HF_HUB_CACHE, else (the older)
    HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub."""
    env = os.environ if environ is None else environ
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(env[key]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "huggingface" / "hub"


def is_hub_id(value: str) -> bool:
    """``org/name`` (what the hub calls a repo id), not a path: no leading ``.``, ``/`` or ``~``."""
    return bool(_HUB_ID.fullmatch(value)) and ".." not in value


def hub_snapshot(repo_id: str, revision: str = "main", environ: Mapping[str, str] | None = None) -> Path:
    """The cached snapshot directory of model ``repo_id``: the commit ``refs/<revision>`` names, else the only
    snapshot there is. Raises ModelDirError naming the cache path when it is not there."""
    cache = hub_cache_dir(environ)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    fetch_hint = (f"nothing is downloaded: fetch it once where there is network (`hf download {repo_id}`, or "
                  f"`huggingface-cli download {repo_id}`) with HF_HUB_CACHE or HF_HOME pointing at this cache, "
                  "or give the model's directory")
    if not (repo / "snapshots").is_dir():
        raise ModelDirError(f"--tokenizer {repo_id}: not a local directory, and not in the Hugging Face cache "
                            f"{cache} (no {repo.name}/snapshots there); {fetch_hint}")
    ref = repo / "refs" / revision
    if ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
        snapshot = repo / "snapshots" / commit
        if not snapshot.is_dir():
            raise ModelDirError(f"--tokenizer {repo_id}: {ref} names snapshot {commit}, which is not in "
                                f"{repo / 'snapshots'} (an interrupted download?); {fetch_hint}")
        return snapshot
    snapshots = sorted(p for p in (repo / "snapshots").iterdir() if p.is_dir())
    if len(snapshots) == 1:
        return snapshots[0]
    if not snapshots:
        raise ModelDirError(f"--tokenizer {repo_id}: {repo / 'snapshots'} is empty; {fetch_hint}")
    raise ModelDirError(f"--tokenizer {repo_id}: {repo} has {len(snapshots)} snapshots and no refs/{revision}; "
                        f"give one snapshot directory ({', '.join(str(p) for p in snapshots[:3])})")


def resolve_tokenizer(value: str | Path, environ: Mapping[str, str] | None = None) -> Path:
    """The local directory ``--tokenizer`` means: a directory as given, else a hub id's cached snapshot.

    A directory always wins over a hub id of the same spelling (``org/name`` relative to the current
    directory), as transformers resolves it. Raises ModelDirError."""
    directory = Path(value).expanduser()
    if directory.is_dir():
        return directory
    text = str(value)
    if is_hub_id(text):
        return hub_snapshot(text, environ=environ)
    raise ModelDirError(f"tokenizer directory not found: {text}")


# ----------------------------------------------------------------------------------------- config.json

def _text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The language model's part of a model config, and its path for messages ("" for the config itself)."""
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
        name = architectures[0]
        if name.startswith("Llava") and name.endswith("ForCausalLM"):
            return config, ""  # SGLang reads these non-HF llava configs at the top level
    for key in TEXT_CONFIG_KEYS:
        sub = config.get(key)
        if isinstance(sub, Mapping):
            if key == "thinker_config" and isinstance(sub.get("text_config"), Mapping):
                return sub["text_config"], "thinker_config.text_config."
            return sub, f"{key}."
    return config, ""


def config_context(directory: Path) -> Context | None:
    """The context length ``directory/config.json`` states, read as SGLang derives it; None when there is no
    config.json or it states none. Raises ModelDirError for a config.json that is not a JSON object."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelDirError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{path}: expected a JSON object")
    text, prefix = _text_config(config)
    scaling = text.get("rope_scaling")
    factor: float = 1.0
    if isinstance(scaling, Mapping):
        raw = scaling.get("factor", 1)
        factor = float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool) else 1.0
        if "original_max_position_embeddings" in scaling or scaling.get("rope_type") == "llama3":
            factor = 1.0
    for key in CONTEXT_LENGTH_KEYS:
        value = text.get(key)
        if value is None:
            continue
        tokens = sane_context(value)
        if tokens is None:
            continue  # the 1e30 sentinel copied into a config: unknown, try the next key as well
        scaled = int(factor * tokens)
        how = f" x rope_scaling factor {factor:g}" if factor != 1.0 else ""
        return Context(scaled, f"config.json {prefix}{key}{how}")
    return None
