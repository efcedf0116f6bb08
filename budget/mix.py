"""A mix: one token budget shared by several datasets by weight (docs/mix.md).

A member's share is its budget: the per-dataset scripts (admit, commit, the close and the discard) enforce it in
every worker, unchanged. This module only decides the numbers, from the total, the weights and the tokens of the
members that ran dry, and stores the mix in ``bq:mix:{id}`` (budget/keys.py).

Why shares are not one Lua script over every member: such a script would span the members' hash slots, and it
needs no atomicity. A share depends on the total, the weights and the dry members' tokens only, and a dry member's
tokens no longer change (nothing of it is live). Applying the shares is one ``set_budget`` per member, atomic
against that member's commits and admissions; whoever applies them computes the same numbers from the same hash.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from budget import keys
from budget.ledger import Ledger

if TYPE_CHECKING:
    import redis

SEPARATOR = ","  # never in a dataset name (keys.DATASET_NAME_RE)


def mix_id(names: Iterable[str]) -> str:
    """The id of the mix of these members: their names, sorted, joined by ",". The same datasets are the same mix
    on every host."""
    return SEPARATOR.join(sorted(names))


def split_shares(total: int, weights: Mapping[str, Fraction], dry: Mapping[str, int]) -> dict[str, int]:
    """Each member's budget: a dry member keeps what it used; the rest of ``total`` goes to the others in
    proportion to their weights, each rounded down, the last by name taking the remainder so the shares sum to
    the rest exactly. Exact arithmetic (Fraction): a share never depends on float rounding."""
    fixed = {n: dry[n] for n in weights if n in dry}
    active = sorted(n for n in weights if n not in dry)
    out = dict(fixed)
    rest = max(0, total - sum(fixed.values()))
    if active:
        wsum = sum(weights[n] for n in active)
        for n in active[:-1]:
            out[n] = int(rest * weights[n] / wsum)  # int() of a positive Fraction rounds down
        out[active[-1]] = rest - sum(out[n] for n in active[:-1])
    return out


def plan_shares(total: int, weights: Mapping[str, Fraction], capacity: Mapping[str, int | None]) -> Mix:
    """The mix a run is expected to end with, for ``--dry-run``: a member whose projected tokens (``capacity``;
    None: unknown, never dry) cannot fill its share runs dry at its capacity and passes the rest on, until every
    share fits. The same rule as a run's (``split_shares`` with the dry members), applied ahead of time."""
    dry: dict[str, int] = {}
    while True:
        shares = split_shares(total, weights, dry)
        short = {n: c for n, c in capacity.items()
                 if n not in dry and n in shares and c is not None and c < shares[n]}
        if not short:
            return Mix(total, weights, dry)
        dry.update(short)


@dataclass(frozen=True)
class Mix:
    """A mix as stored: the total, each member's weight, the tokens of the members that ran dry."""

    total: int
    weights: Mapping[str, Fraction]
    dry: Mapping[str, int] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return mix_id(self.weights)

    def shares(self) -> dict[str, int]:
        return split_shares(self.total, self.weights, self.dry)

    def given(self) -> str:
        """The total and weights as one string: what a ``produce`` command gave (``MixStore.given``)."""
        return json.dumps({"total": self.total, "weights": {n: str(w) for n, w in sorted(self.weights.items())}})

    def describe(self) -> str:
        """One line: the total, and each member's weight and share, for status and the summary."""
        shares = self.shares()
        parts = [f"{n}={_weight(self.weights[n])} ({shares[n]:,}{', ran dry' if n in self.dry else ''})"
                 for n in sorted(self.weights)]
        return f"mix of {len(parts)}: total {self.total:,}: " + ", ".join(parts)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _weight(w: Fraction) -> str:
    return str(w.numerator) if w.denominator == 1 else f"{float(w):g}"


class MixStore:
    """The mixes in Redis: ``bq:mix:{id}`` and each member's ``mix`` field (budget/keys.py)."""

    def __init__(self, client: "redis.Redis") -> None:
        self.r = client

    def load(self, mix_id: str) -> Mix | None:
        raw = {_s(k): _s(v) for k, v in self.r.hgetall(keys.mix(mix_id)).items()}
        if "total" not in raw:
            return None
        weights = {k[len("weight:"):]: Fraction(v) for k, v in raw.items() if k.startswith("weight:")}
        dry = {k[len("dry:"):]: int(v) for k, v in raw.items() if k.startswith("dry:")}
        return Mix(total=int(raw["total"]), weights=weights, dry=dry)

    def save(self, mix: Mix, given: str | None = None) -> None:
        """Store the total and the weights (a mix's members never change: they are its id); the dry marks stay."""
        fields: dict[Any, Any] = {"total": str(mix.total), **{f"weight:{n}": str(w) for n, w in mix.weights.items()}}
        if given is not None:
            fields["given"] = given
        pipe = self.r.pipeline()
        pipe.hset(keys.mix(mix.id), mapping=fields)
        for name in mix.weights:
            pipe.hset(keys.DatasetKeys(name).meta, "mix", mix.id)
        pipe.execute()

    def given(self, mix_id: str) -> str | None:
        """The mix the last ``produce`` that gave ``--mix`` gave (``Mix.given``); None: none yet."""
        raw = self.r.hget(keys.mix(mix_id), "given")
        return _s(raw) if raw is not None else None

    def mix_of(self, name: str) -> str | None:
        raw = self.r.hget(keys.DatasetKeys(name).meta, "mix")
        return _s(raw) if raw else None

    def mark_dry(self, mix_id: str, name: str, used: int) -> None:
        self.r.hset(keys.mix(mix_id), f"dry:{name}", used)

    def clear_dry(self, mix_id: str, names: Iterable[str]) -> None:
        fields = [f"dry:{n}" for n in names]
        if fields:
            self.r.hdel(keys.mix(mix_id), *fields)

    def forget(self, mix_id: str) -> None:
        self.r.delete(keys.mix(mix_id))

    def apply(self, ledger: Ledger, mix: Mix) -> dict[str, str]:
        """Set every member's budget to its share (``set_budget``: raising reopens, lowering to what is used
        closes); returns each member's status. A member whose budget is already its share is left as it is."""
        out = {}
        for name, share in mix.shares().items():
            current, status = self.r.hmget(keys.DatasetKeys(name).meta, ["budget", "status"])
            if current is not None and _s(current) == str(share):
                out[name] = _s(status) if status else "open"
                continue
            out[name] = ledger.set_budget(name, share)
        return out
