"""In which order a dataset's prompts are sent: the subset a budget keeps is the first prompts of that order.

Public datasets are often sorted (by source, topic, length, difficulty), so a budget that closes a dataset
after 30% of it in file order keeps the file's first 30%: a biased subset. ``--order random`` (the default)
sends each dataset's prompts in a seeded random order instead; ``--order file`` keeps the file's order.

The permutation sorts prompts by a keyed hash of (seed, id): BLAKE2b of the id, keyed with the seed. A prompt's
place depends only on its own id and the seed, never on the other ids or on the file's order, so:

- a rerun, a reattach, a budget raised later or a larger ``--max-samples`` extend the same selection: the
  first N of the order are always the same N prompts;
- adding or removing other prompts (a file that grew, a line now skipped) does not reorder the rest.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Final, Sequence, TypeVar

RANDOM: Final = "random"
FILE: Final = "file"
ORDERS: Final = (RANDOM, FILE)
DEFAULT_SEED: Final = 0


@dataclass(frozen=True)
class Order:
    mode: str = RANDOM
    seed: int = DEFAULT_SEED

    def setting(self) -> dict[str, Any]:
        """What run.json records (``order``)."""
        return {"mode": RANDOM, "seed": self.seed} if self.mode == RANDOM else {"mode": FILE}

    def describe(self) -> str:
        return f"random (seed {self.seed})" if self.mode == RANDOM else "file"


def rank(seed: int, sample_id: str) -> bytes:
    """The sort key of one prompt: BLAKE2b(id) keyed with the seed. 16 bytes: a collision is never seen in
    practice, and ties fall back to the id, so the order is a function of the ids and the seed alone."""
    key = str(seed).encode()
    return hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), key=key, digest_size=16).digest()


T = TypeVar("T")


def permute(items: Sequence[T], order: Order, id_of: Any = None) -> list[T]:
    """``items`` in ``order``: as given for file order, else sorted by ``rank`` of each one's id
    (``id_of(item)``, default ``item.id``)."""
    if order.mode != RANDOM:
        return list(items)
    get = id_of or (lambda item: item.id)
    return sorted(items, key=lambda item: (rank(order.seed, get(item)), get(item)))
