"""`make compose-smoke`: docker-compose.yml's sim profile started for real, with containers, then torn down.

tests/unit/test_compose.py reads the compose file and tests/e2e/test_compose_run.py runs its services as host processes,
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

from bench.podman_setup import TAG, Podman, SmokeError, log

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "deployment.md"
PROJECT = "budgetq-smoke"
LABEL = f"io.podman.compose.project={PROJECT}"
UP_MARKER = "<!-- compose-run: sim up -->"
RUN_MARKER = "<!-- compose-run: sim produce -->"
HEALTH_TIMEOUT_S = 180.0
PRODUCE_TIMEOUT_S = 900.0


class Smoke(Podman):
    """One run: its state folder (venv, wheelhouse, config), its project folder, and its timings."""

    def __init__(self, state: Path, dashboard_port: int) -> None:
        super().__init__(state)
        self.dashboard_port = dashboard_port
        self.timings: dict[str, float] = {}
        self.warnings: list[str] = []  # seen, reported, not failed (a podman quirk, not the stack's)
        self.project = Path(tempfile.mkdtemp(prefix="run-", dir=state))
        self.env_file = self.project / "smoke.env"
        self.user = "smoke-" + secrets.token_hex(4)
        self.password = secrets.token_urlsafe(18)
        # The shell's variables win over the env file in compose: none of the host's may leak in.
        for name in ("BUDGETQ_REDIS_URL", "SGLANG_URL", "SGLANG_API_KEY", "DATA_DIR", "TOKENIZER_DIR", "OUT_DIR",
                     "BUDGETQ_TAG", "BUDGETQ_DASHBOARD_PORT", "RQ_DASHBOARD_USERNAME", "RQ_DASHBOARD_PASSWORD",
                     "COMPOSE_PROJECT_NAME", "COMPOSE_FILE"):
            self.env.pop(name, None)

    # ------------------------------------------------------------------------------------------ helpers

    def step(self, name: str) -> "_Step":
        return _Step(self, name)

    def compose_cmd(self) -> list[str]:
        return [str(self.venv / "bin" / "podman-compose"), "-p", PROJECT, "--env-file", str(self.env_file)]

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
        from producer.inputs.reader import parse_dataset_arg

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
        """Dependents first, one SIGTERM each (the compose stop_signal), timed. An idle worker exits 0 at once;
        a slow one is reported, not failed: every slow stop seen here was the worker waiting 40 s on the
        compose network's DNS (aardvark-dns 1.4) to reach Redis once more, then killed at podman's 60 s (and,
        a podman 4.3 race, restarted by `restart: unless-stopped` meanwhile). docs/deployment.md says more."""
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
                    warning = f"{name}: exit {code} after {seconds:.1f}s on SIGTERM (want 0, quickly)"
                    log("WARNING: " + warning)
                    self.warnings.append(warning)
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
              "warnings": smoke.warnings,
              "project": str(smoke.project) if smoke.project.exists() else None}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
