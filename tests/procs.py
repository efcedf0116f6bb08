"""Real processes for end-to-end tests: rq workers, produce, and the simulator's counters. The processes are
started by the dev stack (demo/stack.py), which the demo and the benchmarks use too."""
from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import redis

from budget import keys
from demo.appending import complete_lines, read_jsonl
from demo.stack import produce_cmd, spawn, terminate, wait_until, worker_argv, worker_env

__all__ = ["Workers", "complete_lines", "generate", "produce", "produce_cmd", "read_jsonl", "run_keys", "sim_stats",
           "wait_for"]
#: Poll state owned by another process (a file, a Redis key): there is no event to await across processes.
wait_for = wait_until


#: What running workers write on their own: their servers' info, health and load, and every RQ key but the queue's and
#: the jobs' (registrations, registry and group cleaning, which change under a test whenever a worker heartbeats).
WORKER_OWNED = (keys.SERVER_INFO, keys.SERVER_HEALTH, keys.SERVER_LOAD, keys.WINDOW)
PRODUCE_RQ = ("rq:queue:", "rq:queues", "rq:job:", "rq:canceled:")


def run_keys(r: "redis.Redis") -> set[bytes]:
    """Every key but those live workers write by themselves: what a refused ``produce`` must leave as it was,
    counted without racing a worker's heartbeat or health report."""
    out = set()
    for k in r.scan_iter():
        name = k.decode()
        if name in WORKER_OWNED or (name.startswith("rq:") and not name.startswith(PRODUCE_RQ)):
            continue
        out.add(k)
    return out


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
        full_env = worker_env(self.redis_url, self.sim_url, {**self.extra_env, **(env or {})})
        proc = spawn(name, [*worker_argv(name), *extra], self.logdir, full_env).proc
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
        terminate(self.procs)


def generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One ``POST /generate`` to a simulator, its 200 answer's body."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return dict(json.loads(resp.read()))


def sim_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/sim/stats", timeout=5) as resp:
        return dict(json.loads(resp.read()))
