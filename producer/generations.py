"""Several generations of each prompt (docs/generations.md): the sample key, and what differs per generation
(its sampling parameters, the chat-template kwargs drawn for it).

A *prompt* is a source record; a *sample* is one generation of it, with its own key in every Redis structure,
its own rids and exactly one record on disk. Generation 0's key is the prompt's id (a ``--generations 1`` run is
generation 0 of itself). Generation k >= 1
is ``id + "\\x1f" + str(k)``: ids hold no control characters (producer/inputs/records.py refuses them at read), so the
key parses back at its last ``\\x1f`` whatever the id is.

What a generation sends differently from its chunk travels in the sample payload as a ``sampling_params``
override (budget/record.py SamplePayload), which the worker merges over the chunk's for every turn. Generation
0 never carries one.

A weighted mix of chat-template kwargs (`TemplateMix`), one value drawn per generation:
``--template-kwargs-mix 'reasoning_effort=low:4,medium:4,high:2'`` gives each sample (prompt p, generation k)
one value of ``reasoning_effort``, drawn with those weights, as SpecForge draws gpt-oss's effort per request.
Several keys are separated by ``;`` and drawn independently. The draw is a keyed hash of (key, id, k) with the
run's order seed (``--order-seed``), never a random generator: a rerun, a reattach or a larger ``--generations``
draws exactly what it drew before, whatever else changed in the file.

The drawn values are merged over ``--chat-template-kwargs`` for every turn of that sample's conversation; the
producer renders turn 0 with them, and a worker renders later turns with them (budget/record.py SamplePayload).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Mapping, Sequence

from budget import keys

if TYPE_CHECKING:  # imported where a renderer is made: the sample key's readers (results, report) need no Jinja
    from render.chat import Renderer

SEP: Final = keys.SEP  # budget/keys.py: the sample key is one of the encodings in its table
#: The run.json key of ``--generations``, left out when it is 1.
SETTING: Final = "generations"
#: The run.json key of ``--template-kwargs-mix``, left out without a mix (every sample rendered with
#: --chat-template-kwargs).
MIX_SETTING: Final = "template_kwargs_mix"
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

class MixError(ValueError):
    """``--template-kwargs-mix`` cannot be read; the message says which part and why."""


def _value(text: str) -> Any:
    """A value as written: JSON when it reads as JSON (``true``, ``0.5``, ``"x"``), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class TemplateMix:
    """Keys in sorted order, each with its (value, weight) choices in the order given."""

    choices: tuple[tuple[str, tuple[tuple[Any, float], ...]], ...]
    seed: int = 0

    @classmethod
    def parse(cls, text: str, seed: int) -> "TemplateMix":
        """``KEY=VALUE:WEIGHT,VALUE:WEIGHT[;KEY=...]``; a value without ``:WEIGHT`` weighs 1. Raises MixError."""
        out: dict[str, tuple[tuple[Any, float], ...]] = {}
        for part in (p.strip() for p in text.split(";")):
            if not part:
                continue
            key, eq, rest = part.partition("=")
            key = key.strip()
            if not eq or not key or not rest.strip():
                raise MixError(f"{part!r}: expected KEY=VALUE:WEIGHT,VALUE:WEIGHT")
            if key in out:
                raise MixError(f"{key!r} is given twice")
            values: list[tuple[Any, float]] = []
            for item in (i.strip() for i in rest.split(",")):
                head, colon, tail = item.rpartition(":")
                raw, weight_text = (head, tail) if colon else (item, "1")
                try:
                    weight = float(weight_text)
                except ValueError:
                    raise MixError(f"{key}: {item!r}: the weight {weight_text!r} is not a number") from None
                if not weight > 0 or weight == float("inf"):
                    raise MixError(f"{key}: {item!r}: a weight is a finite number > 0")
                if not raw.strip():
                    raise MixError(f"{key}: {item!r}: empty value")
                value = _value(raw.strip())
                if any(v == value and type(v) is type(value) for v, _w in values):
                    raise MixError(f"{key}: the value {raw.strip()!r} is given twice")
                values.append((value, weight))
            out[key] = tuple(values)
        if not out:
            raise MixError("no KEY=VALUE:WEIGHT given")
        return cls(tuple(sorted(out.items())), seed)

    @classmethod
    def from_setting(cls, value: Any) -> "TemplateMix | None":
        """The mix a stored run.json names (``setting()``'s form); None when it names none."""
        if not isinstance(value, dict) or not isinstance(value.get("kwargs"), dict):
            return None
        choices = tuple(sorted((str(k), tuple((v, float(w)) for v, w in pairs))
                               for k, pairs in value["kwargs"].items()))
        return cls(choices, int(value.get("seed", 0)))

    def setting(self) -> dict[str, Any]:
        """What run.json records: the seed of the draw and every key's (value, weight) pairs."""
        return {"seed": self.seed, "kwargs": {key: [[v, w] for v, w in pairs] for key, pairs in self.choices}}

    @property
    def keys(self) -> list[str]:
        return [key for key, _pairs in self.choices]

    def draw(self, prompt_id: str, generation: int) -> dict[str, Any]:
        """The values of sample (prompt_id, generation): for each key, the choice whose share of the total weight
        holds u = BLAKE2b(key, id, k keyed with the seed) / 2**64."""
        out: dict[str, Any] = {}
        for key, pairs in self.choices:
            digest = hashlib.blake2b(f"{key}{SEP}{prompt_id}{SEP}{generation}".encode("utf-8", "surrogatepass"),
                                     key=f"template-kwargs-mix:{self.seed}".encode(), digest_size=8).digest()
            point = int.from_bytes(digest, "big") / 2 ** 64 * sum(w for _v, w in pairs)
            chosen = pairs[-1][0]
            for value, weight in pairs:
                if point < weight:
                    chosen = value
                    break
                point -= weight
            out[key] = chosen
        return out

    def describe(self) -> str:
        """For --dry-run and logs: ``reasoning_effort low 40%, medium 40%, high 20%``."""
        parts = []
        for key, pairs in self.choices:
            total = sum(w for _v, w in pairs)
            shown = ", ".join(f"{json.dumps(v) if not isinstance(v, str) else v} {100 * w / total:.0f}%"
                              for v, w in pairs)
            parts.append(f"{key} {shown}")
        return "template kwargs drawn per sample (seed " + str(self.seed) + "): " + "; ".join(parts)


def variant(drawn: Mapping[str, Any]) -> str:
    """The name of one combination of drawn values: its JSON with sorted keys (a dict key, and the manifest's)."""
    return json.dumps(dict(drawn), sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def labels(kwargs: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    """``key=value`` of each mixed key a record's ``chat_template_kwargs`` holds (the manifest's counts)."""
    return [f"{key}={kwargs[key] if isinstance(kwargs[key], str) else json.dumps(kwargs[key])}"
            for key in keys if key in kwargs]


class Variants:
    """The renderers of a ``--template-kwargs-mix``: one per combination of drawn values (a *variant*), each the
    run's chat_template_kwargs with the drawn values merged over them, built when first needed."""

    def __init__(self, tokenizer: Any, base: dict[str, Any], mix: TemplateMix, generations: int,
                 opens_markers: Any = None) -> None:
        self.tokenizer, self.base, self.mix, self.generations = tokenizer, dict(base), mix, generations
        self.opens_markers = opens_markers
        self._renderers: dict[str, "Renderer"] = {}

    def name(self, prompt_id: str, generation: int) -> str:
        """The variant sample (prompt_id, generation) is rendered with."""
        return variant(self.mix.draw(prompt_id, generation))

    def of(self, prompt_id: str) -> list[str]:
        """The distinct variants a prompt's generations 0..N-1 drew, generation 0's first."""
        return list(dict.fromkeys(self.name(prompt_id, k) for k in range(self.generations)))

    def kwargs(self, name: str) -> dict[str, Any]:
        """The chat_template_kwargs of a variant: the run's, with its drawn values merged over them."""
        return {**self.base, **json.loads(name)}

    def renderer(self, name: str) -> "Renderer":
        from render.chat import Renderer
        if name not in self._renderers:
            self._renderers[name] = Renderer(self.tokenizer, chat_template_kwargs=self.kwargs(name),
                                             opens_markers=self.opens_markers)
        return self._renderers[name]

    def fingerprint(self, name: str) -> str:
        """What a worker checks the renderer it builds for this variant's later turns against."""
        return self.renderer(name).fingerprint()
