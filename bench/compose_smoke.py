"""`make compose-smoke`: docker-compose.yml's sim profile started for real, with containers, then torn down.

tests/test_compose.py reads the compose file and tests/test_compose_run.py runs its services as host processes,
because CI has no container engine. Neither builds the image, starts a container, resolves a service name on the
compose network or publishes a port. This does, on a machine that has no Docker Compose v2 and no image registry
(the case here): rootful podman + podman-compose, set up the way /work/shared/reference/containers.md found to
work. It is opt-in, never part of CI: cold it takes minutes and over a gigabyte of disk.

What it does, in order (each step prints its wall time):

1. packages: podman (+ netavark, aardvark-dns, runc, mmdebstrap) by apt-get when missing, podman-compose 1.6.0
   in a venv of its own; a containers.conf of its own (CONTAINERS_CONF: runc, explicit ulimits), the system's is
   never edited;
2. base images: `python:3.11-slim` and `redis:7` are used when present, else stand-ins are built from Debian
   packages (mmdebstrap | podman import) since no registry is reachable;
3. a wheelhouse on the host (`pip download` by the base image's pip, with the host's network and CA bundle),
   because downloads from inside a build container fail certificate checks here; the image is then built offline from it (`PIP_INSTALL_OPTS` build argument, podman's `-v`);
   the build context must be unchanged afterwards (no `build/`, no `*.egg-info`);
4. docs/deployment.md's quick start, its own blocks run by bash in a project folder of its own
   (`<!-- compose-run: sim up -->`, `<!-- compose-run: sim produce -->`), with `docker compose` standing for
   `podman-compose -p budgetq-smoke --env-file ...`;
5. checks: produce exits 0; every input id is in its dataset's raw_responses.jsonl exactly once; Redis'
   token counter equals the file's completion tokens and the done hash holds every sample (read with redis-cli
   inside the Redis container: Redis is not published); the dashboard answers 401 without auth and with a wrong
   password, 200 with it, and lists the workers; every published port is on 127.0.0.1;
6. teardown: `down -v`, then everything labelled with the project (containers, including scaled and `run`
   ones podman-compose's `down` misses, networks, volumes) is removed and checked gone. Images are kept for the
   next (warm) run; `--cold` removes them (and the wheelhouse) first.

Never touches 127.0.0.1:6379: Redis is reached only inside its container. Needs root (rootful podman).
"""
from __future__ import annotations

import argparse
import configparser
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deployment.md"
PROJECT = "budgetq-smoke"
LABEL = f"io.podman.compose.project={PROJECT}"
TAG = "smoke"  # budgetq:smoke, so a user's budgetq:latest is left alone
APT_PACKAGES = ["podman", "netavark", "aardvark-dns", "catatonit", "iptables", "uidmap", "mmdebstrap", "runc"]
PODMAN_COMPOSE = "podman-compose==1.6.0"
MIRROR = "http://deb.debian.org/debian"
PY_BASE = "docker.io/library/python:3.11-slim"
REDIS_BASE = "docker.io/library/redis:7"
CONTAINERS_CONF = """\
# budgetq compose smoke: root lacks CAP_SYS_RESOURCE here, and crun refuses the hybrid cgroup layout.
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
"""
#: The official redis image's entrypoint turns protected mode off (the compose network is the boundary).
REDIS_ENTRYPOINT = """#!/bin/sh
set -e
if [ "$1" = "redis-server" ]; then shift; set -- redis-server --protected-mode no "$@"; fi
exec "$@"
"""
UP_MARKER = "<!-- compose-run: sim up -->"
RUN_MARKER = "<!-- compose-run: sim produce -->"
HEALTH_TIMEOUT_S = 180.0
PRODUCE_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 1800.0


class SmokeError(Exception):
    """A step failed: the message says which and why."""


def log(msg: str) -> None:
    print(f"[compose-smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Smoke:
    """One run: its state folder (venv, wheelhouse, config), its project folder, and its timings."""

    def __init__(self, state: Path, dashboard_port: int) -> None:
        self.state = state
        self.venv = state / "venv"
        self.wheels = state / "wheels"
        self.conf = state / "containers.conf"
        self.dashboard_port = dashboard_port
        self.timings: dict[str, float] = {}
        self.facts: dict[str, object] = {}
        self.project = Path(tempfile.mkdtemp(prefix="run-", dir=state))
        self.env_file = self.project / "smoke.env"
        self.user = "smoke-" + secrets.token_hex(4)
        self.password = secrets.token_urlsafe(18)
        self.env = dict(os.environ, CONTAINERS_CONF=str(self.conf))
        # The shell's variables win over the env file in compose: none of the host's may leak in.
        for name in ("BUDGETQ_REDIS_URL", "SGLANG_URL", "SGLANG_API_KEY", "DATA_DIR", "TOKENIZER_DIR", "OUT_DIR",
                     "BUDGETQ_TAG", "BUDGETQ_DASHBOARD_PORT", "RQ_DASHBOARD_USERNAME", "RQ_DASHBOARD_PASSWORD",
                     "COMPOSE_PROJECT_NAME", "COMPOSE_FILE"):
            self.env.pop(name, None)

    # ------------------------------------------------------------------------------------------ helpers

    def run(self, args: Sequence[str], timeout: float = 600.0, check: bool = True, quiet: bool = False,
            cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        if not quiet:
            log("$ " + " ".join(args))
        p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                           env=env or self.env, stdin=subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise SmokeError(f"`{' '.join(args)}` exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
        return p

    def step(self, name: str) -> "_Step":
        return _Step(self, name)

    def compose_cmd(self) -> list[str]:
        return [str(self.venv / "bin" / "podman-compose"), "-p", PROJECT, "--env-file", str(self.env_file)]

    # ------------------------------------------------------------------------------------------ 1. packages

    def ensure_packages(self) -> None:
        if os.geteuid() != 0:
            raise SmokeError("needs root: rootful podman (rootless needs subuid ranges and slirp4netns)")
        missing = [p for p, exe in (("podman", "podman"), ("mmdebstrap", "mmdebstrap"), ("runc", "runc"))
                   if shutil.which(exe) is None]
        if missing or not Path("/usr/lib/podman/netavark").exists():
            self.run(["apt-get", "update", "-qq"], timeout=600)
            self.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES], timeout=1200,
                     env=dict(self.env, DEBIAN_FRONTEND="noninteractive"))
        if not (self.venv / "bin" / "podman-compose").exists():
            self.run([sys.executable, "-m", "venv", str(self.venv)])
            self.run([str(self.venv / "bin" / "pip"), "install", "-q", PODMAN_COMPOSE], timeout=600)
        self.conf.write_text(CONTAINERS_CONF)
        self.facts["podman"] = self.run(["podman", "--version"], quiet=True).stdout.strip()
        self.facts["podman-compose"] = PODMAN_COMPOSE

    # ------------------------------------------------------------------------------------------ 2. bases

    def image_exists(self, ref: str) -> bool:
        return self.run(["podman", "image", "exists", ref], check=False, quiet=True).returncode == 0

    def debian_image(self, ref: str, packages: list[str], hooks: list[str], changes: list[str]) -> None:
        """A stand-in base image from Debian bookworm packages: mmdebstrap's tarball, `podman import`ed."""
        if self.image_exists(ref):
            log(f"{ref}: present")
            return
        log(f"{ref}: no registry here, building a stand-in from Debian packages")
        strap = ["mmdebstrap", "--quiet", "--variant=minbase", "--include=" + ",".join(packages),
                 "--dpkgopt=path-exclude=/usr/share/doc/*", "--dpkgopt=path-exclude=/usr/share/man/*",
                 "--dpkgopt=path-exclude=/usr/share/locale/*",
                 *(f"--customize-hook={h}" for h in hooks), "bookworm", "-", MIRROR]
        imp = ["podman", "import", *(a for c in changes for a in ("--change", c)), "-", ref]
        log("$ " + " ".join(strap) + " | " + " ".join(imp))
        with subprocess.Popen(strap, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env) as s:
            i = subprocess.run(imp, stdin=s.stdout, capture_output=True, text=True, env=self.env, timeout=1200)
            assert s.stdout is not None and s.stderr is not None
            s.stdout.close()
            err = s.stderr.read().decode(errors="replace")
            s.wait(60)
        if s.returncode != 0 or i.returncode != 0:
            raise SmokeError(f"stand-in {ref}: mmdebstrap {s.returncode}, import {i.returncode}:\n{err[-2000:]}"
                             f"\n{i.stderr[-2000:]}")

    def ensure_bases(self) -> None:
        self.debian_image(PY_BASE, ["python3", "python3-pip", "python3-venv", "python-is-python3",
                                    "ca-certificates", "passwd"],
                          ['rm -f "$1"/usr/lib/python3.11/EXTERNALLY-MANAGED'], ['CMD ["python3"]'])
        entry = self.state / "redis-entrypoint.sh"
        entry.write_text(REDIS_ENTRYPOINT)
        self.debian_image(REDIS_BASE, ["redis-server", "redis-tools"],
                          [f'install -m 755 {entry} "$1"/usr/local/bin/docker-entrypoint.sh', 'mkdir -p "$1"/data'],
                          ['ENTRYPOINT ["docker-entrypoint.sh"]', 'CMD ["redis-server"]', "WORKDIR /data",
                           "EXPOSE 6379"])

    # ------------------------------------------------------------------------------------------ 3. image

    def requirements(self) -> list[str]:
        cfg = configparser.ConfigParser()
        cfg.read(ROOT / "setup.cfg")
        reqs = [ln.split("#")[0].strip() for ln in cfg.get("options", "install_requires").splitlines()]
        build = re.search(r"requires\s*=\s*\[([^\]]*)\]", (ROOT / "pyproject.toml").read_text())
        build_reqs = re.findall(r'"([^"]+)"', build.group(1)) if build else []
        dockerfile = (ROOT / "Dockerfile").read_text()
        dash = re.search(r"RQ_DASHBOARD_VERSION=(\S+)", dockerfile)
        return [r for r in reqs if r] + build_reqs + [f"rq-dashboard=={dash.group(1) if dash else '0.9.0'}", "six"]

    def context_snapshot(self) -> set[str]:
        """Every path in the build context, untracked and ignored ones included (what a build could leave)."""
        out = self.run(["git", "-C", str(ROOT), "status", "--porcelain", "--ignored", "--untracked-files=all"],
                       quiet=True).stdout
        return {ln[3:] for ln in out.splitlines() if not ln[3:].startswith(("out/", "tokenizer/"))}

    def build(self) -> None:
        self.wheels.mkdir(parents=True, exist_ok=True)
        # Downloaded by the base image's own pip (its Python decides the markers: bookworm's 3.11.2 needs
        # async-timeout, a newer host Python does not), with the host's network and CA bundle: inside a build
        # container, downloads failed certificate checks here.
        ca = "/etc/ssl/certs/ca-certificates.crt"
        self.run(["podman", "run", "--rm", "--network", "host", "-v", f"{ca}:{ca}:ro", "-e", f"PIP_CERT={ca}",
                  "-v", f"{self.wheels}:/wheels", PY_BASE, "pip", "download", "-q", "--only-binary=:all:",
                  "-d", "/wheels", *self.requirements()], timeout=1200)
        self.facts["wheelhouse MB"] = round(sum(f.stat().st_size for f in self.wheels.iterdir()) / 1e6, 1)
        before = self.context_snapshot()
        self.run(["podman", "build", "-t", f"budgetq:{TAG}", "-v", f"{self.wheels}:/wheels:ro,Z",
                  "--build-arg", "PIP_INSTALL_OPTS=--no-index --find-links /wheels", str(ROOT)],
                 timeout=BUILD_TIMEOUT_S)
        left = sorted(self.context_snapshot() - before)
        if left:
            raise SmokeError(f"the build wrote into the build context: {left}")
        self.facts["build context unchanged"] = True

    # ------------------------------------------------------------------------------------------ 4. quick start

    def doc_block(self, marker: str) -> str:
        text = DOC.read_text()
        at = text.find(marker)
        if at < 0:
            raise SmokeError(f"{DOC.name}: no {marker}")
        m = re.search(r"```[^\n]*\n(.*?)^```", text[at:], re.M | re.S)
        if not m:
            raise SmokeError(f"{DOC.name}: no fenced block after {marker}")
        return m.group(1)

    def prepare_project(self) -> None:
        """The user's folder beside docker-compose.yml: the compose file, demo/data, an env file."""
        shutil.copy(ROOT / "docker-compose.yml", self.project / "docker-compose.yml")
        shutil.copytree(ROOT / "demo" / "data", self.project / "demo" / "data")
        self.env_file.write_text(
            f"RQ_DASHBOARD_USERNAME={self.user}\nRQ_DASHBOARD_PASSWORD={self.password}\n"
            f"BUDGETQ_TAG={TAG}\nBUDGETQ_DASHBOARD_PORT={self.dashboard_port}\n")
        self.env_file.chmod(0o600)

    def bash_block(self, block: str, timeout: float) -> str:
        """Run a doc block in the project folder, `docker compose` being podman-compose for this project."""
        compose = " ".join(f"'{w}'" for w in self.compose_cmd())
        script = (f"set -euo pipefail\n"
                  f"docker() {{ if [ \"$1\" != compose ]; then echo 'not docker compose' >&2; return 2; fi\n"
                  f"  shift; {compose} \"$@\"; }}\n"
                  f"python() {{ PYTHONPATH={ROOT} {sys.executable} \"$@\"; }}\n{block}")
        log("doc block:\n    " + block.strip().replace("\n", "\n    "))
        p = subprocess.run(["bash", "-c", script], cwd=self.project, env=self.env, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        (self.project / "block.log").open("a").write(p.stdout + p.stderr)
        if p.returncode != 0:
            raise SmokeError(f"doc block exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}")
        return p.stdout + p.stderr

    def containers(self, service: str | None = None, all_: bool = False) -> list[str]:
        args = ["podman", "ps", "--format", "{{.Names}}", "--filter", f"label={LABEL}"]
        if service:
            args += ["--filter", f"label=io.podman.compose.service={service}"]
        if all_:
            args.append("-a")
        return self.run(args, quiet=True).stdout.split()

    def wait_healthy(self, service: str) -> None:
        """podman 4.3 runs no healthcheck on its own (no systemd timers) and ignores service_healthy: run it."""
        names = self.containers(service)
        if not names:
            raise SmokeError(f"no running {service} container")
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        for name in names:
            while self.run(["podman", "healthcheck", "run", name], check=False, quiet=True).returncode != 0:
                if time.monotonic() > deadline:
                    logs = self.run(["podman", "logs", "--tail", "30", name], check=False, quiet=True)
                    raise SmokeError(f"{name} not healthy after {HEALTH_TIMEOUT_S:.0f}s:\n{logs.stdout}{logs.stderr}")
                time.sleep(1)  # each check is a process in the container: nothing to await on the host
        log(f"{service}: healthy ({', '.join(names)})")

    # ------------------------------------------------------------------------------------------ 5. checks

    def redis_cli(self, *args: str) -> str:
        name = self.containers("redis")[0]
        return self.run(["podman", "exec", name, "redis-cli", "--raw", *args], quiet=True).stdout.strip()

    def check_outputs(self, produce_block: str) -> None:
        sys.path.insert(0, str(ROOT))
        from budget.keys import DatasetKeys
        from producer.reader import parse_dataset_arg

        args = re.findall(r"\S+\.jsonl", produce_block)
        data_dir = re.search(r"DATA_DIR=(\S+)", produce_block)
        total = 0
        for arg in args:
            name, rel = parse_dataset_arg(arg)
            src = self.project / (data_dir.group(1) if data_dir else "data") / Path(rel).relative_to("data")
            expected = sorted(str(json.loads(ln)["id"]) for ln in src.read_text().splitlines() if ln.strip())
            out = self.project / "out" / name / "raw_responses.jsonl"
            if not out.is_file():
                raise SmokeError(f"{out} missing")
            recs = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()]
            ids = sorted(str(r["id"]) for r in recs)
            if ids != expected:
                dup = len(ids) - len(set(ids))
                raise SmokeError(f"{name}: {len(ids)} records ({dup} duplicates) for {len(expected)} inputs")
            keys = DatasetKeys(name)
            used, done = int(self.redis_cli("GET", keys.used) or 0), int(self.redis_cli("HLEN", keys.done))
            tokens = sum(int(r["completion_tokens"]) for r in recs)
            if used != tokens or done != len(recs):
                raise SmokeError(f"{name}: counter {used} vs file {tokens} tokens; done {done} vs {len(recs)}")
            log(f"{name}: {len(recs)} samples exactly once, {tokens} completion tokens = Redis counter")
            total += len(recs)
        self.facts["samples"] = total
        self.facts["datasets"] = len(args)

    def http(self, path: str, auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.dashboard_port}{path}")
        if auth:
            req.add_header("Authorization", "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def check_dashboard(self) -> None:
        ports = self.run(["podman", "ps", "--filter", f"label={LABEL}", "--format", "{{.Names}} {{.Ports}}"],
                         quiet=True).stdout
        published = re.findall(r"([\d.]*):(\d+)->", ports)
        if not published or any(ip != "127.0.0.1" for ip, _ in published):
            raise SmokeError(f"published ports must be on 127.0.0.1 only:\n{ports}")
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            try:
                status, _ = self.http("/")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SmokeError("dashboard not answering on 127.0.0.1:%d" % self.dashboard_port) from None
                time.sleep(1)  # a port coming up behind podman's port forwarding: no event to await
        auth = (self.user, self.password)
        for path in ("/", "/0/data/queues.json", "/0/data/workers.json"):
            for bad in (None, (self.user, self.password + "x")):
                code, _ = self.http(path, bad)
                if code != 401:
                    raise SmokeError(f"dashboard {path} answered {code} to {'no' if bad is None else 'a wrong'} auth")
        code, body = self.http("/", auth)
        if code != 200 or b"rq dashboard" not in body.lower():
            raise SmokeError(f"dashboard / with auth: {code} {body[:200]!r}")
        code, body = self.http("/0/data/queues.json", auth)
        queues = {q["name"]: q for q in json.loads(body)["queues"]} if code == 200 else {}
        if "budgetq" not in queues:
            raise SmokeError(f"dashboard queues.json: {code} {body[:300]!r}")
        code, body = self.http("/0/data/workers.json", auth)
        workers = json.loads(body)["workers"] if code == 200 else None
        running = self.containers("worker")
        if workers is None or len(workers) != len(running):
            raise SmokeError(f"dashboard workers.json: {code}, {workers!r} for {len(running)} worker containers")
        self.facts["workers"] = len(running)
        uid = self.run(["podman", "exec", running[0], "id", "-u"], quiet=True).stdout.strip()
        if uid != "10001":
            raise SmokeError(f"{running[0]} runs as uid {uid}, not the image's 10001")
        log(f"dashboard: 401 without auth and with a wrong password, 200 with it; {len(workers)} workers listed; "
            f"published: {', '.join(f'{ip}:{p}' for ip, p in published)}")

    # ------------------------------------------------------------------------------------------ 6. teardown

    def save_logs(self) -> None:
        """Every container's log into the project folder (kept with --keep or after a failure)."""
        for name in self.containers(all_=True):
            p = self.run(["podman", "logs", name], check=False, quiet=True)
            (self.project / f"{name}.log").write_text(p.stdout + p.stderr)
            if "_worker_" in name:
                # Retries are not failures (the run is still exactly once), but they say what the stack did.
                for m in re.finditer(r"attempt \d+ failed \((\w+)", p.stdout + p.stderr):
                    key = f"worker retries: {m.group(1)}"
                    self.facts[key] = int(str(self.facts.get(key, 0))) + 1

    def stop_gracefully(self) -> None:
        """Dependents first, one SIGTERM each (the compose stop_signal), timed: a worker must exit 0, soon."""
        stops = []
        for service in ("dashboard", "worker", "sim", "redis"):
            for name in self.containers(service):
                t = time.monotonic()
                self.run(["podman", "stop", "-t", "60", name], check=False, quiet=True, timeout=120)
                seconds = time.monotonic() - t
                code = self.run(["podman", "inspect", "--format", "{{.State.ExitCode}}", name], check=False,
                                quiet=True).stdout.strip()
                stops.append(f"{service} {code} {seconds:.1f}s")
                if service == "worker" and (code != "0" or seconds > 30):
                    raise SmokeError(f"{name}: exit {code} after {seconds:.1f}s on SIGTERM (want 0, quickly)")
        self.facts["stops (service exit seconds)"] = stops
        log("stopped: " + ", ".join(stops))

    def teardown(self) -> None:
        if self.env_file.exists():
            self.save_logs()
            self.run([*self.compose_cmd(), "-f", str(self.project / "docker-compose.yml"), "--profile", "sim",
                      "--profile", "tools", "down", "-v", "-t", "60"], check=False, timeout=900)
        for kind in ("container", "network", "volume"):
            ls = ["podman", kind, "ls", "-q", "--filter", f"label={LABEL}"]
            if kind == "container":
                ls = ["podman", "ps", "-aq", "--filter", f"label={LABEL}"]
            ids = self.run(ls, check=False, quiet=True).stdout.split()
            if ids:
                log(f"removing {len(ids)} {kind}(s) `down` left")
                rm = ["podman", kind, "rm", "-f", *ids] if kind != "container" else ["podman", "rm", "-f", "-t", "60",
                                                                                      *ids]
                self.run(rm, check=False, timeout=300)
            left = self.run(ls, check=False, quiet=True).stdout.split()
            if left:
                raise SmokeError(f"teardown left {kind}s: {left}")

    def sizes(self) -> None:
        for ref in (f"localhost/budgetq:{TAG}", PY_BASE, REDIS_BASE):
            p = self.run(["podman", "image", "inspect", "--format", "{{.Size}}", ref], check=False, quiet=True)
            if p.returncode == 0:
                self.facts[f"image {ref} MB"] = round(int(p.stdout.strip()) / 1e6)

    def cold(self) -> None:
        """Forget everything a previous run kept: images, build cache, wheelhouse."""
        for ref in (f"localhost/budgetq:{TAG}", PY_BASE, REDIS_BASE):
            if self.image_exists(ref):
                self.run(["podman", "rmi", "-f", ref], check=False)
        self.run(["podman", "image", "prune", "-f"], check=False)
        shutil.rmtree(self.wheels, ignore_errors=True)


class _Step:
    def __init__(self, smoke: Smoke, name: str) -> None:
        self.smoke, self.name = smoke, name

    def __enter__(self) -> None:
        log(f"== {self.name}")
        self.t0 = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.smoke.timings[self.name] = round(time.monotonic() - self.t0, 1)
        log(f"== {self.name}: {self.smoke.timings[self.name]}s{' (failed)' if exc[0] else ''}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state", type=Path, default=Path(os.environ.get("BUDGETQ_SMOKE_STATE",
                                                                      "/var/tmp/budgetq-compose-smoke")),
                    help="venv, wheelhouse and logs (kept between runs)")
    ap.add_argument("--dashboard-port", type=int, default=int(os.environ.get("BUDGETQ_SMOKE_DASHBOARD_PORT", 19181)),
                    help="host port (127.0.0.1) for the dashboard, instead of the compose default 9181")
    ap.add_argument("--cold", action="store_true", help="remove the images and wheelhouse of earlier runs first")
    ap.add_argument("--keep", action="store_true", help="keep the project folder (outputs, logs) after a pass")
    ap.add_argument("--json", type=Path, help="write timings and facts here")
    args = ap.parse_args(argv)
    args.state.mkdir(parents=True, exist_ok=True)
    smoke = Smoke(args.state, args.dashboard_port)
    t0 = time.monotonic()
    ok = False
    try:
        with smoke.step("packages"):
            smoke.ensure_packages()
        smoke.teardown()  # a previous run that was killed
        if args.cold:
            with smoke.step("cold: remove images"):
                smoke.cold()
            t0 = time.monotonic()  # the wall time of a cold run, not of forgetting the last one
        with smoke.step("base images"):
            smoke.ensure_bases()
        with smoke.step("build"):
            smoke.build()
        smoke.prepare_project()
        with smoke.step("up"):
            smoke.bash_block(smoke.doc_block(UP_MARKER), 600)
            smoke.wait_healthy("redis")
            smoke.wait_healthy("sim")
        block = smoke.doc_block(RUN_MARKER)
        with smoke.step("produce"):
            smoke.bash_block(block, PRODUCE_TIMEOUT_S)
        with smoke.step("checks"):
            smoke.check_outputs(block)
            smoke.check_dashboard()
        with smoke.step("graceful stop"):
            smoke.stop_gracefully()
        ok = True
    except (SmokeError, subprocess.TimeoutExpired) as e:
        log(f"FAILED: {e}")
    finally:
        try:
            with smoke.step("teardown"):
                smoke.teardown()
        except SmokeError as e:
            log(f"FAILED: {e}")
            ok = False
    wall = round(time.monotonic() - t0, 1)
    smoke.sizes()
    if ok and not args.keep:
        shutil.rmtree(smoke.project, ignore_errors=True)
    result = {"ok": ok, "wall_s": wall, "cold": args.cold, "steps_s": smoke.timings, **smoke.facts,
              "project": str(smoke.project) if smoke.project.exists() else None}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
