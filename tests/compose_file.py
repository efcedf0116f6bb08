"""docker-compose.yml, the Dockerfile and .dockerignore read as their tools read them: compose's variable
substitution, command lines, durations, environment and depends_on forms; Dockerfile instructions; the
.dockerignore rule; and the console scripts setup.cfg declares."""
from __future__ import annotations

import configparser
import importlib
import re
import shlex
from pathlib import Path
from typing import Any, Mapping

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
SETUP_CFG = ROOT / "setup.cfg"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


class MissingVariable(Exception):
    pass


def interpolate(value: str, env: Mapping[str, str] | None = None) -> str:
    """Compose's variable substitution (the subset this file uses), against `env` (default: empty)."""
    env = env or {}

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        val = env.get(name)
        unset_or_empty = not val
        if op == ":-":
            return arg if unset_or_empty else str(val)
        if op == "-":
            return arg if val is None else val
        if op in (":?", "?"):
            if (unset_or_empty if op == ":?" else val is None):
                raise MissingVariable(f"{name}: {arg}")
            return str(val)
        if op == ":+":
            return "" if unset_or_empty else arg
        if op == "+":
            return "" if val is None else arg
        return val or ""

    return _VAR.sub(sub, value)


def argv(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    return [str(v) for v in value]


def resolved_argv(value: Any, env: Mapping[str, str] | None = None) -> list[str]:
    return [interpolate(a, env) for a in argv(value)]


def duration_seconds(value: Any) -> float:
    """A compose duration ("10m", "1m30s", "90s", "1h") in seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", str(value))
    assert parts and "".join(n + u for n, u in parts) == str(value), f"not a duration: {value!r}"
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def depends_on(service: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: {"condition": "service_started"} for d in deps}
    return {k: dict(v or {}) for k, v in deps.items()}


def executable(service: Mapping[str, Any]) -> str:
    entry = argv(service.get("entrypoint"))
    return entry[0] if entry else argv(service.get("command"))[0]


def host_ip(port: Any) -> str | None:
    """The host address a `ports` entry publishes on; None means every address (0.0.0.0 and ::)."""
    if isinstance(port, dict):
        return port.get("host_ip")
    spec = str(port).split("/")[0]
    if spec.startswith("["):
        return spec[1:spec.index("]")]
    parts = spec.split(":")
    return parts[0] if len(parts) == 3 else None


def setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(SETUP_CFG)
    return cfg


def console_scripts() -> dict[str, str]:
    raw = setup_cfg().get("options.entry_points", "console_scripts")
    pairs = (line.split("=", 1) for line in raw.strip().splitlines() if line.strip())
    return {name.strip(): target.strip() for name, target in pairs}


def import_target(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerignore_excludes(path: str) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parents decides."""
    def to_regex(pattern: str) -> re.Pattern[str]:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + r"\Z")

    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        pattern = pattern.strip("/")
        rx = to_regex(pattern)
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded
