"""bench/results holds the measurements the docs cite, and only those: every file there is cited by docs/*.md or
README.md, and every bench/results path they cite exists.

A file is cited by its path (``bench/results/overhead.json``), by a folder of it (``bench/results/issue17/``), by its
name (``--results taper_small.json``, the option that wrote it), or, for ``NAME.json`` and ``NAME.log`` where
``python -m bench.NAME`` is a benchmark, by docs/performance.md's rule that each benchmark writes
``bench/results/<name>.json`` and ``<name>.log``.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: A cited path: everything up to a space, a backtick, a quote or a closing bracket; a trailing "." or "," ends
#: the sentence, not the path.
CITED_PATH = re.compile(r"bench/results/[^\s`'\")\]]*")
#: docs/performance.md's sentence saying where each benchmark writes.
PER_BENCHMARK = ("bench/results/<name>.json", "bench/results/<name>.log")


@lru_cache(maxsize=1)
def docs_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def is_cited(path: Path, text: str) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    folders = [p.relative_to(ROOT).as_posix() + "/" for p in path.parents if RESULTS in p.parents]
    by_name = re.search(rf"(?<![\w.-]){re.escape(path.name)}(?![\w-])", text) is not None
    per_benchmark = (path.parent == RESULTS and path.suffix in (".json", ".log")
                     and (ROOT / "bench" / f"{path.stem}.py").exists() and all(s in text for s in PER_BENCHMARK))
    return rel in text or any(f in text for f in folders) or by_name or per_benchmark


def test_every_file_in_bench_results_is_cited_by_the_docs() -> None:
    text = docs_text()
    uncited = [p.relative_to(ROOT).as_posix() for p in sorted(RESULTS.rglob("*")) if p.is_file()
               and not is_cited(p, text)]
    assert uncited == [], "files of bench/results no doc cites (cite them, or git rm them)"


def test_every_cited_result_exists() -> None:
    cited = {m.group().rstrip(".,;:") for m in CITED_PATH.finditer(docs_text())} - set(PER_BENCHMARK)
    missing = sorted(c for c in cited if not (ROOT / c).exists())
    assert missing == [], "bench/results paths the docs cite that do not exist"
