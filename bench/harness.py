"""Real processes for benchmarks: a private redis-server, sglang-sim, rq workers and produce, all on loopback.

Benchmarks measure the real system (the same commands users type), so this module only starts and stops
processes and reads the simulator's counters; it never reaches into budgetq's internals.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(ok: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ok():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


class Stack:
    """redis-server + sglang-sim + N workers. Use as a context manager; everything stops on exit."""

    def __init__(self, workdir: Path, sim_args: Sequence[str] = (), workers: int = 2,
                 worker_env: dict[str, str] | None = None, sim_count: int = 1,
                 sim_args_each: Sequence[Sequence[str]] | None = None) -> None:
        self.workdir = workdir
        self.sim_args = list(sim_args)
        self.n_workers = workers
        self.worker_env = worker_env or {}
        self.sim_args_each = [list(a) for a in sim_args_each] if sim_args_each else [self.sim_args] * sim_count
        self.procs: list[subprocess.Popen[bytes]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.sim_urls: list[str] = []
        self.sims: list[subprocess.Popen[bytes]] = []
        self.redis_url = ""

    def _spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "ab")
        proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        log.close()
        self.procs.append(proc)
        return proc

    def start(self) -> "Stack":
        self.workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        (self.workdir / "redis").mkdir(exist_ok=True)
        self._spawn("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                              str(self.workdir / "redis"), "--save", "", "--appendonly", "yes",
                              "--appendfsync", "everysec", "--maxmemory-policy", "noeviction"])
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        client = redis.Redis.from_url(self.redis_url)
        _wait(client.ping, "redis-server")
        for i, args in enumerate(self.sim_args_each):
            sport = free_port()
            proc = self._spawn(f"sim{i}", [sys.executable, "-m", "sglang_sim", "--port", str(sport), *args])
            self.sims.append(proc)
            url = f"http://127.0.0.1:{sport}"
            _wait(lambda: urllib.request.urlopen(url + "/health", timeout=1).status == 200, "sglang-sim")
            self.sim_urls.append(url)
        for i in range(self.n_workers):
            self.start_worker(f"w{i}")
        return self

    def start_worker(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        full = {"REDIS_URL": self.redis_url, "SGLANG_URL": ",".join(self.sim_urls), **self.worker_env,
                **(env or {})}
        proc = self._spawn(name, [sys.executable, "-m", "rq.cli", "worker", "-w", "worker.Worker", "-c",
                                  "worker.settings", "-n", f"{name}-{os.getpid()}"], env=full)
        self.workers.append(proc)
        return proc

    def sim_stats(self, i: int = 0) -> dict[str, Any]:
        with urllib.request.urlopen(self.sim_urls[i] + "/sim/stats", timeout=5) as resp:
            return dict(json.loads(resp.read()))

    def client(self) -> "redis.Redis":
        return redis.Redis.from_url(self.redis_url)

    def stop(self) -> None:
        for p in self.workers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            if p.poll() is None and p not in self.workers:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def __enter__(self) -> "Stack":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def produce_cmd() -> list[str]:
    return [sys.executable, "-m", "producer.cli"]


def write_prompts(path: Path, n: int, prefix: str = "Write item", system: str | None = None) -> Path:
    """A synthetic dataset of n short prompts (optionally sharing a long system prompt)."""
    with open(path, "w") as fh:
        for i in range(n):
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": f"{prefix} {i}: explain step {i % 97} of the plan."}]
            fh.write(json.dumps({"id": i, "messages": messages}) + "\n")
    return path


@contextmanager
def scratch(name: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"budgetq-bench-{name}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (from /proc), for the CPU share beside each figure."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
