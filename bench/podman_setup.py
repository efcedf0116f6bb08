"""The podman side of `make compose-smoke` (bench/compose_smoke.py): packages, base images, the image build.

On a machine with no image registry and no Docker Compose v2 (the case here), rootful podman + podman-compose is
set up the way /work/shared/reference/containers.md found to work: Debian's podman 4.3 with runc and explicit
ulimits (a containers.conf of its own, through CONTAINERS_CONF), podman-compose in a venv, stand-in base images
built from Debian packages, and an offline build from a wheelhouse. Kept apart from the smoke's checks so each
module holds one concept.
"""
from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
TAG = "smoke"  # budgetq:smoke, so a user's budgetq:latest is left alone
BUILD_TIMEOUT_S = 1800.0
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

class SmokeError(Exception):
    """A step failed: the message says which and why."""


def log(msg: str) -> None:
    print(f"[compose-smoke {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Podman:
    """Runs podman with this smoke's own containers.conf; sets up what the compose stack needs."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.venv = state / "venv"
        self.wheels = state / "wheels"
        self.conf = state / "containers.conf"
        self.facts: dict[str, object] = {}
        self.env = dict(os.environ, CONTAINERS_CONF=str(self.conf))

    def run(self, args: Sequence[str], timeout: float = 600.0, check: bool = True, quiet: bool = False,
            cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        if not quiet:
            log("$ " + " ".join(args))
        p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                           env=env or self.env, stdin=subprocess.DEVNULL)
        if check and p.returncode != 0:
            raise SmokeError(f"`{' '.join(args)}` exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
        return p

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
