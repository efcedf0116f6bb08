"""The simulator's ``--length-scale-by-text TEXT=F``: datasets whose answers differ in length (real ones do, ~5x:
the reason budgetq budgets per dataset), told apart by what their prompts say. budgetq's rid is a hash of the
dataset and sample, so the prompt is what a server can see of a dataset (docs/simulator.md)."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from sglang_sim.config import SimConfig, from_argv
from sglang_sim.textgen import text_length_scale
from tests.procs import generate


def test_the_first_text_the_prompt_contains_gives_the_factor() -> None:
    cfg = SimConfig(length_scale_by_text=(("[long]", 8.0), ("[mid]", 4.0)), tokenizer="x")
    assert text_length_scale(cfg, "user: [mid] write item 3") == 4.0
    assert text_length_scale(cfg, "[mid] and [long]") == 8.0  # the first pair given wins, not the first in the text
    assert text_length_scale(cfg, "nothing marked") == 1.0


def test_the_option_needs_a_tokenizer_a_text_and_a_positive_factor() -> None:
    with pytest.raises(ValueError, match="needs --tokenizer"):
        SimConfig(length_scale_by_text=(("a", 2.0),))
    with pytest.raises(ValueError, match="factor > 0"):
        SimConfig(length_scale_by_text=(("a", 0.0),), tokenizer="x")
    with pytest.raises(ValueError, match="non-empty TEXT"):
        SimConfig(length_scale_by_text=(("", 2.0),), tokenizer="x")


@pytest.mark.parametrize("bad", ["a", "=2", "a=x"])
def test_a_bad_entry_is_refused(bad: str) -> None:
    with pytest.raises(SystemExit):
        from_argv(["--tokenizer", "x", "--length-scale-by-text", bad])


def test_repeated_entries_keep_their_order() -> None:
    cfg = from_argv(["--tokenizer", "x", "--length-scale-by-text", "B=4", "--length-scale-by-text", "a=b=8"])
    assert cfg.length_scale_by_text == (("B", 4.0), ("a=b", 8.0))


def test_prompts_with_a_text_answer_with_its_factor(tokenizer_dir: Path, sim_factory: Any) -> None:
    """Fixed drawn lengths, scale 8 for prompts saying "Write C": their answers are about 8x those of prompts that
    say neither text, and 4x for "Write B"."""
    from render.chat import Renderer, load_tokenizer
    renderer = Renderer(load_tokenizer(str(tokenizer_dir)))
    sim = sim_factory("--tokenizer", str(tokenizer_dir), "--length-scale-by-text", "Write C=8",
                      "--length-scale-by-text", "Write B=4", "--length-dist", "fixed", "--mean-tokens", "40",
                      "--reasoning-fraction", "0", "--tokens-per-second-per-request", "100000")
    lengths: dict[str, list[int]] = {"A": [], "B": [], "C": []}
    for i in range(6):
        for name in lengths:
            ids = renderer.render([{"role": "user", "content": f"Write {name} item {i}."}]).input_ids
            out = generate(sim.url, {"input_ids": ids, "rid": f"{name}{i:02d}".ljust(32, "0"),
                                  "sampling_params": {"max_new_tokens": 2000}})
            lengths[name].append(out["meta_info"]["completion_tokens"])
    base = statistics.mean(lengths["A"])
    assert 3.0 < statistics.mean(lengths["B"]) / base < 5.0, lengths
    assert 6.5 < statistics.mean(lengths["C"]) / base < 9.5, lengths
