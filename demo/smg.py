"""SGLang's real router (SGLang Model Gateway, ``pip install sglang-router``, 0.3.2: ``smg launch``) on loopback.

Part of the dev stack (demo/stack.py); tests/e2e/test_router.py and bench/servers.py put it in front of simulators.
What it needs here, learnt by running it:

- it binds 0.0.0.0 unless told otherwise, and so does its Prometheus exporter (default port 29000, so a second
  router on the host fails): both get 127.0.0.1 and a free port of their own;
- at each worker's registration it loads a tokenizer for the worker's ``model_path``; for the simulator's
  ``sglang-sim`` that is a Hugging Face hub id, which it tries to download. It is started in a folder that
  holds a ``sglang-sim/`` tokenizer directory, so it loads that local path and never reaches for the network;
- readiness: ``GET /readiness`` answers ``{"status":"ready","healthy_workers":N,...}`` once its workers are
  registered and healthy; that is polled (another process: there is no event to await).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from demo.stack import NotReady, free_port, spawn, wait_until

POLICIES = ("cache_aware", "round_robin", "power_of_two")
#: What budgetq wants of the router (docs/deployment.md): a request timeout above the worker's own deadline for a
#: 16K-token answer at 5 tok/s (120 + 16384 / 5 = 3397 s), no retries of its own (budgetq retries, with a fresh
#: rid and its breaker; the router's 5 retries multiply budgetq's), dead servers noticed within seconds.
BUDGETQ_SETTINGS = ("--request-timeout-secs", "3600", "--disable-retries", "--health-check-interval-secs", "5")


def smg_command() -> list[str]:
    """The ``smg`` console script of this interpreter's environment (``python -m sglang_router.launch_router``
    takes the same options without ``launch``)."""
    here = Path(sys.executable).parent / "smg"
    found = str(here) if here.exists() else shutil.which("smg")
    if not found:
        raise RuntimeError("smg not found: pip install sglang-router==0.3.2 (the test extra has it)")
    return [found, "launch"]


class Router:
    """One ``smg launch`` process in front of ``worker_urls``; ``url`` once started."""

    def __init__(self, worker_urls: Sequence[str], workdir: Path, *, policy: str = "cache_aware",
                 extra: Sequence[str] = BUDGETQ_SETTINGS) -> None:
        self.worker_urls = list(worker_urls)
        self.workdir = Path(workdir)
        self.policy = policy
        self.extra = list(extra)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / f"smg-{policy}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _tokenizer(self) -> None:
        target = self.workdir / "sglang-sim"  # the simulator's model_path, as a local directory
        if not (target / "tokenizer.json").exists():
            from demo.tokenizer import build_tokenizer
            target.mkdir(parents=True, exist_ok=True)
            build_tokenizer(target, thinking="open")

    def start(self, timeout: float = 60.0) -> "Router":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._tokenizer()
        self.port = free_port()
        cmd = [*smg_command(), "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *self.worker_urls, "--policy", self.policy,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--log-level", "warn", *self.extra]
        service = spawn(self.log_path.stem, cmd, self.workdir, cwd=self.workdir)
        self.proc = service.proc
        try:
            wait_until(lambda: self.healthy_workers() == len(self.worker_urls), timeout, "smg's workers healthy",
                       watch=[service], interval=0.1)
        except NotReady:
            self.stop()
            raise
        return self

    def healthy_workers(self) -> int | None:
        """``healthy_workers`` of GET /readiness; None while it does not answer."""
        try:
            with urllib.request.urlopen(self.url + "/readiness", timeout=2) as resp:
                return int(json.loads(resp.read()).get("healthy_workers", 0))
        except urllib.error.HTTPError as exc:  # 503 while no worker is healthy: the body still counts them
            try:
                return int(json.loads(exc.read()).get("healthy_workers", 0))
            except (ValueError, AttributeError):
                return 0
        except (OSError, ValueError):
            return None

    def log_tail(self, n: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> "Router":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
