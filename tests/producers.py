"""An in-process ``Producer`` on the demo's code dataset (150 samples, ``max_new_tokens`` 64), for the tests
that drive its loop step by step against the session's Redis instead of running ``produce`` as a process."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from producer.datasetrun import RunOptions
from producer.prepare import Inputs, load_inputs
from tests.demo_data import CODE

PARAMS = {"max_new_tokens": 64}


def code_inputs(tokenizer_dir: Path, out_dir: Path, *, budget: int | None = None, chunk_size: int = 8,
                show_progress: bool = False) -> tuple[Inputs, RunOptions]:
    """The code dataset read, validated and rendered, and the options of a run writing to ``out_dir``."""
    inputs = load_inputs([str(CODE)], tokenizer=str(tokenizer_dir), max_tokens=64, max_context=None,
                         max_samples=None, sampling_params=PARAMS, chat_template_kwargs={}, skip_invalid=False,
                         echo=_quiet, warn=_quiet, show_progress=show_progress)
    options = RunOptions(out_dir=out_dir, budgets={"code_instruct": budget}, sampling_params=PARAMS,
                         settings=inputs.settings, think=None, reasoning_parser=inputs.reasoning_parser,
                         chunk_size=chunk_size, show_progress=show_progress)
    return inputs, options


def _quiet(_msg: Any) -> None:
    pass
