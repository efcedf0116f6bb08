"""Every command, option and environment variable has help and is in docs/cli.md (after sqlite-utils' test_docs.py).

Fast and offline: click's and argparse's own metadata are read, commands are run only with ``--help``, and the
documented examples are parsed with the commands' callbacks stubbed out, so nothing touches Redis or a tokenizer.
Each test collects every problem before failing, so one run lists everything that is missing.
"""
from __future__ import annotations

import ast
import functools
import json
import os
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import click
import pytest
from click.testing import CliRunner

from producer.cli import main
from sglang_sim.config import build_parser

ROOT = Path(__file__).resolve().parents[2]
CLI_DOC = ROOT / "docs" / "cli.md"
#: Files whose string constants name the environment variables they read, and the docs/cli.md section that must
#: mention each of them.
ENV_SOURCES = {
    "worker/config.py": "The worker (`rq worker`)",
    "worker/settings.py": "The worker (`rq worker`)",
    "producer/cli.py": "Read by `produce`",
}
ENV_NAME = re.compile(r"(?:BUDGETQ|SGLANG|REDIS)_[A-Z0-9_]+")
SIM_SECTION = "`sglang-sim`"


def commands() -> dict[str, click.Command]:
    return dict(main.commands)


def section_of(command: str) -> str:
    """The docs/cli.md heading of a produce command ("" is the group itself)."""
    return f"`produce {command}`" if command else "`produce`"


@lru_cache(maxsize=None)
def doc() -> str:
    return CLI_DOC.read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def sections() -> dict[str, str]:
    """Heading text -> the text under it, down to the next heading of the same or a higher level."""
    lines = doc().splitlines()
    heads = [(i, len(m.group(1)), m.group(2).strip()) for i, line in enumerate(lines)
             if (m := re.match(r"(#{1,6}) (.+)$", line))]
    out: dict[str, str] = {}
    for n, (start, level, title) in enumerate(heads):
        end = next((i for i, lv, _ in heads[n + 1:] if lv <= level), len(lines))
        out[title] = "\n".join(lines[start + 1:end])
    return out


def mentions(text: str, name: str) -> bool:
    """`name` appears in `text` as a whole word (`--out` is not found in `--out-dir`, `NAME` not in `NAMES`)."""
    return re.search(r"(?<![\w-])" + re.escape(name) + r"(?![\w-])", text) is not None


def long_names(param: click.Parameter) -> list[str]:
    return [o for o in (*param.opts, *param.secondary_opts) if o.startswith("--")]


def shown_envvars(param: click.Parameter) -> list[str]:
    if not isinstance(param, click.Option) or not param.show_envvar or not param.envvar:
        return []
    return [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)


def all_params() -> Iterator[tuple[str, click.Parameter]]:
    """(command name, parameter) for the group ("") and every command."""
    for p in main.params:
        yield "", p
    for name, cmd in commands().items():
        for p in cmd.params:
            yield name, p


def label(command: str, name: str) -> str:
    return " ".join(x for x in ("produce", command, name) if x)


def test_the_doc_has_a_section_per_command() -> None:
    missing = [section_of(c) for c in ("", *commands()) if section_of(c) not in sections()]
    assert not missing, f"docs/cli.md has no '## <command>' section for: {', '.join(missing)}"


def test_commands_have_help_with_an_example() -> None:
    problems = []
    for name, cmd in {"": main, **commands()}.items():
        help_text = cmd.help or ""
        if not help_text.strip():
            problems.append(f"{label(name, '')}: no help")
        elif "Example" not in help_text:
            problems.append(f"{label(name, '')}: help has no 'Example' section")
    assert not problems, "commands without help or a runnable example:\n  " + "\n  ".join(problems)


def test_options_have_help() -> None:
    missing = [label(c, p.opts[0]) for c, p in all_params()
               if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert not missing, f"options without help text: {', '.join(missing)}"


def test_arguments_are_explained() -> None:
    """Click arguments take no help of their own: the command's help or its docs section must name them."""
    missing = []
    for name, cmd in commands().items():
        text = (cmd.help or "") + "\n" + sections().get(section_of(name), "")
        missing += [label(name, p.human_readable_name) for p in cmd.params
                    if isinstance(p, click.Argument) and not mentions(text, p.human_readable_name)]
    assert not missing, f"arguments named neither in their command's help nor in its docs/cli.md section: " \
                        f"{', '.join(missing)}"


def test_commands_are_documented() -> None:
    missing = [n for n in commands() if not mentions(doc(), f"produce {n}")]
    assert not missing, f"commands missing from docs/cli.md: {', '.join(missing)}"


def test_options_are_documented_in_their_command_section() -> None:
    missing = []
    for command, p in all_params():
        text = sections().get(section_of(command), "")
        missing += [label(command, o) for o in long_names(p) if not mentions(text, o)]
    assert not missing, f"options missing from their section of docs/cli.md: {', '.join(missing)}"


def test_documented_options_exist() -> None:
    """The reverse: an option in a command's docs table that the command does not have is stale."""
    stale = []
    for command in ("", *commands()):
        cmd = main if not command else commands()[command]
        real = {o for p in cmd.params for o in long_names(p)} | {"--help"}
        for row in re.findall(r"^\| ([^|]*`--[^|]*)\|", sections().get(section_of(command), ""), re.M):
            stale += [label(command, o) for o in re.findall(r"`(--[\w-]+)", row) if o not in real]
    assert not stale, f"docs/cli.md documents options that do not exist: {', '.join(stale)}"


def test_envvars_shown_by_click_are_documented() -> None:
    missing = sorted({e for _, p in all_params() for e in shown_envvars(p) if not mentions(doc(), e)})
    assert not missing, f"environment variables shown in --help but missing from docs/cli.md: {', '.join(missing)}"


def env_names(path: Path) -> set[str]:
    """Every string constant in a module that is an environment variable name of the project."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and ENV_NAME.fullmatch(n.value)}


def test_environment_variables_read_by_the_code_are_documented() -> None:
    found: dict[str, set[str]] = {src: env_names(ROOT / src) for src in ENV_SOURCES}
    # Guard against a parser that finds nothing and so checks nothing.
    assert {"SGLANG_URL", "SGLANG_API_KEY", "BUDGETQ_CONCURRENCY"} <= found["worker/config.py"]
    assert "REDIS_URL" in found["worker/settings.py"]
    missing = []
    for src, names in found.items():
        heading = ENV_SOURCES[src]
        text = sections().get(heading, "")
        missing += [f"{n} (read in {src}; expected under '{heading}')" for n in sorted(names) if not mentions(text, n)]
    assert not missing, "environment variables missing from docs/cli.md:\n  " + "\n  ".join(missing)


def test_sglang_sim_options_are_documented() -> None:
    parser = build_parser()
    names = [o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert "--time-scale" in names
    text = sections().get(SIM_SECTION, "")
    missing = [n for n in names if not mentions(text, n)]
    assert not missing, f"sglang-sim options missing from the {SIM_SECTION} section of docs/cli.md: " \
                        f"{', '.join(missing)}"
    stale = [o for o in re.findall(r"^\| `(--[\w-]+)", text, re.M) if o not in names]
    assert not stale, f"docs/cli.md documents sglang-sim options that do not exist: {', '.join(stale)}"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No BUDGETQ_*/REDIS_URL of the developer's shell may change what the commands parse."""
    for key in list(os.environ):
        if key.startswith("BUDGETQ_") or key == "REDIS_URL":
            monkeypatch.delenv(key)


def test_help_runs(clean_env: None) -> None:
    failures = []
    for args in (["--help"], ["--version"], *([n, "--help"] for n in commands())):
        result = CliRunner().invoke(main, args, prog_name="produce")
        if result.exit_code != 0 or not result.output.strip():
            failures.append(f"produce {' '.join(args)}: exit {result.exit_code}: {result.output.strip()[:300]}")
    assert not failures, "help failed:\n  " + "\n  ".join(failures)


def produce_lines(text: str) -> list[list[str]]:
    """The argument lists of the `produce ...` command lines in shell text (continuations joined, comments,
    leading VAR=value assignments and a trailing & dropped)."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words.pop(0)
        while words and words[-1] == "&":
            words.pop()
        if words and words[0] == "produce":
            out.append(words[1:])
    return out


def documented_examples() -> list[tuple[str, list[str]]]:
    found = [("docs/cli.md", args) for block in re.findall(r"^```(?:sh|bash|console)\n(.*?)^```", doc(), re.M | re.S)
             for args in produce_lines(block)]
    for name, cmd in {"": main, **commands()}.items():
        help_text = (cmd.help or "").partition("Example")[2]
        found += [(f"{label(name, '--help')}", args) for args in produce_lines(help_text)]
    return found


def test_documented_examples_parse(clean_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `produce ...` line in docs/cli.md's shell blocks and in the help examples is a valid command line:
    parsed by the real group (the default command included) with the commands' bodies replaced by no-ops."""
    def noop(**_: Any) -> None:
        return None

    for cmd in commands().values():
        monkeypatch.setattr(cmd, "callback", noop)
    examples = documented_examples()
    assert len(examples) >= len(commands()), "found too few examples: is the docs' ```sh fence still there?"
    failures = []
    for where, args in examples:
        result = CliRunner().invoke(main, args, prog_name="produce")
        if result.exit_code != 0:
            failures.append(f"{where}: produce {shlex.join(args)}\n    -> exit {result.exit_code}: "
                            f"{result.output.strip()[-300:]}")
    assert not failures, "documented examples that do not parse:\n  " + "\n  ".join(failures)


MAPPED_PACKAGES = ("budget", "render", "producer", "worker", "sglang_sim")


def test_the_module_map_lists_every_module_and_only_those() -> None:
    """docs/architecture.md's module map is a newcomer's way in: it must match the tree, both ways."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1].replace("\\_", "_") for line in table.splitlines() if line.startswith("| ")]
    mapped = {name.strip() for row in rows for name in row.split(",") if name.strip().endswith(".py")}
    modules = {str(f.relative_to(ROOT)) for p in MAPPED_PACKAGES for f in (ROOT / p).rglob("*.py")
               if f.name != "__init__.py"}
    assert sorted(modules - mapped) == [], "modules missing from docs/architecture.md's module map"
    assert sorted(mapped - modules) == [], "the module map names modules that do not exist"


#: What ``python -m bench.walk`` measured: line -> stage -> module -> the functions that ran (read, not imported).
WALK = ROOT / "bench" / "results" / "walk.json"


def code_maps() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return text.split("## Code maps", 1)[1].split("\n## ", 1)[0]


def test_the_code_maps_name_every_module_on_a_samples_walk() -> None:
    """Each hop of the walk from a dataset line to an exported row (bench/results/walk.json) is named in
    docs/architecture.md's code maps by its path, and is a module of the tree: a fold or a rename makes the walk
    be measured again and the maps follow it."""
    walks = json.loads(WALK.read_text(encoding="utf-8"))["walks"]
    modules = {m for walk in walks.values() for stage in walk.values() for m in stage}
    paths = {m: m.replace(".", "/") + ".py" for m in modules}
    assert sorted(m for m, p in paths.items() if not (ROOT / p).is_file()) == [], \
        "bench/results/walk.json names modules the tree no longer has: run python -m bench.walk again"
    maps = code_maps()
    missing = sorted(p for p in paths.values() if not re.search(r"(?<![\w/])" + re.escape(p), maps))
    assert missing == [], "modules on the walk that docs/architecture.md's code maps do not name"


def test_the_walk_counts_in_the_architecture_doc_are_walk_json_s() -> None:
    """The module counts docs/architecture.md gives for the walk are those of bench/results/walk.json (as
    ``python -m bench.walk`` counts them: producer/, worker/, budget/; and without the modules only the stage
    ``produce`` ran), so a fold that is measured again shows in the doc too."""
    walks = json.loads(WALK.read_text(encoding="utf-8"))["walks"]
    counts = []
    for name in ("one turn", "conversation"):
        stages = walks[name]
        modules = {m for stage in stages.values() for m in stage if m.split(".")[0] in ("producer", "worker", "budget")}
        elsewhere = {m for s, stage in stages.items() if s != "produce" for m in stage}
        counts.append((len(modules), len(modules & elsewhere)))
    (one, one_core), (conv, conv_core) = counts
    text = " ".join((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split())
    said = re.search(r"At walk\.json's commit: (\d+) modules .*? for a one-turn line, (\d+) for a conversation "
                     r"\((\d+) and (\d+) without", text)
    assert said is not None, "docs/architecture.md no longer states the walk's counts"
    assert tuple(map(int, said.groups())) == (one, conv, one_core, conv_core)


DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def test_bench_results_hold_only_what_the_docs_cite() -> None:
    """bench/results keeps the measurements a figure of the docs rests on, nothing else: each entry (a file, or a
    folder of one comparison's runs) is named in docs/ or the README, or is what a command the docs give writes
    by default (``python -m bench.NAME``: NAME.json, and its console output NAME.log), or the NAME.log of a cited
    NAME.json. A new measurement is cited where its figure is given, or not committed."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in DOCS)
    entries = list((ROOT / "bench" / "results").iterdir())
    cited = {e.name for e in entries if e.name in text
             or (e.suffix in (".json", ".log") and re.search(rf"python -m bench\.{re.escape(e.stem)}\b", text))}
    uncited = sorted(e.name for e in entries if e.name not in cited
                     and not (e.suffix == ".log" and e.with_suffix(".json").name in cited))
    assert uncited == [], "bench/results entries that no doc cites: cite them where their figure is, or delete them"


#: A test file named in the docs: ``tests/test_x.py`` (a path from the root) or ``test_x.py`` (found anywhere under
#: tests/), optionally with ``::name`` (a test function or class) and ``::name`` (a method of that class).
TEST_REF = re.compile(r"(?<![\w/.-])(tests/(?:[\w-]+/)*)?(test_\w+)\.py(?:::(\w+))?(?:::(\w+))?")


def files_named(ref: str, name: str) -> list[Path]:
    """The test files a reference can mean: its path when written from the root, else every file of that name."""
    if ref:
        return [p for p in [ROOT / ref / f"{name}.py"] if p.is_file()]
    return sorted((ROOT / "tests").rglob(f"{name}.py"))


def defined_names(path: Path) -> set[str]:
    """Functions and classes of a test module, and ``Class::method`` for methods."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, ast.ClassDef):
            out |= {f"{node.name}::{m.name}" for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def test_tests_named_in_the_docs_exist() -> None:
    """Every ``tests/test_*.py`` a doc names is a file, and every ``tests/test_x.py::test_name`` a test in it: a
    doc that sends a reader to a test that was renamed or moved is stale."""
    stale, checked = [], 0
    for doc_path in DOCS:
        for number, line in enumerate(doc_path.read_text(encoding="utf-8").splitlines(), 1):
            for m in TEST_REF.finditer(line):
                checked += 1
                where = f"{doc_path.relative_to(ROOT)}:{number}: {m.group(0)}"
                files = files_named(m.group(1) or "", m.group(2))
                if not files:
                    stale.append(f"{where}: no such test file")
                    continue
                name = "::".join(g for g in (m.group(3), m.group(4)) if g)
                if name and not any(name in defined_names(f) for f in files):
                    stale.append(f"{where}: no test {name} in {', '.join(str(f.relative_to(ROOT)) for f in files)}")
    assert checked > 20, "found too few test references: is TEST_REF still right?"
    assert not stale, "the docs name tests that do not exist:\n  " + "\n  ".join(stale)


def test_the_test_reference_check_catches_what_it_is_for() -> None:
    found = [(m.group(1), m.group(2), m.group(3)) for m in TEST_REF.finditer(
        "tests/redis/test_ledger.py::test_x, `test_e2e.py`, tests/e2e/test_y.py, not bench/test_z.py or mytest_q.py")]
    assert found == [("tests/redis/", "test_ledger", "test_x"), (None, "test_e2e", None), ("tests/e2e/", "test_y", None)]
    assert "test_commit_counts_once_under_racing_threads" in defined_names(ROOT / "tests" / "redis" / "test_ledger.py")


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (lowercased, punctuation dropped, spaces to hyphens,
    ``-1``, ``-2``... for repeats); fenced code is skipped."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)$", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_links_to_a_heading_of_a_doc_resolve() -> None:
    """A link ``[..](other.md#anchor)`` or ``[..](#anchor)`` in the docs or the README lands on a heading: moving a
    section (to docs/decisions.md, say) must take its links along."""
    broken, checked = [], 0
    for doc_path in DOCS:
        for number, line in enumerate(doc_path.read_text(encoding="utf-8").splitlines(), 1):
            for target, anchor in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", line):
                path = (doc_path.parent / target).resolve() if target else doc_path
                if path.suffix != ".md":
                    continue
                checked += 1
                if not path.is_file() or anchor not in heading_anchors(path):
                    broken.append(f"{doc_path.relative_to(ROOT)}:{number}: {target}#{anchor}")
    assert checked > 20, "found too few links to headings: is the pattern still right?"
    assert not broken, "links to headings that do not exist:\n  " + "\n  ".join(broken)


def doc_lines(doc_path: Path) -> Iterator[tuple[int, str]]:
    """The numbered lines of a doc outside fenced code."""
    fenced = False
    for number, line in enumerate(doc_path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def test_relative_links_to_files_resolve() -> None:
    """A link ``[..](path)`` (not a URL, not only an anchor) in the docs or the README names a file or folder of
    the repository, relative to the doc (issue 29)."""
    broken, checked = [], 0
    for doc_path in DOCS:
        for number, line in doc_lines(doc_path):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue
                checked += 1
                if not (doc_path.parent / target.partition("#")[0]).exists():
                    broken.append(f"{doc_path.relative_to(ROOT)}:{number}: {target}")
    assert checked > 50, "found too few links to files: is the pattern still right?"
    assert not broken, "links to files that are not in the repository:\n  " + "\n  ".join(broken)


def test_docs_named_in_the_docs_exist() -> None:
    """A Markdown file a doc names as a path (``reference/x.md``, linked or not) is in the repository, relative to
    the doc or to its root: docs/simulator.md once named a reference outside it (issue 29)."""
    missing = []
    for doc_path in DOCS:
        for number, line in doc_lines(doc_path):
            for name in re.findall(r"(?<![\w/.:-])((?:\.{0,2}[\w-]*/)+[\w.-]+\.md)\b", line):
                if not ((doc_path.parent / name).is_file() or (ROOT / name).is_file()):
                    missing.append(f"{doc_path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "Markdown files named but not in the repository:\n  " + "\n  ".join(missing)


def documented_keys() -> set[str]:
    """The keys in the first column of budget/keys.py's key table (its docstring), the one key table of budgetq."""
    from budget import keys
    return set(re.findall(r"^\| ``(bq:[^`]+)``", keys.__doc__ or "", re.M))


def built_keys() -> set[str]:
    """Every key budget/keys.py builds, written as the table writes it: ``{n}`` for the dataset, ``{j}`` for a turn
    bucket, ``{fp}`` for a tokenizer fingerprint."""
    from budget import keys
    ds = keys.DatasetKeys("n")
    props = [name for name, v in vars(keys.DatasetKeys).items() if isinstance(v, functools.cached_property)]
    built: set[str] = set()
    for name in props:
        value = getattr(ds, name)
        for key in value if isinstance(value, list) else [value]:
            built.add(re.sub(r":lengths:\d+$", ":lengths:{j}", key))
    fp = "0" * 64
    built |= {keys.DATASETS, keys.EPOCH, keys.SERVER_INFO, keys.SERVER_HEALTH, keys.SERVER_LOAD, keys.WINDOW,
              keys.tokenizer_files(fp).replace(fp, "{fp}"), keys.mix("id")}
    return built


def test_the_key_table_of_budget_keys_matches_the_keys_it_builds() -> None:
    """budget/keys.py's docstring holds the key table (docs/architecture.md, "Redis keys" points there): every key
    the module builds is a row, and every row is a key it builds."""
    table, built = documented_keys(), built_keys()
    assert len(built) > 20, "found too few keys: is built_keys still right?"
    assert sorted(built - table) == [], "keys missing from budget/keys.py's key table"
    assert sorted(table - built) == [], "budget/keys.py's key table names keys the module does not build"
