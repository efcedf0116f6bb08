"""A weighted mix of chat-template kwargs, one value drawn per generation (docs/generations.md).

``--template-kwargs-mix 'reasoning_effort=low:4,medium:4,high:2'`` gives each sample (prompt p, generation k)
one value of ``reasoning_effort``, drawn with those weights, as SpecForge draws gpt-oss's effort per request.
Several keys are separated by ``;`` and drawn independently. The draw is a keyed hash of (key, id, k) with the
run's order seed (``--order-seed``), never a random generator: a rerun, a reattach or a larger ``--generations``
draws exactly what it drew before, whatever else changed in the file.

The drawn values are merged over ``--chat-template-kwargs`` for every turn of that sample's conversation; the
producer renders turn 0 with them, and a worker renders later turns with them (budget/payload.py SamplePayload).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Final, Mapping, Sequence

from producer.generations import SEP
from render.chat import Renderer

#: The run.json key, left out without a mix (every sample rendered with --chat-template-kwargs).
SETTING: Final = "template_kwargs_mix"


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
        self._renderers: dict[str, Renderer] = {}

    def name(self, prompt_id: str, generation: int) -> str:
        """The variant sample (prompt_id, generation) is rendered with."""
        return variant(self.mix.draw(prompt_id, generation))

    def of(self, prompt_id: str) -> list[str]:
        """The distinct variants a prompt's generations 0..N-1 drew, generation 0's first."""
        return list(dict.fromkeys(self.name(prompt_id, k) for k in range(self.generations)))

    def kwargs(self, name: str) -> dict[str, Any]:
        """The chat_template_kwargs of a variant: the run's, with its drawn values merged over them."""
        return {**self.base, **json.loads(name)}

    def renderer(self, name: str) -> Renderer:
        if name not in self._renderers:
            self._renderers[name] = Renderer(self.tokenizer, chat_template_kwargs=self.kwargs(name),
                                             opens_markers=self.opens_markers)
        return self._renderers[name]

    def fingerprint(self, name: str) -> str:
        """What a worker checks the renderer it builds for this variant's later turns against."""
        return self.renderer(name).fingerprint()
