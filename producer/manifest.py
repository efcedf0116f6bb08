"""``manifest.json``: what a dataset holds (counts recomputed from its files every time) and how it was made
(run settings, servers, budget state), refreshed by ``produce`` at the end of a run and by every export.
docs/export.md ("Manifest") describes it. Split from producer/export.py."""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Final, Mapping, Sequence

from budget import record, serverinfo
from producer.exportfiles import MANIFEST, Results, atomic, failed_ids, run_settings
from producer.exportrows import is_truncated
from producer.output import RESULTS
from producer.templatemix import SETTING as MIX_SETTING, TemplateMix, labels

#: What a manifest keeps of SGLang's /get_server_info (defined in budget/serverinfo.py, shared with the workers):
#: it returns every server argument, api_key included, so only what identifies the model and the engine is
#: copied, never the whole dict.
SERVER_INFO_KEYS: Final = serverinfo.SERVER_INFO_KEYS
#: Why a conversation ends before its last user turn (``stopped_by``, docs/multiturn.md "Stopping rules").
STOPPED_BY: Final = ("budget", "context", "failed", "length", "tool_mismatch")


def write_manifest(dataset_dir: Path, *, server_info: Mapping[str, Any] | None = None,
                   servers: Sequence[Mapping[str, Any]] | None = None,
                   extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``<dataset_dir>/manifest.json``: what the dataset holds and how it was made; return its path.

    Counts, token totals, finish reasons and completion lengths are recomputed from the files every time. What only
    the caller knows replaces the previous manifest's when given and is kept from it when not, so refreshing the
    manifest (every export does) never loses it:

    - the servers: either `servers`, entries as budget.serverinfo keeps them (``url``, ``host``, ``fetched`` and
      SERVER_INFO_KEYS; from ``bq:server_info`` or `serverinfo.fetch`), written as ``servers`` with ``server``
      = what they all report alike; or `server_info`, one server's /get_server_info, written as ``server``. Only
      SERVER_INFO_KEYS are kept of either, never the whole dict (it holds the API key);
    - `extra` (budget, mode...).
    """
    dataset_dir = Path(dataset_dir)
    settings = run_settings(dataset_dir)
    source = dataset_dir / RESULTS
    stats = Stats()
    if source.is_file():
        for _number, rec in Results(source):
            stats.add(rec)
    return write_manifest_of(dataset_dir, settings, stats, len(failed_ids(dataset_dir)), server_info, servers,
                           extra)


def template_hash(tokenizer: Any) -> str:
    """sha256 hex of the tokenizer's chat template text (canonical JSON when it holds several named templates)."""
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()



@dataclass
class Stats:
    """Counts over records in their version 2 view; a record's finish reason is its last turn's."""

    samples: int = 0
    truncated: int = 0
    reasoning_truncated: int = 0
    reasoning_unclosed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: int = 0
    tool_call_errors: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    record_versions: Counter[str] = field(default_factory=Counter)
    lengths: list[int] = field(default_factory=list)
    turns: int = 0
    multi_turn: int = 0  # conversations of more than one regenerated turn
    incomplete: int = 0
    stopped_by: Counter[str] = field(default_factory=Counter)
    #: records per generation (docs/generations.md; a record without ``generation`` is 0) and per temperature sent
    #: (the record's ``sampling_params``; "not sent": SGLang's default)
    generations: Counter[str] = field(default_factory=Counter)
    temperatures: Counter[str] = field(default_factory=Counter)
    #: records per ``key=value`` of their own chat_template_kwargs (a --template-kwargs-mix draws them per sample)
    template_kwargs: Counter[str] = field(default_factory=Counter)

    def add(self, rec: Mapping[str, Any]) -> None:
        turns = rec["turns"]
        self.samples += 1
        self.truncated += is_truncated(rec)
        self.reasoning_truncated += any(t.get("reasoning_truncated") for t in turns)
        self.reasoning_unclosed += any(t.get("reasoning_unclosed") for t in turns)
        self.prompt_tokens += sum(t["prompt_tokens"] for t in turns)
        self.completion_tokens += rec["completion_tokens"]
        self.tool_calls += sum(len(t.get("tool_calls") or ()) for t in turns)
        self.tool_call_errors += sum(int(t.get("tool_call_errors") or 0) for t in turns)
        self.finish_reasons[turns[-1]["finish_reason"]] += 1
        self.record_versions[str(record.version(rec))] += 1
        self.lengths.append(rec["completion_tokens"])
        self.turns += len(turns)
        self.multi_turn += len(turns) > 1
        self.incomplete += bool(rec.get("incomplete"))
        if rec.get("stopped_by") is not None:
            self.stopped_by[str(rec["stopped_by"])] += 1
        self.generations[str(int(rec.get("generation") or 0))] += 1
        temperature = (rec.get("sampling_params") or {}).get("temperature")
        self.temperatures["not sent" if temperature is None else f"{float(temperature):g}"] += 1
        kwargs = rec.get("chat_template_kwargs") or {}
        self.template_kwargs.update(labels(kwargs, sorted(kwargs)))

    def stopped(self) -> dict[str, int]:
        """Conversations by why they ended early: every reason (docs/multiturn.md), 0 when none did, and any other
        a record holds."""
        counts = {reason: 0 for reason in STOPPED_BY}
        counts.update(self.stopped_by)
        return dict(sorted(counts.items()))

    def completion_length(self) -> dict[str, float | int | None]:
        ordered = sorted(self.lengths)

        def rank(q: float) -> int | None:  # nearest rank: a length that occurs, no interpolation
            return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else None

        mean = round(sum(ordered) / len(ordered), 2) if ordered else None
        return {"mean": mean, "p50": rank(0.50), "p95": rank(0.95), "max": ordered[-1] if ordered else None}


def _budgetq_version() -> str:
    try:
        return metadata.version("budgetq")
    except metadata.PackageNotFoundError:
        return "unknown"


def _previous_manifest(path: Path) -> dict[str, Any]:
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return previous if isinstance(previous, dict) else {}


def read_manifest(dataset_dir: Path) -> dict[str, Any]:
    """``<dataset_dir>/manifest.json`` as a dict; {} when there is none (or it is unreadable)."""
    return _previous_manifest(Path(dataset_dir) / MANIFEST)


def write_manifest_of(dataset_dir: Path, settings: Mapping[str, Any], stats: Stats, failed: int,
                    server_info: Mapping[str, Any] | None, servers: Sequence[Mapping[str, Any]] | None,
                    extra: Mapping[str, Any] | None) -> Path:
    path = dataset_dir / MANIFEST
    previous = _previous_manifest(path)
    mix = TemplateMix.from_setting(settings.get(MIX_SETTING))
    mixed = set(mix.keys) if mix is not None else set()
    manifest: dict[str, Any] = {
        "dataset": dataset_dir.name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "budgetq_version": _budgetq_version(),
        "counts": {"samples": stats.samples, "failed": failed, "truncated": stats.truncated,
                   "reasoning_truncated": stats.reasoning_truncated, "reasoning_unclosed": stats.reasoning_unclosed,
                   "tool_calls": stats.tool_calls, "tool_call_errors": stats.tool_call_errors},
        "record_versions": dict(sorted(stats.record_versions.items())),
        # multi-turn: turns beside conversations, and why conversations ended early (docs/multiturn.md)
        "conversations": {"turns": stats.turns, "multi_turn": stats.multi_turn, "incomplete": stats.incomplete,
                          "stopped_by": stats.stopped()},
        # several generations of a prompt (docs/generations.md): records per generation and per temperature sent
        "generations": dict(sorted(stats.generations.items(), key=lambda kv: int(kv[0]))),
        "temperatures": dict(sorted(stats.temperatures.items())),
        # --template-kwargs-mix: records per drawn value of each mixed key (absent without a mix)
        **({"template_kwargs": {label: n for label, n in sorted(stats.template_kwargs.items())
                                if label.partition("=")[0] in mixed}} if mixed else {}),
        "tokens": {"prompt": stats.prompt_tokens, "completion": stats.completion_tokens},
        "finish_reasons": dict(sorted(stats.finish_reasons.items())),
        "completion_length": stats.completion_length(),
        "sampling_params": settings.get("sampling_params"),
        # null: a run stored before parsers, split on the think markers only
        "reasoning_parser": settings.get("reasoning_parser"),
        # the order prompts were sent in, so which subset a budget kept; absent from run.json: file order
        "order": settings.get("order") or {"mode": "file"},
        "settings": dict(settings),
    }
    if servers is not None:
        entries = [serverinfo.clean(e) for e in servers]
        manifest["server"] = serverinfo.common(entries)
        unknown = serverinfo.unknown(entries)
        if unknown:
            manifest["server_unknown"] = unknown
        manifest["servers"] = entries
    elif server_info is not None:
        manifest["server"] = serverinfo.pick(server_info)
    else:
        for key in ("server", "server_unknown", "servers"):
            if previous.get(key) is not None:
                manifest[key] = previous[key]
    if (settings.get("sampling_params") or {}).get("sampling_seed") is not None:
        # A seed is reproducible only where the servers honour it (--enable-deterministic-inference).
        known = manifest.get("servers")
        manifest["sampling_seed_honoured"] = (serverinfo.seed_honoured(known) if isinstance(known, list)
                                              else previous.get("sampling_seed_honoured"))
    kept_extra = dict(extra) if extra is not None else previous.get("extra")
    if kept_extra is not None:
        manifest["extra"] = kept_extra
    text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    with atomic(path) as fh:
        fh.write(text)
    return path

