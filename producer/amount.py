"""Parse token budgets given on the command line: ``10M``, ``500k``, ``1.5G``, ``10_000_000``.

A budget is an exact count of tokens, so parsing is exact too: ``decimal.Decimal`` with enough precision for the
input, never float (``1.1M`` is 1100000, not 1100000.0000000002). Accepted:

* digits, optionally grouped with single underscores between digits as in Python (``10_000_000``);
* an optional fraction (``1.5``), which must come out whole after the suffix (``1.0001k`` is rejected);
* an optional case-insensitive suffix k, M or G, powers of 1000 (``10m`` is ten million: nobody budgets in
  milli-tokens);
* surrounding whitespace.

``unlimited`` (or ``none``, any case) is a budget too in ``--budget``: explicitly none, which a rerun must be able
to say apart from no ``--budget`` at all (keep the stored one).

Rejected: signs, exponent notation (``1e6``: easy to mistype, and ``1e6M`` would be a puzzle; write ``1M``), NaN,
infinity, ``.5``, ``5.``, anything outside 0..MAX_AMOUNT. MAX_AMOUNT is the largest integer a float (Lua numbers,
JSON readers in other languages) holds exactly, so a budget survives every hop unrounded.
"""
from __future__ import annotations

import decimal
import re
from fractions import Fraction
from typing import Final, Literal, Union

from producer.inputs.reader import valid_name

MAX_AMOUNT = 2**53 - 1
SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_AMOUNT_RE = re.compile(r"([0-9]+(?:_[0-9]+)*(?:\.[0-9]+(?:_[0-9]+)*)?)([kKmMgG]?)")
_EXPONENT_RE = re.compile(r"[+-]?[0-9._]*[0-9][eE][+-]?[0-9]+[kKmMgG]?")
_EXAMPLES = "expected a whole number of tokens like 10M, 500k or 1500000"

#: ``--budget unlimited``: explicitly no budget, unlike no ``--budget`` (None: keep the stored budget).
UNLIMITED: Final = "unlimited"
#: A budget given on the command line: a number of tokens, or UNLIMITED.
Budget = Union[int, Literal["unlimited"]]
_UNLIMITED_WORDS = ("unlimited", "none")


def budget_limit(budget: Budget | None) -> int | None:
    """The limit the ledger is given (None: unlimited) of a ``--budget`` (None: not given, so none is known)."""
    return None if budget is None or budget == UNLIMITED else int(budget)


class _Bad(ValueError):
    """The reason alone; the public functions prefix the offending value."""


def parse_amount(text: str) -> int:
    """Parse one budget amount into a whole number of tokens; ValueError names the input and what is wrong."""
    try:
        return _parse(text)
    except _Bad as e:
        raise ValueError(f"invalid budget {_quote(text)}: {e}") from None


def parse_budget_option(values: tuple[str, ...]) -> tuple[Budget | None, dict[str, Budget]]:
    """Split repeated ``--budget`` values into (default for every dataset, per dataset name).

    ``AMOUNT`` sets the default (at most once); ``NAME=AMOUNT`` one dataset (at most once per name); an AMOUNT of
    ``unlimited`` is UNLIMITED. Whether every NAME is a dataset actually given is for the caller to check, which
    knows the datasets.
    """
    default: Budget | None = None
    per_name: dict[str, Budget] = {}
    for value in values:
        name, sep, amount_text = value.partition("=")
        name = name.strip()
        if sep and not valid_name(name):
            raise ValueError(f"invalid budget {_quote(value)}: {_quote(name)} is not a valid dataset name "
                             f'(letters, digits, "_" and "-" only, 1 to 64 characters)')
        text = amount_text if sep else value
        try:
            amount: Budget = UNLIMITED if text.strip().lower() in _UNLIMITED_WORDS else _parse(text)
        except _Bad as e:
            raise ValueError(f"invalid budget {_quote(value)}: {e}") from None
        if not sep:
            if default is not None:
                raise ValueError(f"invalid budget {_quote(value)}: a default budget (without NAME=) was already "
                                 f"given; use NAME=AMOUNT for one dataset")
            default = amount
        elif name in per_name:
            raise ValueError(f"invalid budget {_quote(value)}: dataset {_quote(name)} already has a budget")
        else:
            per_name[name] = amount
    return default, per_name


def _parse(text: str) -> int:
    stripped = text.strip()
    if not stripped:
        raise _Bad(f"empty; {_EXAMPLES}")
    match = _AMOUNT_RE.fullmatch(stripped)
    if match is None:
        if stripped.startswith("-") and _AMOUNT_RE.fullmatch(stripped[1:]):
            raise _Bad("must not be negative")
        if _EXPONENT_RE.fullmatch(stripped):
            raise _Bad("exponent notation is not supported; write 1M or 1000000 instead of 1e6")
        raise _Bad(_EXAMPLES)
    number, suffix = match.group(1).replace("_", ""), match.group(2).lower()
    # Precision enough for every digit of the input times the largest multiplier: the product is exact.
    context = decimal.Context(prec=len(number) + 12, traps=[decimal.Inexact, decimal.InvalidOperation])
    value = context.multiply(decimal.Decimal(number), decimal.Decimal(SUFFIXES[suffix]))
    if value != value.to_integral_value(context=context):
        detail = f" ({match.group(0)} = {value.normalize(context)})" if suffix else ""
        raise _Bad(f"not a whole number of tokens{detail}")
    if value > MAX_AMOUNT:
        raise _Bad(f"too large (at most {MAX_AMOUNT} tokens)")
    return int(value)


def _quote(text: str, limit: int = 60) -> str:
    """Quote user input for a message: bounded, and printable even if it holds control characters."""
    shown = text if len(text) <= limit else text[:limit] + "..."
    return '"' + shown.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'


_WEIGHT_RE = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def parse_mix(values: tuple[str, ...]) -> dict[str, Fraction]:
    """``--mix NAME=WEIGHT[,NAME=WEIGHT...]`` (repeatable) -> each dataset's weight, exact (docs/mix.md).

    A weight is a positive decimal number (``1``, ``2.5``); 0 is refused (leave the dataset out of the run), and so
    are a name given twice and an entry that is not NAME=WEIGHT. ValueError names the entry."""
    weights: dict[str, Fraction] = {}
    for value in values:
        for entry in value.split(","):
            name, sep, weight = (x.strip() for x in entry.partition("="))
            if not sep or not name:
                raise ValueError(f"invalid --mix entry {_quote(entry)}: expected NAME=WEIGHT, e.g. code=1,traces=2")
            if not valid_name(name):
                raise ValueError(f"invalid --mix entry {_quote(entry)}: {_quote(name)} is not a valid dataset name "
                                 f'(letters, digits, "_" and "-" only, 1 to 64 characters)')
            if not _WEIGHT_RE.fullmatch(weight):
                raise ValueError(f"invalid --mix entry {_quote(entry)}: the weight must be a positive number like "
                                 "1 or 2.5")
            w = Fraction(weight)
            if w == 0:
                raise ValueError(f"invalid --mix entry {_quote(entry)}: a weight of 0 gives the dataset nothing; "
                                 "leave it out of the run instead")
            if name in weights:
                raise ValueError(f"invalid --mix entry {_quote(entry)}: dataset {_quote(name)} already has a weight")
            weights[name] = w
    return weights
