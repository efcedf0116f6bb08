"""A `produce dashboard` process as the compose file's ``dashboard`` service runs it (basic auth from the
``RQ_DASHBOARD_*`` variables), bound on a free loopback port, and the Authorization headers that pass or fail."""
from __future__ import annotations

import base64
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from demo.stack import free_port, spawn, wait_until

ROOT = Path(__file__).resolve().parents[1]
AUTH = {"RQ_DASHBOARD_USERNAME": "dash-test-user", "RQ_DASHBOARD_PASSWORD": "dash-test-password"}
GOOD = {"Authorization": "Basic " + base64.b64encode(
    f"{AUTH['RQ_DASHBOARD_USERNAME']}:{AUTH['RQ_DASHBOARD_PASSWORD']}".encode()).decode()}
BAD = {"Authorization": "Basic " + base64.b64encode(f"{AUTH['RQ_DASHBOARD_USERNAME']}:wrong".encode()).decode()}


def compose_dashboard_argv(redis_url: str, port: int) -> list[str]:
    """The compose service's command, pointed at this session's Redis and bound on loopback."""
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    args = [str(a) for a in compose["services"]["dashboard"]["command"]]
    assert args[:2] == ["produce", "dashboard"]
    for flag, value in (("--redis-url", redis_url), ("--host", "127.0.0.1"), ("--port", str(port))):
        args[args.index(flag) + 1] = value
    assert not any("$" in a for a in args), args
    return args


class Dashboard:
    """A `produce dashboard` process on a free loopback port; `request` talks to it over HTTP."""

    def __init__(self, redis_url: str, logdir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "producer.cli", *compose_dashboard_argv(redis_url, self.port)[1:]]
        env = {**os.environ, **AUTH, "PYTHONPATH": str(ROOT)}
        service = spawn("rq-dashboard", argv, logdir, env, cwd=ROOT)
        self.proc = service.proc
        # Up, and refusing the unauthenticated.
        wait_until(lambda: self.request("GET", "/")[0] == 401, 20, "rq-dashboard", watch=[service])

    def request(self, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.base + path, method=method, headers=headers or {},
                                     data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()
        except OSError:
            return 0, b""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
