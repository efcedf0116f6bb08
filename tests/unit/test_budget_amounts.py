"""Tests for producer.settings: budget amounts and repeated --budget options."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.settings import MAX_AMOUNT, UNLIMITED, parse_amount, parse_budget_option


@pytest.mark.parametrize("text, expected", [
    ("0", 0),
    ("1500000", 1_500_000),
    ("10M", 10_000_000),
    ("10m", 10_000_000),
    ("500k", 500_000),
    ("2.5K", 2_500),
    ("1.5k", 1_500),
    ("1.5G", 1_500_000_000),
    ("1.1M", 1_100_000),  # exact: float would give 1100000.0000000002
    ("0.001k", 1),
    ("1.000000001G", 1_000_000_001),
    ("1.50k", 1_500),
    ("007", 7),
    ("10_000_000", 10_000_000),
    ("1_000.5k", 1_000_500),
    (" 10M\n", 10_000_000),
    (str(MAX_AMOUNT), MAX_AMOUNT),
    ("9007199.254740991G", MAX_AMOUNT),
])
def test_parse_amount(text: str, expected: int) -> None:
    result = parse_amount(text)
    assert result == expected and type(result) is int


@pytest.mark.parametrize("text, reason", [
    ("abc", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("", "empty; expected a whole number of tokens like 10M, 500k or 1500000"),
    ("   ", "empty; expected a whole number of tokens like 10M, 500k or 1500000"),
    ("-5", "must not be negative"),
    ("-1.5k", "must not be negative"),
    ("0.5", "not a whole number of tokens"),
    ("1.0001k", "not a whole number of tokens (1.0001k = 1000.1)"),
    ("1.0000000001G", "not a whole number of tokens (1.0000000001G = 1000000000.1)"),
    ("2^63", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("9223372036854775808", f"too large (at most {MAX_AMOUNT} tokens)"),
    (str(MAX_AMOUNT + 1), f"too large (at most {MAX_AMOUNT} tokens)"),
    ("9007199254741k", f"too large (at most {MAX_AMOUNT} tokens)"),
    ("1e6", "exponent notation is not supported; write 1M or 1000000 instead of 1e6"),
    ("1.5E3k", "exponent notation is not supported; write 1M or 1000000 instead of 1e6"),
    ("NaN", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("inf", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("Infinity", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("+5", "expected a whole number of tokens like 10M, 500k or 1500000"),
    (".5k", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("5.", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("10 M", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("10MM", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("10T", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("1__0", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("_10", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("10_", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("0x10", "expected a whole number of tokens like 10M, 500k or 1500000"),
    ("١٢", "expected a whole number of tokens like 10M, 500k or 1500000"),  # non-ASCII digits
])
def test_parse_amount_rejects(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_amount(text)
    assert str(info.value).startswith(f'invalid budget "{text}": ' if text.isascii() else "invalid budget ")
    assert str(info.value).endswith(reason)


def test_huge_inputs_are_rejected_quickly() -> None:
    with pytest.raises(ValueError, match="too large"):
        parse_amount("9" * 100_000)
    with pytest.raises(ValueError, match="not a whole number"):
        parse_amount("1." + "0" * 100_000 + "1G")
    with pytest.raises(ValueError) as info:
        parse_amount("x" * 1000)
    assert len(str(info.value)) < 200


def test_messages_quote_control_characters() -> None:
    with pytest.raises(ValueError) as info:
        parse_amount("1\x1b[31m")
    assert "\x1b" not in str(info.value) and "\\x1b" in str(info.value)


def test_parse_budget_option() -> None:
    assert parse_budget_option(()) == (None, {})
    assert parse_budget_option(("10M",)) == (10_000_000, {})
    assert parse_budget_option(("math=500k", "10M", "code-v2=1.5M")) == (
        10_000_000, {"math": 500_000, "code-v2": 1_500_000})
    assert parse_budget_option(("math=0",)) == (None, {"math": 0})


@pytest.mark.parametrize("values, message", [
    (("10M", "20M"), 'invalid budget "20M": a default budget (without NAME=) was already given'),
    (("a=1k", "a=2k"), 'invalid budget "a=2k": dataset "a" already has a budget'),
    (("a=1k", "a=1k"), 'invalid budget "a=1k": dataset "a" already has a budget'),
    (("my.data=1k",), 'invalid budget "my.data=1k": "my.data" is not a valid dataset name'),
    (("=1k",), 'invalid budget "=1k": "" is not a valid dataset name'),
    (("a=",), 'invalid budget "a=": empty; expected a whole number of tokens'),
    (("a=10x",), 'invalid budget "a=10x": expected a whole number of tokens like 10M, 500k or 1500000'),
    (("a=1.0001k",), 'invalid budget "a=1.0001k": not a whole number of tokens'),
    (("a=b=1k",), 'invalid budget "a=b=1k": expected a whole number of tokens'),
    (("lots",), 'invalid budget "lots": expected a whole number of tokens'),
])
def test_parse_budget_option_rejects(values: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_budget_option(values)
    assert str(info.value).startswith(message)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30) | st.from_regex(r"\A[0-9_.]{0,20}[kKmMgGeE]?[0-9]{0,3}\Z"))
def test_fuzz_parse_amount(text: str) -> None:
    try:
        result = parse_amount(text)
    except ValueError as e:
        assert str(e).startswith("invalid budget ")
        str(e).encode("utf-8")  # printable, even from lone surrogates
        return
    assert type(result) is int and 0 <= result <= MAX_AMOUNT


@settings(max_examples=200, deadline=None)
@given(st.integers(0, MAX_AMOUNT), st.sampled_from(["", "k", "M", "G"]))
def test_fuzz_round_trip(n: int, suffix: str) -> None:
    scale = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9}[suffix]
    whole, frac = divmod(n, scale)
    text = f"{whole}.{str(frac).rjust(len(str(scale)) - 1, '0')}{suffix}" if frac else f"{whole}{suffix}"
    assert parse_amount(text) == n
    assert parse_amount(f"{n:_}") == n


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=12) | st.sampled_from(["unlimited", "None", "a=unlimited", "b=none", "10k", "c=5M"]),
                max_size=4).map(tuple))
def test_fuzz_parse_budget_option(values: tuple[str, ...]) -> None:
    """Every budget parsed is UNLIMITED or an amount in range (random text alone almost never spells one)."""
    try:
        default, per_name = parse_budget_option(values)
    except ValueError:
        return
    budgets = [*per_name.values()] if default is None else [default, *per_name.values()]
    assert all(v == UNLIMITED if isinstance(v, str) else 0 <= v <= MAX_AMOUNT for v in budgets)


def test_budget_option_takes_unlimited_as_explicitly_none() -> None:
    from producer.settings import budget_limit
    assert parse_budget_option(("unlimited", "b=None", "c=10k")) == (UNLIMITED, {"b": UNLIMITED, "c": 10_000})
    assert [budget_limit(x) for x in (None, UNLIMITED, 5)] == [None, None, 5]
    with pytest.raises(ValueError, match="already given"):
        parse_budget_option(("unlimited", "1k"))
