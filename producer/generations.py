"""Several generations of each prompt (docs/generations.md): the sample key, and what differs per generation.

A *prompt* is a source record; a *sample* is one generation of it, with its own key in every Redis structure,
its own rids and exactly one record on disk. Generation 0's key is the prompt's id (a ``--generations 1`` run is
generation 0 of itself). Generation k >= 1
is ``id + "\\x1f" + str(k)``: ids hold no control characters (producer/inputs/records.py refuses them at read), so the
key parses back at its last ``\\x1f`` whatever the id is.

What a generation sends differently from its chunk travels in the sample payload as a ``sampling_params``
override (budget/payload.py SamplePayload), which the worker merges over the chunk's for every turn. Generation
0 never carries one.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Final, Sequence

from budget import keys

SEP: Final = keys.SEP  # budget/keys.py: the sample key is one of the encodings in its table
#: The run.json key of ``--generations``, left out when it is 1.
SETTING: Final = "generations"
#: The sampling parameter that carries ``--seed`` (producer/settings.py).
SEED: Final = "sampling_seed"
TEMPERATURE: Final = "temperature"


def sample_key(prompt_id: str, generation: int) -> str:
    """The key of generation ``generation`` of ``prompt_id``: the id itself for generation 0."""
    return prompt_id if generation == 0 else f"{prompt_id}{SEP}{generation}"


def split_key(key: str) -> tuple[str, int]:
    """(prompt id, generation) of a sample key; a key without ``\\x1f`` is generation 0 of itself."""
    head, sep, tail = key.rpartition(SEP)
    if sep and tail.isdigit():
        return head, int(tail)
    return key, 0


def record_key(rec: dict[str, Any]) -> str:
    """The sample key of a record on disk: its ``id`` (the prompt's) and ``generation`` (missing: 0)."""
    return sample_key(str(rec["id"]), int(rec.get("generation") or 0))


def derived_seed(seed: int, prompt_id: str, generation: int) -> int:
    """The sampling seed of generation k >= 1: BLAKE2b of (id, k) keyed with ``--seed``, in [0, 2**31). Generation
    0 keeps ``--seed`` itself: N generations are N draws, not N copies, and a rerun
    draws the same ones."""
    if generation == 0:
        return seed
    digest = hashlib.blake2b(f"{prompt_id}{SEP}{generation}".encode("utf-8", "surrogatepass"),
                             key=str(seed).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % (2 ** 31)


def parse_temperatures(text: str) -> list[float]:
    """``--temperature``: one value, or a comma-separated list (``0,0.6,1.0``); each >= 0. Raises ValueError."""
    values = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a number") from None
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"{part!r}: a temperature is a finite number >= 0")
        values.append(value)
    return values


def chunk_params(params: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters a chunk sends, from the run's (run.json ``sampling_params``): a temperature list is
    its first entry (generation 0's); everything else as it is."""
    temperature = params.get(TEMPERATURE)
    if isinstance(temperature, list):
        return {**params, TEMPERATURE: temperature[0]}
    return params


@dataclass(frozen=True)
class Generations:
    """How many generations each prompt gets, and what generation k sends differently from the chunk."""

    n: int = 1
    temperatures: tuple[float, ...] = ()  # --temperature as a list; () or one value: the chunk's for all
    seed: int | None = None  # --seed: generation k >= 1 gets derived_seed(seed, id, k)

    @classmethod
    def from_params(cls, n: int, params: dict[str, Any]) -> "Generations":
        """From the run's sampling parameters (run.json ``sampling_params``: a temperature list, the seed)."""
        temperature = params.get(TEMPERATURE)
        temps = tuple(float(t) for t in temperature) if isinstance(temperature, list) else ()
        seed = params.get(SEED)
        return cls(n, temps, int(seed) if seed is not None else None)

    def describe(self) -> str:
        """What differs between generations, for --dry-run (empty when nothing does)."""
        parts = []
        if self.temperatures:
            parts.append("temperature " + ", ".join(f"{t:g}" for t in self.temperatures) + " (generation k: entry k "
                         f"mod {len(self.temperatures)})")
        if self.seed is not None and self.n > 1:
            parts.append(f"sampling seed {self.seed} for generation 0, derived from ({self.seed}, id, k) for k >= 1")
        return "; ".join(parts)

    def temperature(self, generation: int) -> float | None:
        """Generation k's temperature: entry k mod len of the list; None: the chunk's."""
        return self.temperatures[generation % len(self.temperatures)] if self.temperatures else None

    def overrides(self, prompt_id: str, generation: int) -> dict[str, Any] | None:
        """The ``sampling_params`` override of the sample (prompt_id, generation), None when it sends the chunk's
        (generation 0 always: the chunk's temperature is the list's first entry and the seed is --seed)."""
        out: dict[str, Any] = {}
        if generation == 0:
            return None
        temp = self.temperature(generation)
        if temp is not None and temp != self.temperatures[0]:
            out[TEMPERATURE] = temp
        if self.seed is not None:
            out[SEED] = derived_seed(self.seed, prompt_id, generation)
        return out or None


def rounds(prompt_ids: Sequence[str], n: int) -> list[str]:
    """Every sample key in the order they are sent: generation 0 of every prompt (in the prompts' order), then
    generation 1 of every prompt, ... (docs/generations.md: a budget that closes part way keeps the most distinct
    prompts, and each round's first M prompts are the order's first M)."""
    return [sample_key(pid, k) for k in range(n) for pid in prompt_ids]
