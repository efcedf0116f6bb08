"""The compose file's `sim` profile, run the way docs/deployment.md tells a new user to, without Docker.

There is no Docker engine on the machines this project is tested on, so this module plays compose's part with host
processes, driven only by what docker-compose.yml and docs/deployment.md say:

- the docs' `.env` block (a fenced block of KEY=VALUE lines holding RQ_DASHBOARD_PASSWORD) and the variables
  prefixed to the documented `docker compose --profile sim up` command are the environment; the whole compose
  file is interpolated with it (tests/compose_file.py's `interpolate`), so a `${VAR:?}` the docs do not set fails;
- every service the `up` command starts (no profile, or a profile it names) is started in `depends_on` order as
  its compose `command`/`entrypoint` with its `environment` (over the Dockerfile's ENV for our image), in a
  working directory of its own with its volumes linked in (named volumes are temp dirs, bind mounts resolve
  against a temp project folder), `deploy.replicas` (or `--scale`) times. `service_healthy` dependencies are
  awaited by running the service's own healthcheck `test` until it passes;
- service hostnames in URLs (`redis://redis:6379`, `http://sim:30000`) become 127.0.0.1 and the port the named
  service really listens on; listening services get a free loopback port (`--port`, `--bind`/`--host 0.0.0.0`
  -> 127.0.0.1). A URL naming a service that is not started, or a port the service does not listen on, fails;
- the docs' one `docker compose ... run ... produce ...` command (plus its block's `mkdir` and
  `python -m demo.tokenizer` steps) runs the `produce` service's entrypoint with the doc's arguments in its
  emulated /work: the `*.jsonl` files it names under a mount are demo datasets, the tokenizer mount holds the tests'
  local tokenizer (unless the block builds one), `out/` is the host folder the docs promise outputs in. Should the
  doc ever show several such commands, `<!-- compose-run: sim up -->` / `<!-- compose-run: sim produce -->`
  right before a fenced block picks the one to run.

Then: produce exits 0, each dataset's raw_responses.jsonl holds every id of its input once, Redis' token counter
equals the file's completion tokens, rq-dashboard (its compose command, basic auth from the .env values) lists the
queue and the finished chunk jobs and refuses requests without the password, and each worker stops on one SIGTERM
(the compose stop_signal) well within the compose stop_grace_period, deregistering from Redis.

What cannot be checked here: images, the build, the compose network itself, `init`, `restart`, the non-root
`USER` (processes run as the current user; `--user` is only checked to be present where it is needed).
Never touches 127.0.0.1:6379: every Redis URL a process gets is checked to be the private server's first.
"""
from __future__ import annotations

import base64
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest
import redis

from demo.stack import free_port
from tests.compose_file import (
    COMPOSE,
    DEPLOYMENT_DOC,
    MissingVariable,
    argv,
    depends_on,
    dockerfile_instructions,
    duration_seconds,
    environment,
    interpolate,
)
from tests.procs import read_jsonl  # only newline-terminated lines: the stack may still be writing

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEMO_DATA = ROOT / "demo" / "data"
SYSTEM_REDIS_PORT = 6379  # a server this test did not start: never connect to it
LOOPBACK = "127.0.0.1"
#: The official redis image's WORKDIR, where the compose file mounts the `redis-data` volume.
IMAGE_WORKDIR = {"redis": "/data"}
#: Our own waits, whatever the compose durations allow (a healthcheck may allow minutes): the test stays short.
MAX_HEALTH_WAIT_S = 30.0
MAX_STOP_WAIT_S = 30.0
#: Optional markers in docs/deployment.md: the fenced block after `<!-- MARKER -->` holds the command to run.
UP_MARKER = "compose-run: sim up"
RUN_MARKER = "compose-run: sim produce"
PRODUCE_TIMEOUT_S = 60.0  # ~5 s here
#: Runs a console script of the installed distributions by name, with sys.argv[0] set to that name.
LAUNCH = ("import sys; from importlib.metadata import entry_points; "
          "ep = next(iter(entry_points(group='console_scripts', name=sys.argv[1]))); "
          "sys.argv = sys.argv[1:]; sys.exit(ep.load()())")


# ------------------------------------------------------------------------------------ the doc's commands

_FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def fenced_blocks(text: str) -> list[str]:
    out = []
    for m in _FENCE.finditer(text):
        indent = m["indent"]
        out.append("\n".join(line[len(indent):] if line.startswith(indent) else line
                             for line in m["body"].splitlines()))
    return out


def block_commands(block: str) -> list[list[str]]:
    """The shell commands of a code block: continuation lines joined, comments dropped."""
    commands = []
    for line in re.sub(r"\\\n", " ", block).splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # not shell (e.g. a redis-cli transcript with odd quoting)
            continue
        if words:
            commands.append(words)
    return commands


def doc_dotenv(doc: str) -> dict[str, str]:
    """The docs' `.env` example: the fenced block of KEY=VALUE lines that sets RQ_DASHBOARD_PASSWORD, read as
    compose reads a .env file (unquoted values end at ` #`)."""
    found = []
    for block in fenced_blocks(doc):
        lines = [ln.strip() for ln in block.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        if lines and all(_ASSIGNMENT.match(ln) for ln in lines) and any(
                ln.startswith("RQ_DASHBOARD_PASSWORD=") for ln in lines):
            found.append(lines)
    assert len(found) == 1, f"docs/deployment.md should have one `.env` example block, found {len(found)}"
    env = {}
    for line in found[0]:
        key, _, value = line.partition("=")
        if value[:1] in ("'", '"'):
            value = value[1:value.index(value[0], 1)]
        else:
            value = re.split(r"\s+#", value, maxsplit=1)[0].strip()
        env[key] = value
    return env


@dataclass
class ComposeCall:
    """One `[VAR=value ...] docker compose [--profile P ...] SUBCOMMAND ...` command of the docs."""

    words: list[str]
    block: str
    env: dict[str, str] = field(default_factory=dict)
    profiles: list[str] = field(default_factory=list)
    sub: str = ""
    options: dict[str, list[str]] = field(default_factory=dict)
    positional: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return shlex.join(self.words)


_GLOBAL_VALUED = {"--profile", "-f", "--file", "-p", "--project-name", "--env-file", "--project-directory"}
_SUB_FLAGS = {
    "up": {"-d", "--detach", "--wait", "--build", "--no-build", "--no-deps", "--remove-orphans",
           "--force-recreate", "--no-recreate", "--quiet-pull"},
    "run": {"--rm", "-d", "--detach", "-T", "--no-TTY", "--no-deps", "--build", "--service-ports", "-i",
            "--interactive", "--remove-orphans", "--quiet-pull", "--use-aliases"},
}
_SUB_VALUED = {
    "up": {"--scale", "--wait-timeout", "-t", "--timeout"},
    "run": {"-u", "--user", "-e", "--env", "--entrypoint", "-w", "--workdir", "-v", "--volume", "--name",
            "-p", "--publish", "-l", "--label"},
}


def parse_compose_call(words: list[str], block: str) -> ComposeCall:
    call = ComposeCall(words, block)
    i = 0
    while i < len(words) and _ASSIGNMENT.match(words[i]):
        key, _, value = words[i].partition("=")
        call.env[key] = value
        i += 1
    assert words[i:i + 2] == ["docker", "compose"], words
    i += 2
    while i < len(words) and words[i].startswith("-"):
        opt, eq, value = words[i].partition("=")
        assert opt in _GLOBAL_VALUED, f"`{call}`: this test does not know the compose option {opt}"
        if not eq:
            i += 1
            value = words[i]
        if opt == "--profile":
            call.profiles.append(value)
        else:
            pytest.fail(f"`{call}`: {opt} is not emulated here; teach tests/e2e/test_compose_run.py about it")
        i += 1
    call.sub = words[i]
    assert call.sub in _SUB_FLAGS, f"`{call}`: subcommand {call.sub!r} is not emulated here"
    i += 1
    while i < len(words):
        word = words[i]
        if call.positional or not word.startswith("-"):
            call.positional.append(word)  # `run`: SERVICE then its arguments, options included
        else:
            opt, eq, value = word.partition("=")
            if opt in _SUB_FLAGS[call.sub]:
                call.options.setdefault(opt, []).append("")
            else:
                assert opt in _SUB_VALUED[call.sub], f"`{call}`: unknown `{call.sub}` option {opt}"
                if not eq:
                    i += 1
                    value = words[i]
                call.options.setdefault(opt, []).append(value)
        i += 1
    return call


def doc_compose_calls(doc: str, sub: str, match: Callable[[ComposeCall], bool], marker: str) -> ComposeCall:
    """The one documented `docker compose SUB` command that `match` accepts: in the fenced block right after the
    comment `<!-- MARKER -->` if the doc has one, else the only such command of the doc."""
    at = doc.find(f"<!-- {marker} -->")
    blocks = fenced_blocks(doc[at:])[:1] if at >= 0 else fenced_blocks(doc)
    found = []
    for block in blocks:
        for words in block_commands(block):
            if "docker" in words and "compose" in words and sub in words:
                call = parse_compose_call(words, block)
                if call.sub == sub and match(call):
                    found.append(call)
    assert len(found) == 1, (f"docs/deployment.md should document exactly one such `docker compose {sub}` "
                             f"command (or mark its block with <!-- {marker} -->), found {[str(c) for c in found]}")
    return found[0]


# ------------------------------------------------------------------------------------ compose emulation

def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate_tree(v, env) for v in node]
    if isinstance(node, str):
        return interpolate(node, env)
    return node


def load_compose(env: Mapping[str, str]) -> dict[str, Any]:
    raw = yaml.safe_load(COMPOSE.read_text())
    try:
        return dict(interpolate_tree(raw, env))
    except MissingVariable as exc:
        pytest.fail(f"compose refuses the file with the environment the docs set ({sorted(env)}): {exc}")


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in dockerfile_instructions():
        if word == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def dockerfile_workdir() -> str:
    return [args for word, args in dockerfile_instructions() if word == "WORKDIR"][-1]


def resolve_executable(words: list[str]) -> list[str]:
    """The host command for a container's argv: python is this interpreter, console scripts run through it
    (so the code is this checkout's, see PYTHONPATH below), anything else must be on PATH (redis-server)."""
    exe, rest = words[0], words[1:]
    if exe in ("python", "python3"):
        return [sys.executable, *rest]
    if "/" not in exe and list(importlib.metadata.entry_points(group="console_scripts", name=exe)):
        return [sys.executable, "-c", LAUNCH, exe, *rest]
    found = shutil.which(exe)
    if found is None:
        pytest.fail(f"{exe!r} is neither a console script of the installed distributions nor on PATH")
    return [found, *rest]


_URL = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<auth>[^@/\s,'\"]*@)?(?P<host>[A-Za-z0-9_.-]+)"
                  r"(?::(?P<port>\d+))?")
_DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "http": 80, "https": 443}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class Stack:
    """The services of one `docker compose up`, as host processes on loopback ports."""

    def __init__(self, compose: dict[str, Any], up: ComposeCall, tmp: Path, project: Path) -> None:
        self.services: dict[str, dict[str, Any]] = compose["services"]
        self.our_image = self.services["worker"]["image"]
        self.tmp, self.project = tmp, project
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.procs: dict[str, list[Proc]] = {}
        self.healthy: set[str] = set()
        self.active = self._active(up)
        self.replicas = {name: int((self.services[name].get("deploy") or {}).get("replicas", 1))
                         for name in self.active}
        for scale in up.options.get("--scale", []):
            name, _, n = scale.partition("=")
            self.replicas[name] = int(n)
        self.taken: set[int] = set()
        # Listening services get their loopback ports up front, so every URL can be mapped before anything starts.
        self.argv: dict[str, list[str]] = {}
        self.ports: dict[str, dict[int, int]] = {}
        for name in self.active:
            self.argv[name], self.ports[name] = self._listen(name, self.command(self.services[name]))

    # -- configuration

    def _active(self, up: ComposeCall) -> list[str]:
        enabled = [n for n, s in self.services.items()
                   if not s.get("profiles") or set(s["profiles"]) & set(up.profiles)]
        if not up.positional:
            return enabled
        wanted: list[str] = []

        def add(name: str) -> None:
            if name not in wanted:
                wanted.append(name)
                if "--no-deps" not in up.options:
                    for dep, cond in depends_on(self.services[name]).items():
                        if dep in enabled or cond.get("required", True):
                            add(dep)
        for name in up.positional:
            add(name)
        return wanted

    def command(self, service: Mapping[str, Any], args: list[str] | None = None,
                entrypoint: str | None = None) -> list[str]:
        entry = argv(service.get("entrypoint")) if entrypoint is None else shlex.split(entrypoint)
        cmd = argv(service.get("command")) if args is None else args
        words = entry + cmd
        assert words, f"{service}: nothing to run"
        return words

    def new_port(self) -> int:
        while True:
            port = free_port()
            if port != SYSTEM_REDIS_PORT and port not in self.taken:
                self.taken.add(port)
                return port

    def _listen(self, name: str, words: list[str]) -> tuple[list[str], dict[int, int]]:
        """Bind loopback on a free port instead of 0.0.0.0:PORT; {container port: host port}."""
        args, ports = list(words), {}
        if "--port" in args:
            i = args.index("--port") + 1
            ports[int(args[i])] = self.new_port()
            args[i] = str(ports[int(args[i])])
        for flag in ("--host", "--bind"):
            if flag in args:
                i = args.index(flag) + 1
                if args[i] in ("0.0.0.0", "::"):
                    args[i] = LOOPBACK
        if Path(args[0]).name == "redis-server":  # listens on 6379 of every interface unless told otherwise
            if "--port" not in args:
                ports[6379] = self.new_port()
                args += ["--port", str(ports[6379])]
            if "--bind" not in args:
                args += ["--bind", LOOPBACK]
        assert "0.0.0.0" not in args and "::" not in args, f"{name}: still binds every address: {args}"
        for published in self.services[name].get("ports") or []:
            container_port = int(str(published).split("/")[0].rsplit(":", 1)[-1])
            assert container_port in ports, (
                f"{name}: publishes container port {container_port}, but listens on {sorted(ports)} ({words})")
        return args, ports

    def map_urls(self, text: str, service: str, own: bool = False) -> str:
        """Service hostnames -> 127.0.0.1:<its port>. `own`: 127.0.0.1 means the service itself (healthchecks);
        elsewhere a loopback URL in a container would be the container itself, a bug of the compose file."""
        def sub(m: re.Match[str]) -> str:
            host = m["host"]
            if host in ("127.0.0.1", "localhost", "0.0.0.0"):
                assert own, f"{service}: {m[0]!r} is the container itself, not another service"
                target = service
            elif host in self.services:
                target = host
            else:
                return m[0]
            assert target in self.active, (
                f"{service}: {m[0]!r} names the service {target!r}, which this `up` does not start "
                f"(started: {self.active})")
            container_port = int(m["port"] or _DEFAULT_PORTS[m["scheme"]])
            host_port = self.ports[target].get(container_port)
            assert host_port, f"{service}: {m[0]!r}: {target} listens on {sorted(self.ports[target])}"
            return f"{m['scheme']}://{m['auth'] or ''}{LOOPBACK}:{host_port}"
        return _URL.sub(sub, text)

    def container(self, name: str, service: Mapping[str, Any], user_given: bool = False) -> tuple[Path, Path]:
        """A root folder standing for the container's file system, with its volumes linked in; (root, cwd)."""
        n = sum(1 for p in (self.tmp / "containers").glob(f"{name}-*")) if (self.tmp / "containers").exists() else 0
        root = self.tmp / "containers" / f"{name}-{n}"
        (root / "home").mkdir(parents=True)
        for volume in service.get("volumes") or []:
            source, target, *mode = str(volume).split(":")
            if source.startswith((".", "/", "~")):
                host = (self.project / source).resolve()
                # Docker creates a missing bind-mount source itself, owned by root.
                assert host.is_dir(), f"{name}: {source} does not exist; docker would create it owned by root"
                if "ro" not in mode and service.get("image") == self.our_image:
                    assert user_given, (f"{name}: writes to the bind mount {source} as the image's user "
                                        f"(Dockerfile USER), not as its owner: the docs must pass --user")
            else:
                host = self.tmp / "volumes" / source
                host.mkdir(parents=True, exist_ok=True)
            link = root / target.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(host, target_is_directory=True)
        image = str(service.get("image", ""))
        workdir = service.get("working_dir") or (dockerfile_workdir() if image == self.our_image
                                                  else IMAGE_WORKDIR.get(image.split(":")[0], "/"))
        cwd = root / str(workdir).lstrip("/")
        cwd.mkdir(parents=True, exist_ok=True)
        return root, cwd

    def env(self, name: str, service: Mapping[str, Any], root: Path) -> dict[str, str]:
        """A container's environment: nothing of this shell's (no REDIS_URL leaks in) but PATH, the image's ENV,
        the service's environment; this checkout's code first on the path, as the image has it installed."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root / "home"), "LANG": "C.UTF-8"}
        declared = dict(environment(service))
        if service.get("image") == self.our_image:
            declared = {**dockerfile_env(), **declared}
            env["PYTHONPATH"] = str(ROOT)
        for key, value in declared.items():
            value = self.map_urls(value, name)
            if value.startswith("/"):  # a path in the container: under its root folder
                value = str(root) + value
            env[key] = value
        return env

    def check_targets(self, name: str, words: list[str], env: Mapping[str, str]) -> None:
        """A process is told where each service it depends on is: otherwise it would fall back to a default of
        its own (budgetq's and rq-dashboard's Redis default is 127.0.0.1:6379, a server this test must not touch;
        the worker's SGLang default is 127.0.0.1:30000). Every Redis URL it gets is the private server's."""
        given = " ".join([*words, *env.values()])
        for dep in depends_on(self.services.get(name) or {}):
            if dep in self.active:
                addresses = [f"{LOOPBACK}:{port}" for port in self.ports[dep].values()]
                assert any(a in given for a in addresses), (
                    f"{name} depends on {dep} but is not given its address ({addresses}) in {words} or {env}")
        ours = f"{LOOPBACK}:{self.ports['redis'][6379]}"
        urls = [w for w in [*words, *env.values()] if w.startswith(("redis://", "rediss://"))]
        assert all(ours in u for u in urls), f"{name}: Redis URLs {urls} are not the private {ours}"

    # -- processes

    def spawn(self, name: str, words: list[str], cwd: Path, env: dict[str, str]) -> Proc:
        index = len(self.procs.get(name, []))
        log = self.logs / f"{name}-{index}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(resolve_executable(words), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        proc = Proc(f"{name}-{index}", popen, log)
        self.procs.setdefault(name, []).append(proc)
        return proc

    def up(self) -> None:
        started: set[str] = set()

        def start(name: str) -> None:
            if name in started:
                return
            service = self.services[name]
            for dep, cond in depends_on(service).items():
                if dep not in self.active:
                    assert cond.get("required", True) is False, f"{name} needs {dep}, which this `up` does not start"
                    continue
                start(dep)
                condition = cond.get("condition", "service_started")
                assert condition in ("service_started", "service_healthy"), f"{name}: {condition} not emulated"
                if condition == "service_healthy":
                    self.wait_healthy(dep)
            for _ in range(self.replicas[name]):
                root, cwd = self.container(name, service)
                env = self.env(name, service, root)
                words = [self.map_urls(w, name) for w in self.argv[name]]
                self.check_targets(name, words, env)
                self.spawn(name, words, cwd, env)
            started.add(name)

        for name in self.active:
            start(name)

    def wait_healthy(self, name: str) -> None:
        """Run the service's healthcheck `test` until it passes: compose's service_healthy, on our clock."""
        if name in self.healthy:
            return
        check = self.services[name].get("healthcheck")
        assert check and not check.get("disable"), f"{name}: a service_healthy dependency without a healthcheck"
        test = check["test"]
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        kind, rest = test[0], [str(t) for t in test[1:]]
        assert kind in ("CMD", "CMD-SHELL"), f"{name}: healthcheck {test}"
        words = [self.map_urls(w, name, own=True) for w in rest]
        if kind == "CMD-SHELL":
            script = words[0]
            if re.match(r"redis-cli(\s|$)", script) and not re.search(r"\s-[phus]\s", script):
                # its default, 6379, is the container's own Redis: here, ours on its port (never the host's)
                script = f"redis-cli -p {self.ports[name][6379]}" + script[len("redis-cli"):]
            words = ["/bin/sh", "-c", script]
        elif Path(words[0]).name == "redis-cli" and not {"-p", "-h", "-u", "-s"} & set(words):
            words[1:1] = ["-p", str(self.ports[name][6379])]  # its default, 6379, is the container's own Redis
        timeout = duration_seconds(check.get("timeout", "30s"))
        allowed = duration_seconds(check.get("start_period", "0s")) + duration_seconds(
            check.get("interval", "30s")) * int(check.get("retries", 3))
        deadline = time.monotonic() + min(allowed, MAX_HEALTH_WAIT_S)
        cmd = resolve_executable(words)
        while True:
            try:
                res = subprocess.run(cmd, capture_output=True, timeout=timeout, env={"PATH": os.environ["PATH"]})
                if res.returncode == 0:
                    break
                last = res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")
            except subprocess.TimeoutExpired:
                last = f"timed out after {timeout}s"
            dead = [p for p in self.procs.get(name, []) if p.popen.poll() is not None]
            if dead or time.monotonic() > deadline:
                pytest.fail(f"{name} never became healthy ({shlex.join(words)}: {last[-500:]})\n"
                            f"{name} log:\n{self.procs[name][0].tail()}")
            time.sleep(0.05)  # polling a service that is coming up, as compose does: no event to await
        self.healthy.add(name)

    def stop(self, name: str, grace_cap: float = 10.0) -> list[tuple[int | None, float]]:
        """Compose's stop: stop_signal to every replica, SIGKILL after stop_grace_period (capped here);
        (exit code, seconds) of each."""
        service = self.services[name]
        sig = signal.Signals[str(service.get("stop_signal", "SIGTERM"))]
        grace = min(duration_seconds(service.get("stop_grace_period", "10s")), grace_cap)
        t0 = time.monotonic()
        procs = self.procs.get(name, [])
        for p in procs:
            if p.popen.poll() is None:
                p.popen.send_signal(sig)
        out: list[tuple[int | None, float]] = []
        for p in procs:
            try:
                p.popen.wait(max(0.1, t0 + grace - time.monotonic()))
                out.append((p.popen.returncode, time.monotonic() - t0))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(10)
                out.append((None, time.monotonic() - t0))
        return out

    def wait_while_up(self, proc: subprocess.Popen[bytes], timeout: float, what: str) -> None:
        """Wait for `proc` to exit; fail at once if a service of the stack dies meanwhile (compose would restart
        it, but a service that cannot stay up is a broken command), or after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                proc.wait(0.25)  # waits on the exit itself; the slice only bounds how late a dead service is seen
                return
            except subprocess.TimeoutExpired:
                pass
            dead = [p for procs in self.procs.values() for p in procs if p.popen.poll() is not None]
            assert not dead, f"{dead[0].name} exited ({dead[0].popen.returncode}) during {what}:\n{dead[0].tail()}"
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {p.name}:\n{p.tail(8)}" for procs in self.procs.values() for p in procs)
                pytest.fail(f"{what} did not finish within {timeout:.0f}s\n{tails}")

    def kill_all(self) -> None:
        for procs in reversed(list(self.procs.values())):
            for p in procs:
                if p.popen.poll() is None:
                    p.popen.terminate()
        for procs in self.procs.values():
            for p in procs:
                try:
                    p.popen.wait(10)
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait(5)


# ------------------------------------------------------------------------------------ helpers

def demo_file_for(stem: str, used: set[Path]) -> Path:
    """The demo dataset that fits a documented file name best (B1_glaive -> glaive_fc), else the next unused."""
    files = sorted(DEMO_DATA.glob("*.jsonl"))
    words = {w for w in re.split(r"[^a-z]+", stem.lower()) if len(w) > 2}
    match = next((f for f in files if f not in used and words & set(f.stem.split("_"))), None)
    chosen = match or next(f for f in files if f not in used)
    used.add(chosen)
    return chosen


def http(url: str, auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
    headers = {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


@pytest.fixture
def stack_holder() -> Iterator[list[Stack]]:
    holder: list[Stack] = []
    yield holder
    for stack in holder:
        stack.kill_all()


def check_dashboard(compose: Mapping[str, Any], dotenv: Mapping[str, str], stack: Stack, r: redis.Redis,
                    datasets: list[str], total_records: int) -> Proc:
    """rq-dashboard as the sim profile starts it: basic auth from the .env values, every endpoint refused without
    it, and with it the empty queue, each finished chunk (every sample of `datasets`) and the workers; its Proc."""
    dash_env = environment(compose["services"]["dashboard"])
    auth = (dash_env["RQ_DASHBOARD_USERNAME"], dash_env["RQ_DASHBOARD_PASSWORD"])
    assert auth == (dotenv["RQ_DASHBOARD_USERNAME"], dotenv["RQ_DASHBOARD_PASSWORD"])
    base = f"http://{LOOPBACK}:{stack.ports['dashboard'][9181]}"
    dash = stack.procs["dashboard"][0]
    deadline = time.monotonic() + 20
    while http(base + "/")[0] != 401:
        assert dash.popen.poll() is None and time.monotonic() < deadline, f"rq-dashboard not up:\n{dash.tail()}"
        time.sleep(0.05)  # polling a port that is coming up: there is no event to await
    finished_path = "/0/data/jobs/budgetq/finished/1000/asc/1.json"
    for endpoint in ("/0/data/queues.json", finished_path, "/0/data/workers.json"):
        assert http(base + endpoint)[0] == 401, endpoint
        assert http(base + endpoint, (auth[0], auth[1] + "x"))[0] == 401, endpoint
    status, body = http(base + "/0/data/queues.json", auth)
    assert status == 200, body[:300]
    queues = {q["name"]: q for q in json.loads(body)["queues"]}
    assert queues["budgetq"]["count"] == 0 and queues["budgetq"]["failed_job_registry_count"] == 0
    status, body = http(base + finished_path, auth)
    assert status == 200, body[:300]
    jobs = json.loads(body)["jobs"]
    assert sorted(j["id"] for j in jobs) == sorted(str(x) for x in r.zrange("rq:finished:budgetq", 0, -1))
    samples = 0
    for job in jobs:
        desc = re.match(r"(?P<ds>[\w-]+): (?P<n>\d+) samples", job["description"])
        assert desc and desc["ds"] in datasets, job["description"]
        samples += int(desc["n"])
    assert samples == total_records, "the finished chunks shown hold every sample"
    status, body = http(base + "/0/data/workers.json", auth)
    assert status == 200, body[:300]
    assert len(json.loads(body)["workers"]) == stack.replicas["worker"]
    return dash


# ------------------------------------------------------------------------------------ the test

@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_sim_profile_runs_the_documented_sample_job(tmp_path: Path, tokenizer_dir: Path,
                                                    stack_holder: list[Stack],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    doc = DEPLOYMENT_DOC.read_text()
    dotenv = doc_dotenv(doc)
    up = doc_compose_calls(doc, "up", lambda c: "sim" in c.profiles, UP_MARKER)
    run = doc_compose_calls(doc, "run", lambda c: c.positional[:1] == ["produce"], RUN_MARKER)

    project = tmp_path / "project"  # the user's folder beside docker-compose.yml: .env, data/, tokenizer/, out/
    project.mkdir()
    compose = load_compose({**dotenv, **up.env})  # the shell's variables win over .env, as in compose
    stack = Stack(compose, up, tmp_path, project)
    stack_holder.append(stack)
    assert {"redis", "sim", "worker", "dashboard"} <= set(stack.active) and "sglang" not in stack.active

    # -- docker compose --profile sim up -d
    t0 = time.monotonic()
    stack.up()
    for procs in stack.procs.values():
        for p in procs:
            assert p.popen.poll() is None, f"{p.name} exited at once:\n{p.tail()}"
    r = redis.Redis(host=LOOPBACK, port=stack.ports["redis"][6379], decode_responses=True)
    assert stack.ports["redis"][6379] != SYSTEM_REDIS_PORT

    # -- the doc's block: mkdir -p out (and a local tokenizer, if it builds one), then
    #    docker compose --profile tools run ... produce FILES... OPTIONS
    for words in block_commands(run.block):
        if words[0] == "mkdir" or (words[0] in ("python", "python3") and words[1:3] == ["-m", "demo.tokenizer"]):
            assert all(not w.startswith(("/", "~", "..")) for w in words[1:]), f"not in the project: {words}"
            subprocess.run(resolve_executable(words), cwd=project, check=True, capture_output=True)
        else:
            assert words[:2] == ["docker", "compose"] or _ASSIGNMENT.match(words[0]), (
                f"the produce block has a step this test does not emulate: {shlex.join(words)}")
    run_compose = load_compose({**dotenv, **run.env})
    service = run_compose["services"]["produce"]
    args = run.positional[1:]
    if "--no-deps" not in run.options:
        for dep, cond in depends_on(service).items():
            assert dep in stack.active, f"produce needs {dep}, which the sim profile's `up` did not start"
            if cond.get("condition") == "service_healthy":
                stack.wait_healthy(dep)
    entrypoint = run.options.get("--entrypoint")
    words = stack.command(service, args or None, entrypoint[-1] if entrypoint else None)
    mounts = {str(v).split(":")[1]: str(v).split(":") for v in service.get("volumes") or []}
    workdir = str((run.options.get("-w") or run.options.get("--workdir") or [service.get("working_dir", "/")])[-1])

    # Inputs the user would have: the demo datasets under the names the doc uses, a local tokenizer.
    used: set[Path] = set()
    data_args: list[str] = []
    for arg in args:
        target = arg if arg.startswith("/") else f"{workdir.rstrip('/')}/{arg}"
        mount = next((m for m in mounts if target.startswith(m.rstrip("/") + "/")), None)
        if mount and not arg.startswith("-") and arg.endswith(".jsonl"):
            host = (project / mounts[mount][0] / target[len(mount):].lstrip("/")).resolve()
            host.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(demo_file_for(Path(arg).stem, used), host)
            data_args.append(arg)
    assert data_args, f"`{run}`: no dataset file under one of the produce service's mounts {sorted(mounts)}"
    tokenizer_target = environment(service).get("BUDGETQ_TOKENIZER")
    assert tokenizer_target in mounts, "produce's default --tokenizer must be its tokenizer mount"
    if not (project / mounts[tokenizer_target][0]).exists():  # the user's own model's tokenizer
        shutil.copytree(tokenizer_dir, (project / mounts[tokenizer_target][0]).resolve())

    root, cwd = stack.container("produce", service, user_given=bool(run.options.get("--user") or
                                                                      run.options.get("-u")))
    assert cwd == root / workdir.lstrip("/")
    env = stack.env("produce", service, root)
    for item in run.options.get("-e", []) + run.options.get("--env", []):
        key, _, value = item.partition("=")
        env[key] = stack.map_urls(value, "produce")
    stack.check_targets("produce", words, env)
    t_produce = time.monotonic()
    with open(tmp_path / "logs" / "produce.log", "wb") as log:
        produce = subprocess.Popen(resolve_executable([stack.map_urls(w, "produce") for w in words]), cwd=cwd,
                                   env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        stack.wait_while_up(produce, PRODUCE_TIMEOUT_S, f"`{run}`")
    finally:
        if produce.poll() is None:
            produce.kill()
            produce.wait(10)
    produce_log = (tmp_path / "logs" / "produce.log").read_text(errors="replace")
    assert produce.returncode == 0, f"`{run}` exited {produce.returncode}:\n{produce_log[-3000:]}"
    produce_s = time.monotonic() - t_produce

    # -- outputs land in ./out/<dataset>/raw_responses.jsonl on the host, exactly once each, counted exactly
    from budget.keys import DatasetKeys
    from producer.inputs.reader import parse_dataset_arg

    total_records = 0
    datasets = []
    for arg in data_args:
        with monkeypatch.context() as mp:
            mp.chdir(cwd)
            name, path = parse_dataset_arg(arg)
        datasets.append(name)
        expected = sorted(str(x["id"]) for x in read_jsonl(cwd / path))
        out_file = project / "out" / name / "raw_responses.jsonl"
        assert out_file.is_file(), f"{out_file.relative_to(project)} missing; out/ holds {os.listdir(project / 'out')}"
        recs = read_jsonl(out_file)
        assert sorted(x["id"] for x in recs) == expected, f"{name}: ids differ from the input's"
        keys = DatasetKeys(name)
        assert int(r.get(keys.used) or 0) == sum(x["completion_tokens"] for x in recs), f"{name}: counter drift"
        assert r.hlen(keys.done) == len(recs)
        total_records += len(recs)
    assert len(set(datasets)) == len(datasets) == len(data_args)

    # -- rq-dashboard: its compose command, basic auth from the .env values
    dash = check_dashboard(compose, dotenv, stack, r, datasets, total_records)

    # -- docker compose down: dependents first; workers get one SIGTERM, finish, deregister
    worker_service = compose["services"]["worker"]
    grace = duration_seconds(worker_service["stop_grace_period"])
    assert r.scard("rq:workers") == stack.replicas["worker"]
    # Flask's server has no SIGTERM handler: it ends by the signal, which compose counts as stopped.
    assert [code for code, _ in stack.stop("dashboard")] in ([0], [-signal.SIGTERM]), dash.tail()
    stops = stack.stop("worker", grace_cap=MAX_STOP_WAIT_S)
    for proc, (code, seconds) in zip(stack.procs["worker"], stops, strict=True):
        assert code == 0 and seconds < grace, f"{proc.name}: exit {code} after {seconds:.1f}s:\n{proc.tail()}"
        assert "Traceback" not in proc.log.read_text(errors="replace"), proc.tail()
    assert r.scard("rq:workers") == 0, "a worker stopped without deregistering"
    stack.stop("sim")
    r.close()
    assert [code for code, _ in stack.stop("redis", grace_cap=MAX_STOP_WAIT_S)] == [0]
    volume = tmp_path / "volumes" / "redis-data"
    assert (volume / "appendonlydir").is_dir(), "Redis keeps its AOF in the named volume"

    elapsed = time.monotonic() - t0
    print(f"sim profile: {len(stack.procs['worker'])} workers, {total_records} samples, produce {produce_s:.1f}s, "
          f"workers stopped in {max(seconds for _, seconds in stops):.1f}s, stack {elapsed:.1f}s")
