"""The length picture (producer/ops/status.py ``picture``): fixed lengths in, exact lines out; and the run
summary that ends with it (``length_pictures``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from budget.record import RECORD_VERSION
from producer.ops.status import (
    DatasetSummary,
    Lengths,
    bar,
    length_pictures,
    nearest_rank,
    picture,
    read_lengths,
)
from producer.results import RESULTS


def record(*turns: tuple[int, str], cap: int = 512) -> dict[str, Any]:
    return {"record_version": RECORD_VERSION, "id": f"r{len(turns)}-{turns[0][0]}", "messages": [],
            "turns": [{"completion_tokens": n, "finish_reason": why} for n, why in turns],
            "completion_tokens": sum(n for n, _ in turns), "sampling_params": {"max_new_tokens": cap}}


def test_bar_is_drawn_to_the_eighth_and_never_hides_a_count() -> None:
    assert bar(2, 2, 8) == "████████"
    assert bar(1, 3, 8) == "██▋"  # 21.3 eighths: 2 full blocks and 5/8
    assert bar(1, 1000, 8) == "▏"  # rounds to 0 eighths, shown as one
    assert bar(0, 5, 8) == ""


def test_nearest_rank_gives_a_length_that_occurs() -> None:
    ordered = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert [nearest_rank(ordered, q) for q in (0.5, 0.9, 0.99)] == [5, 9, 10]
    assert nearest_rank([], 0.5) is None


def test_a_record_counts_each_turn_and_the_turns_the_cap_cut() -> None:
    lengths = Lengths()
    lengths.add(record((10, "stop"), (20, "length"), cap=20))
    lengths.add(record((7, "stop")))
    assert (lengths.finished, lengths.cut, lengths.max_new_tokens) == ([10, 7], [20], 512)


def test_the_picture_of_fixed_lengths() -> None:
    lengths = Lengths(finished=[31, 40, 50, 100, 100, 200, 300], cut=[512, 512], max_new_tokens=512)
    assert picture("ds", lengths, width=8) == [
        "ds: 9 responses, completion tokens median 100, p90 512, p99 512, max 512; 2 (22.2%) cut at "
        "max_new_tokens 512",
        "       31  ████      1  11.1%",
        "    32-63  ████████  2  22.2%",
        "   64-127  ████████  2  22.2%",
        "  128-255  ████      1  11.1%",
        "  256-300  ████      1  11.1%",
        "      cut  ████████  2  22.2%",
    ]


def test_the_picture_without_a_cut_keeps_empty_bins_between() -> None:
    lengths = Lengths(finished=[1, 1, 1000], max_new_tokens=4096)
    assert picture("code", lengths, width=4) == [
        "code: 3 responses, completion tokens median 1, p90 1,000, p99 1,000, max 1,000; none cut at "
        "max_new_tokens 4,096",
        "          1  ████  2  66.7%",
        "        2-3        0   0.0%",
        "        4-7        0   0.0%",
        "       8-15        0   0.0%",
        "      16-31        0   0.0%",
        "      32-63        0   0.0%",
        "     64-127        0   0.0%",
        "    128-255        0   0.0%",
        "    256-511        0   0.0%",
        "  512-1,000  ██    1  33.3%",
    ]


def test_a_dataset_with_no_response_says_so() -> None:
    assert picture("ds", Lengths()) == ["ds: no responses yet"]


def test_the_run_summary_ends_with_each_datasets_picture_read_from_its_file(tmp_path: Path) -> None:
    path = tmp_path / "ds" / RESULTS
    path.parent.mkdir()
    path.write_text(json.dumps(record((100, "stop"))) + "\n" + json.dumps(record((512, "length"))) + "\n"
                    + '{"id": "torn', encoding="utf-8")  # a torn last line is not read
    rows = [DatasetSummary(name=n, status="complete", done=0, selected=0, tokens=0, budget=None, failed={},
                           not_run=0, invalid=0, duplicates=0, over_context=0, output=tmp_path / n / RESULTS)
            for n in ("ds", "none_yet")]
    assert length_pictures(rows).splitlines() == [*picture("ds", read_lengths(path)), "none_yet: no responses yet"]
    assert read_lengths(path) == Lengths(finished=[100], cut=[512], max_new_tokens=512)
