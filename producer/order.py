"""In which order a dataset's prompts are sent: the subset a budget keeps is the first prompts of that order.

Public datasets are often sorted (by source, topic, length, difficulty), so a budget that closes a dataset
after 30% of it in file order keeps the file's first 30%: a biased subset. ``--order random`` (the default)
sends each dataset's prompts in a seeded random order instead; ``--order file`` keeps the file's order.

The permutation sorts prompts by a keyed hash of (seed, id): BLAKE2b of the id, keyed with the seed. A prompt's
place depends only on its own id and the seed, never on the other ids or on the file's order, so:

- a rerun, a reattach, a budget raised later or a larger ``--max-samples`` extend the same selection: the
  first N of the order are always the same N prompts;
- adding or removing other prompts (a file that grew, a line now skipped) does not reorder the rest.

A run stored before this setting existed has no ``order`` in its run.json: it resumes in file order (its
selection so far is the file's first prompts; switching would mix two selections in one dataset).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Sequence, TypeVar

RANDOM: Final = "random"
FILE: Final = "file"
ORDERS: Final = (RANDOM, FILE)
DEFAULT_SEED: Final = 0
#: The run.json key (producer/runjson.py run_settings); missing in a stored run means file order.
SETTING: Final = "order"


@dataclass(frozen=True)
class Order:
    mode: str = RANDOM
    seed: int = DEFAULT_SEED
    #: True when a stored run predates ``--order``: file order kept, whatever the options say.
    legacy: bool = False

    def setting(self) -> dict[str, Any] | None:
        """What run.json records; None for a legacy run (the key stays absent, as it was stored)."""
        if self.legacy:
            return None
        return {"mode": RANDOM, "seed": self.seed} if self.mode == RANDOM else {"mode": FILE}

    def describe(self) -> str:
        if self.legacy:
            return "file (the stored run predates --order)"
        return f"random (seed {self.seed})" if self.mode == RANDOM else "file"


def from_setting(value: Any) -> Order:
    """The order a stored run.json's ``order`` value names; None (absent) is a legacy run in file order."""
    if not isinstance(value, dict):
        return Order(FILE, DEFAULT_SEED, legacy=True)
    if value.get("mode") == RANDOM:
        return Order(RANDOM, int(value.get("seed", DEFAULT_SEED)))
    return Order(FILE)


def rank(seed: int, sample_id: str) -> bytes:
    """The sort key of one prompt: BLAKE2b(id) keyed with the seed. 16 bytes: a collision is never seen in
    practice, and ties fall back to the id, so the order is a function of the ids and the seed alone."""
    key = str(seed).encode()
    return hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), key=key, digest_size=16).digest()


T = TypeVar("T")


def permute(items: Sequence[T], order: Order, id_of: Any = None) -> list[T]:
    """``items`` in ``order``: as given for file order, else sorted by ``rank`` of each one's id
    (``id_of(item)``, default ``item.id``)."""
    if order.mode != RANDOM or order.legacy:
        return list(items)
    get = id_of or (lambda item: item.id)
    return sorted(items, key=lambda item: (rank(order.seed, get(item)), get(item)))


def stored_order(run_file: Path) -> dict[str, Any] | None | bool:
    """What a stored run.json says about the order: its ``order`` value, None when the run predates the
    setting, False when there is no (readable) stored run."""
    try:
        settings = json.loads(run_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(settings, dict):
        return False
    value = settings.get(SETTING)
    return value if isinstance(value, dict) else None


def choose(requested: Order, run_file: Path, new_run: bool) -> Order:
    """The order a dataset is prepared in: ``requested``, except that a stored run without the key (one that
    predates ``--order``) keeps file order when resumed. ``--new-run`` starts over, so it takes the request."""
    if new_run:
        return requested
    stored = stored_order(run_file)
    if stored is None:
        return Order(FILE, requested.seed, legacy=True)
    return requested
