"""docker-compose.yml, Dockerfile and .dockerignore keep the promises docs/deployment.md makes.

No Docker engine is needed: the compose file is read with PyYAML and checked for its security properties
(loopback-only ports, dashboard auth + JSON serializer, durable non-evicting Redis, graceful worker stops),
and every command a service runs is checked against this project: the console scripts exist, the flags are
ones the real CLIs (rq, rq-dashboard, sglang-sim) accept, and the worker class and settings import.
The file is also validated against the compose-spec JSON schema (tests/fixtures/compose-spec.json) where
jsonschema is installed. `docker compose config` also runs where a compose plugin is installed, and is skipped
elsewhere.
"""
from __future__ import annotations

import base64
import copy
import importlib
import importlib.metadata
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.compose_file import (
    COMPOSE,
    DEPLOYMENT_DOC,
    DOCKERFILE,
    ROOT,
    MissingVariable,
    argv,
    console_scripts,
    depends_on,
    dockerfile_instructions,
    dockerignore_excludes,
    duration_seconds,
    environment,
    executable,
    host_ip,
    import_target,
    interpolate,
    resolved_argv,
    setup_cfg,
)

yaml = pytest.importorskip("yaml")

#: The compose-spec JSON schema (Apache-2.0, tests/fixtures/LICENSE.compose-spec), as vendored by the
#: check-jsonschema package (check_jsonschema/builtin_schemas/vendor/compose-spec.json, 0.39.0).
COMPOSE_SCHEMA = ROOT / "tests" / "fixtures" / "compose-spec.json"

WORKER_ARGV = ["rq", "worker", "-w", "worker.Worker", "-c", "worker.settings"]
OUR_IMAGE_SERVICES = ("dashboard", "sim", "worker", "produce")
SECRETISH = re.compile(r"(?:^|_)(?:PASSWORD|PASSWD|PASS|SECRET|TOKEN|API_?KEY|CREDENTIALS?)(?:$|_)", re.I)
DUMMY_AUTH = {"RQ_DASHBOARD_USERNAME": "compose-test-user", "RQ_DASHBOARD_PASSWORD": "compose-test-password"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def all_strings(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from all_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from all_strings(v)
    elif node is not None:
        yield str(node)


# ------------------------------------------------------------------------------------- file layout

def test_compose_spec_file_without_version_key_and_with_both_ways_to_start(compose: dict[str, Any]) -> None:
    assert "version" not in compose, "the compose spec has no `version:` key (compose warns it is obsolete)"
    header = []
    for line in COMPOSE.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    header_text = "\n".join(header)
    assert "docker compose --profile gpu up -d --scale worker=4" in header_text
    assert "SGLANG_URL=http://sim:30000 docker compose --profile sim up -d" in header_text


def test_services_and_profiles(services: dict[str, dict[str, Any]]) -> None:
    assert set(services) == {"redis", "dashboard", "sglang", "router", "sim", "worker", "produce"}
    profiles = {name: s.get("profiles") for name, s in services.items()}
    assert profiles == {"redis": None, "dashboard": None, "worker": None, "sglang": ["gpu"], "router": ["router"],
                        "sim": ["sim"], "produce": ["tools"]}
    for name in OUR_IMAGE_SERVICES:
        assert services[name]["image"] == services["worker"]["image"], name
        assert services[name]["build"]["context"] == ".", name


# ---------------------------------------------------------------------------------------- security

def test_every_published_port_binds_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    published = 0
    for name, service in services.items():
        assert service.get("network_mode") != "host", f"{name}: host networking would expose every port"
        for port in service.get("ports") or []:
            published += 1
            assert host_ip(interpolate(port) if isinstance(port, str) else port) == "127.0.0.1", f"{name}: {port!r} must be published on 127.0.0.1 only"
    assert published >= 1  # the dashboard
    for name in ("redis", "sglang", "router", "sim", "worker", "produce"):
        assert not services[name].get("ports"), f"{name} is reached over the compose network, not published"


def test_no_secret_is_written_into_the_compose_file(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for key, value in environment(service).items():
            if SECRETISH.search(key):
                assert value == "" or re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*(:?[-?][^}]*)?\}", value), (
                    f"{name}: {key} must come from the environment, not be written here")
        args = argv(service.get("command")) + argv(service.get("entrypoint"))
        for flag in ("--password", "--requirepass", "--username", "--api-key"):
            for i, a in enumerate(args):
                if a == flag and i + 1 < len(args):
                    assert args[i + 1].startswith("$"), f"{name}: {flag} has a literal value"


def test_redis_is_durable_never_evicts_and_is_healthchecked(compose: dict[str, Any],
                                                            services: dict[str, dict[str, Any]]) -> None:
    redis = services["redis"]
    assert str(redis["image"]).startswith("redis:7")
    cmd = " ".join(argv(redis["command"]))
    assert "--appendonly yes" in cmd
    assert "--appendfsync everysec" in cmd
    assert "--maxmemory-policy noeviction" in cmd
    named = [v.split(":")[0] for v in redis["volumes"] if str(v).endswith(":/data")]
    assert named and named[0] in (compose.get("volumes") or {}), "Redis data lives in a named volume"
    # redis-cli exits 0 on an error reply (NOAUTH, LOADING): only a PONG means healthy
    assert argv(redis["healthcheck"]["test"]) == ["CMD-SHELL", "redis-cli ping | grep -q PONG"]


def test_dashboard_requires_basic_auth_and_uses_the_json_serializer(services: dict[str, dict[str, Any]]) -> None:
    dash = services["dashboard"]
    env = environment(dash)
    for var in ("RQ_DASHBOARD_USERNAME", "RQ_DASHBOARD_PASSWORD"):
        assert re.fullmatch(rf"\$\{{{var}:\?[^}}]+\}}", env.get(var, "")), (
            f"{var} must be `${{{var}:?message}}` so compose refuses to start without it")
        with pytest.raises(MissingVariable):
            interpolate(env[var], {})
    args = resolved_argv(dash["command"])
    assert args[:2] == ["produce", "dashboard"], "budgetq's dashboard: JSON on every page, the Workers page too"
    assert "--username" not in args and "--password" not in args, "credentials stay out of the command line"
    assert args[args.index("--redis-url") + 1] == "redis://redis:6379/0"
    assert args[args.index("--port") + 1] == "9181"
    assert args[args.index("--host") + 1] == "0.0.0.0"  # inside the container; published on loopback only
    assert [interpolate(p) for p in dash["ports"]] == ["127.0.0.1:9181:9181"]
    assert [interpolate(p, {"BUDGETQ_DASHBOARD_PORT": "19181"}) for p in dash["ports"]] == ["127.0.0.1:19181:9181"]
    assert depends_on(dash)["redis"]["condition"] == "service_healthy"


def test_dashboard_command_works_with_the_real_rq_dashboard(services: dict[str, dict[str, Any]], redis_url: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the compose command through produce's own CLI (the server loop stubbed out) and check what it built:
    rq-dashboard's app, basic auth from the RQ_DASHBOARD_* variables, JSON serializer, deletes disabled."""
    pytest.importorskip("rq_dashboard")
    import redis as redis_lib
    from click.testing import CliRunner
    from rq import Queue
    from rq.serializers import JSONSerializer

    import producer.ops.dashboard
    from producer.cli import main

    args = resolved_argv(services["dashboard"]["command"])
    args[args.index("--redis-url") + 1] = redis_url  # this session's own server instead of `redis`
    started: dict[str, Any] = {}

    def fake_serve(app: Any, host: str, port: int, on_ready: Any = None) -> None:
        started.update(app=app, host=host, port=port)

    monkeypatch.setattr(producer.ops.dashboard, "serve", fake_serve)
    result = CliRunner().invoke(main, args[1:], env=DUMMY_AUTH, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert (started["host"], started["port"]) == ("0.0.0.0", 9181)
    refused = CliRunner().invoke(main, args[1:], env={k: "" for k in DUMMY_AUTH})
    assert refused.exit_code == 2 and "RQ_DASHBOARD_USERNAME" in refused.output, "0.0.0.0 without auth"

    conn = redis_lib.Redis.from_url(redis_url)
    job = Queue("budgetq", connection=conn, serializer=JSONSerializer).enqueue("worker.rqworker.example", {"a": 1})
    client = started["app"].test_client()
    good = {"Authorization": "Basic " + base64.b64encode(
        f"{DUMMY_AUTH['RQ_DASHBOARD_USERNAME']}:{DUMMY_AUTH['RQ_DASHBOARD_PASSWORD']}".encode()).decode()}
    bad = {"Authorization": "Basic " + base64.b64encode(b"compose-test-user:wrong").decode()}
    assert client.get("/").status_code == 401
    assert client.get("/0/data/queues.json", headers=bad).status_code == 401
    assert client.post(f"/job/{job.id}/delete").status_code == 401
    queues = json.loads(client.get("/0/data/queues.json", headers=good).data)["queues"]
    assert {q["name"]: q["count"] for q in queues} == {"budgetq": 1}
    assert client.get(f"/0/data/job/{job.id}.json", headers=good).status_code == 200
    assert client.get(f"/0/view/job/{job.id}", headers=good).status_code == 200
    assert json.loads(client.post(f"/job/{job.id}/delete", headers=good).data) == {"status": "DISABLED"}
    assert conn.exists(f"rq:job:{job.id}")
    conn.close()


# ----------------------------------------------------------------------------------------- workers

def test_worker_service(services: dict[str, dict[str, Any]]) -> None:
    worker = services["worker"]
    assert argv(worker["command"]) == WORKER_ARGV
    assert not worker.get("entrypoint")
    env = environment(worker)
    assert interpolate(env["REDIS_URL"]) == "redis://redis:6379/0"
    assert env["SGLANG_URL"] == "${SGLANG_URL:-http://sglang:30000}"
    assert interpolate(env["SGLANG_URL"], {"SGLANG_URL": "http://sim:30000"}) == "http://sim:30000"
    assert interpolate(env["BUDGETQ_CONCURRENCY"]) == ""  # the automatic window
    assert interpolate(env["BUDGETQ_CONCURRENCY"], {"BUDGETQ_CONCURRENCY": "32"}) == "32"
    deps = depends_on(worker)
    assert deps["redis"]["condition"] == "service_healthy" and deps["redis"].get("required", True) is True
    for profiled in ("sglang", "sim"):
        assert deps[profiled] == {"condition": "service_healthy", "required": False}, profiled
    replicas = worker["deploy"]["replicas"]
    assert isinstance(replicas, int) and replicas >= 1
    assert duration_seconds(worker["stop_grace_period"]) >= 300, "a chunk can take minutes to finish"
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"
    assert worker["restart"] == "unless-stopped"
    assert not worker.get("container_name"), "a fixed container name would forbid --scale"


def test_every_variable_given_to_our_commands_is_one_they_read(services: dict[str, dict[str, Any]]) -> None:
    """A misspelled variable is not an error: a worker would fall back to its default (127.0.0.1) and retry
    forever. So each variable the compose file sets for the worker reaches a literal in worker/ (where the
    worker reads its environment), and each one set for produce is a click option's envvar or REDIS_URL."""
    import click

    from producer.cli import main
    worker_source = "\n".join(p.read_text() for p in (ROOT / "worker").glob("*.py"))
    for key in environment(services["worker"]):
        assert f'"{key}"' in worker_source, f"worker: {key} is set in docker-compose.yml but never read"
    produce_reads = set()
    assert isinstance(main, click.Group)
    for command in main.commands.values():
        for param in command.params:
            envvar = getattr(param, "envvar", None)
            produce_reads |= {envvar} if isinstance(envvar, str) else set(envvar or ())
    for key in environment(services["produce"]):
        assert key in produce_reads, f"produce: {key} is set in docker-compose.yml but no option reads it"


def test_worker_command_is_one_rq_accepts_and_its_classes_import() -> None:
    import rq.cli
    from rq.utils import import_attribute
    from rq.worker import BaseWorker

    worker_cmd = rq.cli.main.commands["worker"]
    ctx = worker_cmd.make_context("worker", WORKER_ARGV[2:])
    assert (ctx.params["worker_class"], ctx.params["config"]) == ("worker.Worker", "worker.settings")
    worker_cls = import_attribute("worker.Worker")  # as `rq worker -w` resolves it
    assert isinstance(worker_cls, type) and issubclass(worker_cls, BaseWorker)
    settings = importlib.import_module("worker.settings")
    assert isinstance(settings.REDIS_URL, str) and settings.QUEUES


# ------------------------------------------------------------------------------------ SGLang + sim

def test_sglang_service_serves_a_mounted_model_on_a_gpu(services: dict[str, dict[str, Any]]) -> None:
    sg = services["sglang"]
    assert str(sg["image"]).startswith("lmsysorg/sglang")
    script = interpolate(" ".join(argv(sg["command"])), {})
    assert "python3 -m sglang.launch_server" in script
    assert '--model-path "/models/${MODEL}"' in script
    assert "--host 0.0.0.0 --port 30000" in script
    assert interpolate(environment(sg)["MODEL"]) == "model"
    assert environment(sg).get("HF_HUB_OFFLINE") == "1"
    assert "${MODELS_DIR:-./models}:/models:ro" in sg["volumes"]
    assert sg.get("ipc") == "host" or sg.get("shm_size")
    devices = sg["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    health = sg["healthcheck"]
    assert "/health" in " ".join(argv(health["test"]))
    assert duration_seconds(health["start_period"]) >= 600, "loading a large model takes minutes"


def test_sglang_api_key_is_passed_only_when_set(services: dict[str, dict[str, Any]]) -> None:
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX shell")
    script = interpolate(argv(services["sglang"]["command"])[2], {})
    launcher = "exec python3 -m sglang.launch_server"
    assert script.startswith(launcher)
    probe = "set --" + script[len(launcher):] + '\nfor a in "$@"; do printf "[%s]\\n" "$a"; done'

    def run(env: dict[str, str]) -> list[str]:
        out = subprocess.run([sh, "-c", probe], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                             text=True, check=True).stdout
        return out.splitlines()

    base = ["[--model-path]", "[/models/m]", "[--host]", "[0.0.0.0]", "[--port]", "[30000]"]
    assert run({"MODEL": "m"}) == base
    assert run({"MODEL": "m", "SGLANG_API_KEY": "k3y"}) == base + ["[--api-key]", "[k3y]"]
    assert run({"MODEL": "m", "SGLANG_API_KEY": "a b*"}) == base + ["[--api-key]", "[a b*]"]
    assert run({"MODEL": "m", "SGLANG_EXTRA_ARGS": "--tp 2"}) == base + ["[--tp]", "[2]"]


def test_router_service_runs_sglangs_router_with_budgetqs_settings(services: dict[str, dict[str, Any]]) -> None:
    """The optional router (profile router): its command, as the shell gets it from compose, parses with the real
    sglang-router 0.3.2's own argument parser, with the settings docs/deployment.md asks for."""
    from sglang_router.launch_router import parse_router_args

    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX shell")
    router = services["router"]
    script = interpolate(argv(router["command"])[2], {})
    launcher = "exec python3 -m sglang_router.launch_router"
    assert script.startswith(launcher)
    probe = "set --" + script[len(launcher):] + '\nfor a in "$@"; do printf "%s\\n" "$a"; done'
    env = {k: interpolate(v, {"ROUTER_WORKER_URLS": "http://sglang-a:30000 http://sglang-b:30000"})
           for k, v in environment(router).items()}
    env["ROUTER_WORKER_URLS"] = "http://sglang-a:30000 http://sglang-b:30000"
    args = subprocess.run([sh, "-c", probe], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True,
                          check=True).stdout.splitlines()
    parsed = parse_router_args(args)
    assert parsed.worker_urls == ["http://sglang-a:30000", "http://sglang-b:30000"]
    assert parsed.policy == "cache_aware" and parsed.port == 30000
    assert parsed.request_timeout_secs == 3600 > 120 + 16384 / 5  # the workers' deadline for a 16K answer
    assert parsed.disable_retries
    assert parsed.prometheus_host == "127.0.0.1"
    assert router["volumes"] == services["sglang"]["volumes"]  # the tokenizers at the servers' model_path
    assert "/readiness" in " ".join(argv(router["healthcheck"]["test"]))
    assert depends_on(services["worker"])["router"] == {"condition": "service_healthy", "required": False}


def test_sim_service_runs_our_simulator(services: dict[str, dict[str, Any]]) -> None:
    from sglang_sim.config import from_argv

    sim = services["sim"]
    args = resolved_argv(sim["command"])
    assert args[:5] == ["sglang-sim", "--host", "0.0.0.0", "--port", "30000"]
    cfg = from_argv(args[1:])
    assert (cfg.host, cfg.port, cfg.time_scale, cfg.mean_tokens) == ("0.0.0.0", 30000, 1.0, 300.0)
    assert "/health" in " ".join(argv(sim["healthcheck"]["test"]))


def test_produce_tool_mounts_data_tokenizer_and_out(services: dict[str, dict[str, Any]]) -> None:
    produce = services["produce"]
    assert argv(produce["entrypoint"]) == ["produce"]
    work = produce["working_dir"]
    targets = {interpolate(str(v)).split(":")[1]: interpolate(str(v)) for v in produce["volumes"]}
    assert set(targets) == {f"{work}/data", f"{work}/tokenizer", f"{work}/out"}
    assert targets[f"{work}/data"].endswith(":ro") and targets[f"{work}/tokenizer"].endswith(":ro")
    assert not targets[f"{work}/out"].endswith(":ro")
    env = environment(produce)
    assert env["BUDGETQ_TOKENIZER"] == f"{work}/tokenizer"
    assert interpolate(env["REDIS_URL"]) == "redis://redis:6379/0"


# ----------------------------------------------------------------------- commands exist in this project

def test_every_command_of_our_image_exists(services: dict[str, dict[str, Any]]) -> None:
    scripts = console_scripts()
    for name in ("produce", "sglang-sim"):
        assert callable(import_target(scripts[name])), name
    install_requires = setup_cfg().get("options", "install_requires")
    from_pip = {
        "rq": "rq",  # install_requires
        "rq-dashboard": "rq-dashboard",  # installed by the Dockerfile
    }
    assert re.search(r"^\s*rq\b", install_requires, re.M)
    pip_line = " ".join(args for word, args in dockerfile_instructions() if word == "RUN" and "pip install" in args)
    assert "rq-dashboard" in pip_line and re.search(r"\bsix\b", pip_line)
    for service in OUR_IMAGE_SERVICES:
        exe = executable(services[service])
        assert exe in scripts or exe in from_pip, f"{service}: {exe!r} is no console script of the image"
        if exe in from_pip:
            try:
                dist = importlib.metadata.distribution(from_pip[exe])
            except importlib.metadata.PackageNotFoundError:
                continue  # rq-dashboard is installed in the image, not necessarily here
            assert exe in {e.name for e in dist.entry_points if e.group == "console_scripts"}


# -------------------------------------------------------------------------- Dockerfile, .dockerignore

def test_dockerfile_small_non_root_offline_and_without_secrets() -> None:
    instructions = dockerfile_instructions()
    froms = [args for word, args in instructions if word == "FROM"]
    assert froms == ["python:3.11-slim"]
    users = [args for word, args in instructions if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image runs as a non-root user"
    pip = " ".join(args for word, args in instructions if word == "RUN" and "pip install" in args)
    assert re.search(r"pip install (?:\$\{?\w+\}?\s+)*(/src|\.|/tmp/budgetq-src)\s", pip), "the project is installed"
    for mount in re.findall(r"--mount=(\S+)", pip):
        # podman/buildah write a read-write bind mount's changes into the build context (a build/ folder
        # appeared there); BuildKit throws them away. bench/compose_smoke.py checks the context after a build.
        assert "rw" not in mount.split(",") and "readwrite" not in mount, f"--mount={mount}: read-only, then copy"
    for word, args in instructions:
        if word in ("ENV", "ARG"):
            names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or [args.split()[0]]
            assert not any(SECRETISH.search(n) for n in names), f"{word} {args}: no secrets in the image"
    text = DOCKERFILE.read_text()
    assert "HF_HUB_OFFLINE=1" in text
    for download in ("huggingface-cli", "snapshot_download", "hf_hub_download", "from_pretrained", "hf download"):
        assert download not in text


def test_dockerignore_sends_only_the_source() -> None:
    for secret_or_data in (".env", ".env.prod", "worker/.env", ".git/config", "models/m/model.safetensors",
                           "data/B1.jsonl", "out/B1/raw_responses.jsonl", "tokenizer/tokenizer.json",
                           "appendonlydir/a.aof", "tests/unit/test_compose.py", "worker/__pycache__/x.pyc"):
        assert dockerignore_excludes(secret_or_data), secret_or_data
    cfg = setup_cfg()
    packages = [p.strip() for p in cfg.get("options.packages.find", "include").split() if "." not in p]
    assert packages
    for needed in ["setup.cfg", "pyproject.toml", *(f"{p}/__init__.py" for p in packages)]:
        if (ROOT / needed).exists():
            assert not dockerignore_excludes(needed), f"{needed} must reach the build"
    for data_file in sorted((ROOT / "demo" / "data").glob("*.jsonl")):
        assert not dockerignore_excludes(str(data_file.relative_to(ROOT))), "package_data reaches the build"


# ------------------------------------------------------------------------------- compose-spec schema

def _schema_errors(document: Any) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(COMPOSE_SCHEMA.read_text(encoding="utf-8"))
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    errors = validator_cls(schema).iter_errors(document)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors)


def test_compose_file_validates_against_the_compose_spec_schema(compose: dict[str, Any]) -> None:
    """What `docker compose config` checks first, without Docker: every key is one the compose spec knows,
    with a value of the right shape (`depends_on: required`, `deploy.resources`, `x-` extensions, ...)."""
    errors = _schema_errors(compose)
    assert not errors, "docker-compose.yml does not follow the compose spec:\n  " + "\n  ".join(errors)


def test_the_compose_schema_catches_typos_and_bad_values(compose: dict[str, Any]) -> None:
    """The schema check has teeth: a misspelt key and an unknown depends_on condition are both reported."""
    broken = copy.deepcopy(compose)
    broken["services"]["worker"]["stop_grace_periode"] = "10m"
    broken["services"]["dashboard"]["depends_on"]["redis"]["condition"] = "service_ready"
    errors = "\n".join(_schema_errors(broken))
    assert "services/worker:" in errors and "stop_grace_periode" in errors
    assert "services/dashboard/depends_on:" in errors


# ----------------------------------------------------------------------------------------- docs

def test_deployment_doc_covers_the_operations() -> None:
    doc = DEPLOYMENT_DOC.read_text()
    for needle in ("--profile gpu", "--profile sim", "--scale worker=", "rediss://", "SIGTERM",
                   "stop_grace_period", "127.0.0.1:9181", "raw_responses.jsonl"):
        assert needle in doc, needle


# ------------------------------------------------------------------------------- docker compose config

def _compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def test_docker_compose_config_validates(tmp_path: Path) -> None:
    if not _compose_available():
        pytest.skip("`docker compose version` does not work here (no compose plugin)")
    import os

    base = {k: v for k, v in os.environ.items() if k not in DUMMY_AUTH}
    cmd = ["docker", "compose", "-f", str(COMPOSE), "--project-directory", str(ROOT),
           "--profile", "gpu", "--profile", "sim", "--profile", "tools", "config", "-q"]
    ok = subprocess.run(cmd, env={**base, **DUMMY_AUTH}, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "RQ_DASHBOARD" in refused.stderr, "must refuse to run without auth"
