"""The mix's numbers (budget/ledger.py) and its option (producer/settings.py parse_mix): exact shares that sum to the
total, the rest of a dry member passed on by weight, and bad entries refused by name (docs/mix.md)."""
from __future__ import annotations

from fractions import Fraction

import pytest

from budget.ledger import Mix, mix_id, plan_shares, split_shares
from producer.settings import parse_mix

W = {"code": Fraction(1), "fc": Fraction(1), "traces": Fraction(2)}


def test_shares_follow_the_weights_and_sum_to_the_total_exactly() -> None:
    assert split_shares(40_000_000, W, {}) == {"code": 10_000_000, "fc": 10_000_000, "traces": 20_000_000}
    odd = split_shares(1_000_001, {"a": Fraction(1), "b": Fraction(1), "c": Fraction(1)}, {})
    assert sum(odd.values()) == 1_000_001 and odd == {"a": 333_333, "b": 333_333, "c": 333_335}
    thirds = split_shares(10, {"a": Fraction("0.1"), "b": Fraction("0.2")}, {})
    assert thirds == {"a": 3, "b": 7}  # exact: 10 x 1/3 rounds down to 3, never 3.0000000000000004


def test_a_dry_member_keeps_what_it_used_and_the_others_share_the_rest_by_weight() -> None:
    shares = split_shares(40_000_000, W, {"traces": 4_000_000})
    assert shares == {"code": 18_000_000, "fc": 18_000_000, "traces": 4_000_000}
    assert split_shares(100, W, {"code": 30, "fc": 30, "traces": 10}) == {"code": 30, "fc": 30, "traces": 10}
    assert split_shares(100, W, {"code": 120}) == {"code": 120, "fc": 0, "traces": 0}  # nothing left to share


def test_the_plan_runs_dry_whoever_cannot_fill_its_share_until_every_share_fits() -> None:
    # traces can make 5M of its 20M: 35M is left for code and fc; fc can make 12M of its 17.5M: code gets 23M.
    planned = plan_shares(40_000_000, W, {"code": None, "fc": 12_000_000, "traces": 5_000_000})
    assert planned.shares() == {"code": 23_000_000, "fc": 12_000_000, "traces": 5_000_000}
    assert planned.dry == {"fc": 12_000_000, "traces": 5_000_000}
    assert plan_shares(40_000_000, W, dict.fromkeys(W)) == Mix(40_000_000, W)


def test_a_mix_says_its_shares_and_is_named_by_its_members() -> None:
    mix = Mix(total=40_000_000, weights=W, dry={"traces": 4_000_000})
    assert mix.id == mix_id(["traces", "fc", "code"]) == "code,fc,traces"
    assert mix.describe() == ("mix of 3: total 40,000,000: code=1 (18,000,000), fc=1 (18,000,000), "
                              "traces=2 (4,000,000, ran dry)")


def test_parse_mix_reads_weights_exactly_from_one_or_more_values() -> None:
    assert parse_mix(("code=1,fc=1", "traces=2.5")) == {"code": 1, "fc": 1, "traces": Fraction(5, 2)}


@pytest.mark.parametrize("value, reason", [
    ("code=0", "a weight of 0 gives the dataset nothing"),
    ("code=-1", "positive number"),
    ("code=x", "positive number"),
    ("code=1e3", "positive number"),
    ("code", "expected NAME=WEIGHT"),
    ("=2", "expected NAME=WEIGHT"),
    ("co de=1", "not a valid dataset name"),
    ("code=1,code=2", 'dataset "code" already has a weight'),
])
def test_bad_mix_options_are_refused_naming_the_entry(value: str, reason: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_mix((value,))
    assert reason in str(exc.value) and "--mix entry" in str(exc.value)
