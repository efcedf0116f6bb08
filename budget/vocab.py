"""Token ids the served model cannot take are refused before any request carries them.

SGLang does not validate ``input_ids`` against the model: an id past its embedding (``vocab_size`` padded to a
multiple of 64 rows) raises ``IndexError: index out of range in self``, and the scheduler's death takes the whole
server down (SIGQUIT, kill_process_tree; the port refuses connections afterwards; recorded from sglang 0.5.23 on
CPU: tests/fixtures/sglang_real/out_of_vocab.json). Ids in the padding are served, meaninglessly. So one tokenizer
that does not match the served model would take every server of a run down, one after the other, as the chunks
are retried. Every id at or above ``vocab_size`` is refused:

- ``produce`` (producer/preflight.py) checks every rendered prompt id against the model's vocabulary before Redis is
  touched (the tokenizer directory's config.json ``vocab_size``, `config_vocab`), and again at attach against
  what the servers say of themselves (``vocab_size`` in the /server_info the workers recorded, `servers_vocab`;
  SGLang 0.5.23 reports none, the simulator does with --vocab-size): exit 2 naming the dataset, the sample, the
  id and the sizes;
- workers check each later turn's prompt they render (worker/turns.py) against the ``vocab_size`` the producer put
  in the chunk's conversation block: the sample fails with that reason and nothing is sent.

Negative ids are refused the same way (the embedding cannot take them either).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence


@dataclass(frozen=True)
class Vocab:
    """The model's vocabulary size and who said it (for messages)."""

    size: int
    source: str


def _sane(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def info_vocab(info: Mapping[str, Any]) -> int | None:
    """``vocab_size`` of a config.json or a server's self-description (top level, or a multimodal model's
    ``text_config``)."""
    size = _sane(info.get("vocab_size"))
    if size is None and isinstance(info.get("text_config"), Mapping):
        size = _sane(info["text_config"].get("vocab_size"))
    return size


def config_vocab(tokenizer_dir: str | Path) -> Vocab | None:
    """The model's ``vocab_size`` from ``config.json`` in the tokenizer directory; None when there is none (a hub
    id, a tokenizer-only folder) or it states none."""
    path = Path(tokenizer_dir) / "config.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    size = info_vocab(info) if isinstance(info, Mapping) else None
    return Vocab(size, f"{path}: vocab_size") if size is not None else None


def servers_vocab(servers: Sequence[Mapping[str, Any]]) -> Vocab | None:
    """The smallest ``vocab_size`` any recorded server states (a chunk may run on any of them)."""
    best: Vocab | None = None
    for entry in servers:
        size = info_vocab(entry)
        if size is not None and (best is None or size < best.size):
            where = str(entry.get("url", "?")) + (f" on {entry['host']}" if entry.get("host") else "")
            best = Vocab(size, f"SGLang server {where}: vocab_size")
    return best


def smallest(*vocabs: Vocab | None) -> Vocab | None:
    known = [v for v in vocabs if v is not None]
    return min(known, key=lambda v: v.size) if known else None


def first_outside(ids: Sequence[int], size: int) -> tuple[int, int] | None:
    """(position, id) of the first id the model cannot take (< 0 or >= ``size``), or None. ``min``/``max`` run in
    C over an ``array``: a run's hundreds of millions of prompt ids take seconds, not minutes."""
    if not ids or (min(ids) >= 0 and max(ids) < size):
        return None
    for pos, token in enumerate(ids):
        if token < 0 or token >= size:
            return pos, token
    return None  # pragma: no cover (min/max said otherwise)


def refusal(dataset: str, sample: str, pos: int, token: int, vocab: Vocab) -> str:
    return (f"dataset {dataset}: sample {sample}: prompt token {pos} is id {token}, outside the model's vocabulary "
            f"of {vocab.size:,} ids (0..{vocab.size - 1:,}; {vocab.source}): SGLang's embedding would fail on it "
            "and take the whole server down. The tokenizer does not match the served model: give the model's own "
            "--tokenizer")


def check_prompts(datasets: Iterable[tuple[str, Iterable[Mapping[str, Sequence[int]]]]],
                  vocab: Vocab | None) -> str | None:
    """The refusal for the first prompt holding an id outside ``vocab`` (datasets: name -> its {sample: ids}
    maps, e.g. a Prepared's ``input_ids`` and each template variant's), or None when all fit or none is known."""
    if vocab is None:
        return None
    for name, maps in datasets:
        for ids_by_sample in maps:
            for sample, ids in ids_by_sample.items():
                bad = first_outside(ids, vocab.size)
                if bad is not None:
                    return refusal(name, sample, bad[0], bad[1], vocab)
    return None


def turn_refusal(ids: Sequence[int], conversation: Mapping[str, Any], turn: int) -> str | None:
    """A worker's check of a later turn's prompt it rendered (worker/turns.py): the failed reason, or None."""
    size = _sane(conversation.get("vocab_size"))
    bad = first_outside(ids, size) if size is not None else None
    if bad is None or size is None:
        return None
    return (f"turn {turn}: prompt token {bad[0]} is id {bad[1]}, outside the model's vocabulary of {size:,} ids "
            "(the tokenizer does not match the served model); not sent: SGLang would fail on it and shut down")
