"""The audit of a chaos run: the promise, measured from the outside, as figures and pass/fail checks.

Every sample ends in ``raw_responses.jsonl`` (or in ``failed.jsonl`` where the scenario expects failures)
exactly once; Redis' counter equals the sum of ``completion_tokens`` in the file; the logs hold no traceback
but the expected ones; and the simulator did no more requests than the samples written, beyond what the
injected faults justify (the "wasted" figure).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from budget.keys import DatasetKeys
from demo.appending import read_jsonl
from demo.stack import Stack

DATASET = "prompts"


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


@dataclass
class Check:
    """One pass/fail statement of a scenario; ``detail`` says what was seen (read it when ok is False)."""

    name: str
    ok: bool
    detail: str = ""


@dataclass
class Result:
    """What a scenario measured (figures) and whether each of its checks held."""

    scenario: str
    scale: str
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    wall_s: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append(Check(name, bool(ok), str(detail)))
        return bool(ok)

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "scale": self.scale, "ok": self.ok, "wall_s": round(self.wall_s, 1),
                "figures": self.figures, "checks": [c.__dict__ for c in self.checks], "note": self.note}


TRACEBACK = "Traceback (most recent call last):"


def tracebacks(paths: Iterable[Path]) -> list[tuple[str, str]]:
    """(file name, final exception line) of every Python traceback in the logs."""
    found = []
    for path in paths:
        if not path.exists():
            continue
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.strip() != TRACEBACK:
                continue
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                j += 1
            found.append((path.name, lines[j].strip() if j < len(lines) else "(log ends)"))
    return found


def audit(res: Result, stack: Stack, out: Path, ids: Sequence[str], logs: Iterable[Path], *,
          allowed_tracebacks: str | None = None, failures_allowed: str | None = None,
          dataset: str = DATASET) -> dict[str, Any]:
    """The common checks: lost, duplicates, counter drift, unexpected failures and tracebacks. Adds the checks
    to ``res`` and returns the figures (also merged into ``res.figures``)."""
    recs = read_jsonl(out / dataset / "raw_responses.jsonl")
    failed = {str(f["id"]): f for f in read_jsonl(out / dataset / "failed.jsonl")}
    written = [str(x["id"]) for x in recs]
    unique = set(written)
    r = stack.client()
    used = int(r.get(DatasetKeys(dataset).used) or 0)
    done = int(r.hlen(DatasetKeys(dataset).done))
    tokens = sum(int(x["completion_tokens"]) for x in recs)
    lost = [sid for sid in ids if sid not in unique and sid not in failed]
    stats = stack.sim_stats()
    figures = {
        "samples": len(ids), "written": len(written), "failed": len(failed), "lost": len(lost),
        "duplicates": len(written) - len(unique), "drift": used - tokens, "redis_used": used, "file_tokens": tokens,
        "sim_completed": stats["completed"], "sim_aborted": stats["aborted"],
        "wasted": stats["completed"] + stats["aborted"] - len(unique),
        "chunk_jobs": int(r.get(DatasetKeys(dataset).seq) or 0),
    }
    res.figures.update(figures)
    res.check("lost = 0", not lost, f"{len(lost)} lost, e.g. {lost[:5]}")
    res.check("duplicates = 0", figures["duplicates"] == 0, figures["duplicates"])
    res.check("drift = 0", used == tokens and done == len(unique),
              f"Redis used {used} vs file {tokens}; done {done} vs {len(unique)} ids")
    unexpected_failed = {sid: f.get("reason") for sid, f in failed.items()
                         if failures_allowed is None or not re.search(failures_allowed, str(f.get("reason")))}
    res.check("failed only where expected", not unexpected_failed,
              f"{len(unexpected_failed)} unexpected, e.g. {list(unexpected_failed.items())[:3]}")
    tbs = tracebacks(logs)
    unexpected_tb = [t for t in tbs if allowed_tracebacks is None or not re.search(allowed_tracebacks, t[1])]
    res.figures["tracebacks"] = len(tbs)
    res.check("no unexpected traceback", not unexpected_tb, unexpected_tb[:5])
    return figures


def sample_ids(n: int) -> list[str]:
    """The ids demo.synthetic.write_prompts gives its n prompts."""
    return [str(i) for i in range(n)]


def log_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("*") if p.suffix in (".log", ".err", ".out") and p.name != "redis.log")
