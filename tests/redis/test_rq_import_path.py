"""A worker.py (or budget.py, producer.py, render.py) in the directory ``rq worker`` starts in, against budgetq's
fixed top-level package names. rq appends its ``--path`` (default ``.``) to the end of ``sys.path`` after the
interpreter has started, so budgetq installed as a path entry (``pip install .``, or an editable install with
``--config-settings editable_mode=compat``) is found first. setuptools' default editable install maps the packages
with a finder that Python asks after every ``sys.path`` entry, so there the current directory wins, and so it does
for ``python -m rq.cli``, which puts the current directory first (docs/operations.md, "Starting workers")."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
SHADOW = "a user's own module was imported in place of budgetq's"


def _rq(argv: list[str], cwd: Path, redis_url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_URL", "BUDGETQ_CONCURRENCY")}
    env["PYTHONPATH"] = str(ROOT)  # the checkout as a sys.path entry: what a regular install gives
    return subprocess.run([*argv, "worker", "--burst", "-w", "worker.Worker", "-c", "worker.settings", "--url",
                           redis_url], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_a_worker_py_in_the_current_directory_does_not_shadow_installed_budgetq(
        tmp_path: Path, redis_url: str, r: "redis.Redis") -> None:
    for name in ("worker", "budget", "producer", "render"):
        (tmp_path / f"{name}.py").write_text(f"raise SystemExit({SHADOW!r})\n")
    rq_script = Path(sys.executable).parent / "rq"  # the console script, as README's "Use it" starts a worker
    started = _rq([str(rq_script)], tmp_path, redis_url)
    assert started.returncode == 0 and SHADOW not in started.stdout + started.stderr, started.stderr[-2000:]
    # python -m puts the current directory first: the module there wins, which is what the docs warn about.
    shadowed = _rq([sys.executable, "-m", "rq.cli"], tmp_path, redis_url)
    assert shadowed.returncode != 0 and SHADOW in shadowed.stderr, shadowed.stderr[-2000:]
