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


def produce(args: list[str], redis_url: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`produce ARGS --redis-url REDIS_URL` as a user runs it, to its end; its output captured as text."""
    return subprocess.run([*produce_cmd(), *args, "--redis-url", redis_url], capture_output=True, text=True,
                          timeout=timeout)


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

    def log(self, name: str, partial: bool = False) -> str:
        """The worker's log so far: its complete lines only (it may be writing one right now, and a pattern
        matched against half a line can match what the whole line will not say). ``partial``: everything,
        for a check that nothing in the log says something (a secret)."""
        path = self.logdir / f"{name}.log"
        if partial:
            return path.read_text(errors="replace") if path.exists() else ""
        return "".join(line + "\n" for line in complete_lines(path))

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


def complete_lines(path: Path) -> list[str]:
    """The lines of ``path`` that end in a newline, decoded: what a reader of a file another process is still
    appending to may use. The last line of such a file can be half written (no trailing newline yet, perhaps cut
    inside a UTF-8 sequence), so everything after the last newline is left for the next read. A writer that has
    finished ends its file with a newline, so nothing of a finished file is lost."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    end = data.rfind(b"\n")
    return data[:end + 1].decode("utf-8", errors="replace").splitlines() if end >= 0 else []


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file, which ``produce`` may still be appending to: an unterminated last line is
    not read yet (see `complete_lines`); a torn line in a finished file shows up as a missing record."""
    return [json.loads(line) for line in complete_lines(path) if line.strip()]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll state owned by another process (a file, a Redis key): there is no event to await across processes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
