"""Real processes for end-to-end tests: rq workers, produce, and the simulator's counters."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

WORKER_CMD = ["rq", "worker", "-w", "worker.Worker", "-c", "worker.settings"]


def produce_cmd() -> list[str]:
    return [sys.executable, "-m", "producer.cli"]


class Workers:
    """`rq worker -w worker.Worker -c worker.settings` subprocesses, exactly as users start them."""

    def __init__(self, redis_url: str, sim_url: str, logdir: Path, env: dict[str, str] | None = None) -> None:
        self.redis_url = redis_url
        self.sim_url = sim_url
        self.logdir = logdir
        self.extra_env = env or {}
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        full_env = {**os.environ, "REDIS_URL": self.redis_url, "SGLANG_URL": self.sim_url,
                    **self.extra_env, **(env or {})}
        log = open(self.logdir / f"{name}.log", "ab")
        proc = subprocess.Popen([*WORKER_CMD, "-n", name, *extra], env=full_env, stdout=log,
                                stderr=subprocess.STDOUT)
        log.close()
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.logdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def sim_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/sim/stats", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll state owned by another process (a file, a Redis key): there is no event to await across processes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
