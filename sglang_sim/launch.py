"""Run the simulator as a child process (what tests, benchmarks and the demo need for real workers).

`SimProcess` starts the `sglang-sim` console script on a loopback port, waits until /health
answers, and stops it on exit:

    with SimProcess(["--time-scale", "50"]) as sim:
        requests.post(sim.url + "/generate", json={...})
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from types import TracebackType
from typing import IO, Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process could still take it first)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_command() -> list[str]:
    """The installed console script, else the module through this interpreter."""
    script = shutil.which("sglang-sim")
    return [script] if script else [sys.executable, "-m", "sglang_sim"]


class SimProcess:
    """An `sglang-sim` child process bound to `host:port` with extra CLI `args`."""

    def __init__(
        self,
        args: Sequence[str] = (),
        port: int | None = None,
        host: str = "127.0.0.1",
        command: Sequence[str] | None = None,
    ) -> None:
        self.args = list(args)
        self.host = host
        self.port = port or free_port(host)
        self.command = list(command) if command is not None else default_command()
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of the simulator."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Spawn the process and return once GET /health answers 200; RuntimeError otherwise. The timeout is a
        bound, not a wait: on a loaded machine (a parallel test run) importing aiohttp alone can take seconds."""
        self._stderr = tempfile.TemporaryFile()
        argv = [*self.command, "--host", self.host, "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self._stderr)
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self._read_stderr()
                self.stop()
                raise RuntimeError(f"sglang-sim did not come up on {self.url}: {err}")
            time.sleep(0.02)  # polling a port that is coming up: there is no event to await

    def _read_stderr(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-2000:]

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (in-flight requests end as aborted), then SIGKILL if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def __enter__(self) -> "SimProcess":
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
