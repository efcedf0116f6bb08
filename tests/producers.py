"""An in-process ``Producer`` on the demo's code dataset (150 samples, ``max_new_tokens`` 64), for the tests
that drive its loop step by step against the session's Redis instead of running ``produce`` as a process; and
``run_settings``, the options of ``produce run`` as the command parses them."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from producer.prepare import Inputs, load_inputs
from producer.session.attach import RunOptions
from producer.settings import RunSettings
from tests.demo_data import CODE


def run_settings(*args: str, terminal: bool = False) -> RunSettings:
    """``produce run ARGS`` parsed and checked as the command does it (click's defaults filled in); ``terminal``:
    stderr is one (the progress bars show)."""
    from producer.cli import run_cmd
    params = run_cmd.make_context("run", list(args)).params
    return RunSettings.from_options(params, sglang_url="http://127.0.0.1:1", api_key=None, terminal=terminal)


def code_inputs(tokenizer_dir: Path, out_dir: Path, *, budget: int | None = None, chunk_size: int = 8,
                show_progress: bool = False) -> tuple[Inputs, RunOptions]:
    """The code dataset read, validated and rendered, and the options of a run writing to ``out_dir``."""
    settings = run_settings(str(CODE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "64", "--order", "file",
                            terminal=show_progress)
    inputs = load_inputs(settings, echo=_quiet, warn=_quiet)
    options = RunOptions(out_dir=out_dir, budgets={"code_instruct": budget}, chunk_size=chunk_size,
                         show_progress=show_progress)
    return inputs, options


def _quiet(_msg: Any) -> None:
    pass
