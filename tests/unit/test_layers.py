"""The one-way flow of docs/architecture.md, checked on the source: producer/ and worker/ import budget/ and
render/, never each other; budget/ and render/ import neither; none of them, nor the simulator, imports the
tooling (demo/, which holds the dev stack demo/stack.py that tests, bench and the demo share; bench/; tests/);
demo/ imports neither bench/ nor tests/, so the dev stack stays below both; no test imports bench/. No module
of render/ or worker/ imports transformers at module level (a worker that never renders must never load it:
tests/redis/test_render_shared.py runs one and looks). In tests/, no module imports a test module: what tests share
lives in support modules (procs.py, demo_data.py, chats.py, chaos/...) or conftest.py fixtures, so a test module
can be read, run and changed alone."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The tooling around the product: the demo with the dev stack, the benchmarks, the tests.
TOOLING = {"demo", "bench", "tests"}
#: package -> the top-level packages of this repository it must not import.
FORBIDDEN = {"producer": {"worker", *TOOLING}, "worker": {"producer", *TOOLING},
             "budget": {"producer", "worker", "render", *TOOLING}, "render": {"producer", "worker", "budget", *TOOLING},
             "sglang_sim": TOOLING, "demo": {"bench", "tests"},
             # bench/ is for measurements: what a test runs (the chaos scenarios, the dev stack) lives below it.
             "tests": {"bench"}}
NO_TOP_LEVEL_TRANSFORMERS = ("render", "worker")


def _imports(tree: ast.Module, top_level_only: bool) -> list[tuple[int, str]]:
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def test_packages_import_one_way() -> None:
    found = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            for line, name in _imports(tree, top_level_only=False):
                if name.split(".")[0] in forbidden:
                    found.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
    assert not found, "\n".join(found)


def test_transformers_is_imported_only_inside_functions() -> None:
    found = []
    for package in NO_TOP_LEVEL_TRANSFORMERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            found += [f"{path.relative_to(ROOT)}:{line}: imports {name} at module level"
                      for line, name in _imports(tree, top_level_only=True) if name.split(".")[0] == "transformers"]
    assert not found, "\n".join(found)


def test_no_module_of_tests_imports_a_test_module() -> None:
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module == "tests":
                names = [f"tests.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom):  # relative: from .test_x import y, from . import test_x
                names = [f"tests.{node.module}"] if node.module else [f"tests.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}" for name in names
                      if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")]
    assert not found, "\n".join(found)


def _import_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, from every import statement in it: module level, inside
    functions and under TYPE_CHECKING alike (a cycle through any of them is still a cycle to read through)."""
    mods: dict[str, Path] = {}
    for pkg in packages:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_not_even_under_type_checking() -> None:
    graph = _import_graph(("budget", "render", "producer", "worker", "sglang_sim"))
    assert {"budget.ledger", "producer.cli", "worker.dispatch", "render.chat", "sglang_sim.server"} <= set(graph)
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_produce_command_loads_no_template_engine_until_it_renders() -> None:
    """``produce --help``, ``status`` and the other commands import producer/cli.py; jinja2 (render/chat.py) and
    transformers load only once a prompt is rendered, so they stay quick to start."""
    import subprocess
    import sys

    code = "import sys, producer.cli; print(sorted({m.split('.')[0] for m in sys.modules} & {'jinja2', 'transformers'}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
