"""The simulator's ``--turn-length-scale``: a conversation's turn k answers with lengths of its own (the drawn
length times entry k), as real multi-turn data does, so the per-turn length model of predict has something to
learn (docs/simulator.md). The turn is read from the prompt: the assistant turns it holds before the one asked."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from sglang_sim.config import SimConfig
from sglang_sim.textgen import earlier_assistant_turns
from tests.procs import generate


def test_earlier_assistant_turns_counts_the_headers_before_the_generation_prompt() -> None:
    one = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    three = ("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
             "<|im_start|>assistant\nd<|im_end|>\n<|im_start|>user\ne<|im_end|>\n<|im_start|>assistant\n")
    assert earlier_assistant_turns(one) == 0 and earlier_assistant_turns(three) == 2
    assert earlier_assistant_turns("<|user|>a<|assistant|>b<|user|>c<|assistant|>") == 1  # GLM
    assert earlier_assistant_turns("no header at all") == 0


def test_the_option_needs_a_tokenizer_and_positive_entries() -> None:
    with pytest.raises(ValueError, match="needs --tokenizer"):
        SimConfig(turn_length_scale=(1.0, 2.0))
    with pytest.raises(ValueError, match="> 0"):
        SimConfig(turn_length_scale=(1.0, 0.0), tokenizer="x")


def test_later_turns_answer_with_their_own_lengths(tokenizer_dir: Path, sim_factory: Any) -> None:
    """Fixed drawn lengths, scale 1 for turn 0 and 4 from turn 1 on: a second turn's answers are about 4x the
    first's, whatever the prompt's other content."""
    from render.chat import Renderer, load_tokenizer
    renderer = Renderer(load_tokenizer(str(tokenizer_dir)))
    sim = sim_factory("--tokenizer", str(tokenizer_dir), "--turn-length-scale", "1,4", "--length-dist", "fixed",
                      "--mean-tokens", "60", "--reasoning-fraction", "0", "--tokens-per-second-per-request",
                      "100000")
    first = renderer.render([{"role": "user", "content": "Hello there."}]).input_ids
    second = renderer.render([{"role": "user", "content": "Hello there."},
                              {"role": "assistant", "content": "Hi."},
                              {"role": "user", "content": "Tell me more."}]).input_ids
    lengths: dict[str, list[int]] = {"first": [], "second": []}
    for i in range(6):
        for name, ids in (("first", first), ("second", second)):
            out = generate(sim.url, {"input_ids": ids, "rid": f"{name}{i:02d}".ljust(32, "0"),
                                  "sampling_params": {"max_new_tokens": 1000}})
            lengths[name].append(out["meta_info"]["completion_tokens"])
    ratio = statistics.mean(lengths["second"]) / statistics.mean(lengths["first"])
    assert 3.0 < ratio < 5.0, lengths


@pytest.mark.parametrize("bad", ["1,x", ""])
def test_a_bad_list_is_refused(bad: str) -> None:
    from sglang_sim.config import from_argv
    with pytest.raises(SystemExit):
        from_argv(["--tokenizer", "x", "--turn-length-scale", bad])
