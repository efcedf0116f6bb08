"""``manifest.json``: what a dataset holds (counts recomputed from its files every time) and how it was made
(run settings, servers, budget state), refreshed by ``produce`` at the end of a run (`write_run_manifests`) and by
every export. docs/export.md ("Manifest") describes it. Split from producer/export/writer.py.

Which SGLang servers a manifest names is decided here (`choose_servers`): those asked just now (``produce export
--server-url``, `fetch_servers`), else those the workers recorded in Redis (``bq:server_info``; at the end of a
run always, at an export only when the manifest names none yet), else what the manifest already says."""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import redis

from budget import record, serverinfo
from budget.urls import server_urls
from producer.errors import ProduceError, UsageError
from producer.generations import MIX_SETTING, TemplateMix, labels
from producer.ops.status import nearest_rank
from producer.results import MANIFEST, RESULTS, ExportError, Results, atomic, failed_ids, read_run_json

log = logging.getLogger("budgetq.produce")


def write_manifest(dataset_dir: Path, *, servers: Sequence[Mapping[str, Any]] | None = None,
                   extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``<dataset_dir>/manifest.json``: what the dataset holds and how it was made; return its path.

    Counts, token totals, finish reasons and completion lengths are recomputed from the files every time. What only
    the caller knows replaces the previous manifest's when given and is kept from it when not, so refreshing the
    manifest (every export does) never loses it:

    - `servers`: entries as budget.serverinfo keeps them (``url``, ``host``, ``fetched`` and its SERVER_INFO_KEYS;
      from ``bq:server_info`` or `fetch_servers`), written as ``servers`` with ``server`` = what they all report
      alike. Only SERVER_INFO_KEYS are kept of /get_server_info, never the whole dict (it holds the API key);
    - `extra` (budget, mode...: `budget_state`).
    """
    dataset_dir = Path(dataset_dir)
    settings = read_run_json(dataset_dir)
    source = dataset_dir / RESULTS
    stats = Stats()
    if source.is_file():
        for _number, rec in Results(source):
            stats.add(rec)
    return write_manifest_of(dataset_dir, settings, stats, len(failed_ids(dataset_dir)), servers, extra)


def template_hash(tokenizer: Any) -> str:
    """sha256 hex of the tokenizer's chat template text (canonical JSON when it holds several named templates)."""
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fetch_servers(server_url: str, *, api_key: str | None) -> list[dict[str, Any]]:
    """``--server-url URL[,URL...]``: ask each server for its /get_server_info now (``api_key``: SGLANG_API_KEY,
    as the bearer token); a router's URL gives the servers it lists. Raises UsageError (exit 2) for a list that is
    not http(s) URLs, ProduceError (exit 1) naming a server that cannot answer."""
    try:
        urls = server_urls(server_url, "--server-url")
    except ValueError:
        raise UsageError("--server-url: expected http(s) URLs, comma-separated, not "
                         f"{serverinfo.public_url(server_url)!r}") from None
    out = []
    for url in urls:
        try:
            found = serverinfo.discover(url, api_key=api_key)
        except serverinfo.ServerInfoError as exc:
            raise ProduceError(f"--server-url: {exc}") from None
        for server in found:
            out.append(serverinfo.clean({**server.entry(), "fetched": serverinfo.utc_iso(time.time())}))
            log.debug("SGLang server %s: %s", out[-1]["url"], server.info, extra={"server": out[-1]["url"]})
    return out


def choose_servers(dataset_dir: Path, *, fetched: list[dict[str, Any]] | None,
                   recorded: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The servers an export writes into ``dataset_dir``'s manifest: those asked just now, else those the workers
    recorded when the manifest names none yet (the end of the run recorded none; what serves now is the best we
    know), else None: the manifest keeps what it says."""
    if fetched is not None or recorded is None:
        return fetched
    known = read_manifest(dataset_dir)
    if known.get("server") is None and known.get("servers") is None:
        return recorded
    log.debug("%s: the manifest already names its servers: kept (--server-url replaces them)", Path(dataset_dir).name)
    return None


def budget_state(client: "redis.Redis", name: str) -> dict[str, Any]:
    """A manifest's ``extra``: the dataset's budget, mode, usage and status in Redis now."""
    from budget.ledger import Ledger
    state = Ledger(client).state(name)
    out: dict[str, Any] = {"budget": state.budget, "budget_mode": state.mode, "used": state.used,
                           "status": state.status,
                           # request time, start to answer, summed over the dataset's requests, and their share
                           # of the servers' busy time: the GPU time they cost (docs/mix.md "Cost in view")
                           "request_seconds": int(state.stats.get("request_ms", 0) or 0) / 1000,
                           "server_seconds": int(state.stats.get("server_ms", 0) or 0) / 1000}
    deadline = state.fields.get("deadline")
    if deadline:  # docs/mix.md: the deadline, and whether it is what closed the dataset
        out["deadline"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(int(deadline) / 1000))
        out["closed_by_deadline"] = state.fields.get("closed_by") == "deadline"
    from budget.ledger import MixStore
    store = MixStore(client)
    mix_id = store.mix_of(name)
    mix = store.load(mix_id) if mix_id else None
    if mix is not None:  # docs/mix.md: the mix, this dataset's weight and share, and what it got against it
        out["mix"] = {"total": mix.total, "weights": {n: str(w) for n, w in sorted(mix.weights.items())},
                      "weight": str(mix.weights[name]), "share": mix.shares()[name], "got": state.used,
                      "ran_dry": name in mix.dry}
    return out


def still_running(client: "redis.Redis", name: str) -> tuple[int, int | None] | None:
    """(samples done, samples selected or None when no ``produce`` said) when Redis says dataset ``name`` is
    still open with work queued, leased or in flight (its files still grow), else None."""
    from budget.ledger import Ledger
    state = Ledger(client).state(name)
    if state.status != "open" or not (state.live_chunks or state.in_flight or state.unwritten):
        return None
    selected = state.fields.get("selected", "")
    return state.done, int(selected) if selected.isdigit() else None


def running_manifest_path(dest: Path) -> Path:
    """Where the export of a dataset still running writes its manifest: beside the export (``train/b1.jsonl``:
    ``train/b1.manifest.json``), leaving the run's own ``manifest.json`` to the run's end."""
    return dest.with_name(f"{dest.stem if dest.suffix else dest.name}.manifest.json")


def describe_servers(servers: Sequence[Mapping[str, Any]] | None) -> str:
    """`` (SGLang: version V, model_path M; N servers)`` for a log line, or "" when there are none."""
    if not servers:
        return ""
    same = serverinfo.common(servers)
    what = ", ".join(f"{k} {same[k]}" for k in ("version", "model_path") if k in same) or (
        "unknown behind a router" if serverinfo.unknown(servers) else "servers differ")
    return f" (SGLang: {what}; {len(servers)} server{'s' if len(servers) != 1 else ''})"


def write_run_manifests(client: "redis.Redis", out_dir: Path, names: Sequence[str], *,
                        warn: Callable[[str], None]) -> list[dict[str, Any]] | None:
    """At the end of a run: each dataset's manifest.json, with what the workers recorded of their SGLang
    servers (bq:server_info) and the dataset's budget state; returns those servers. Best effort: a failure is a
    warning, never an exit code (the responses are on disk; ``produce export`` writes the manifest again)."""
    try:
        servers: list[dict[str, Any]] | None = serverinfo.load(client) or None
    except redis.RedisError as exc:
        warn(f"warning: cannot read the SGLang servers' info from Redis ({exc}); the manifests keep what they had")
        servers = None
    if servers is None:
        log.info("no worker recorded its SGLang servers' /get_server_info in the last %d h: the manifests keep "
                 "what they had about the server", serverinfo.MAX_AGE_S // 3600)
    for name in names:
        try:
            path = write_manifest(out_dir / name, servers=servers, extra=budget_state(client, name))
        except (OSError, ExportError, redis.RedisError) as exc:
            warn(f"warning: {name}: cannot write {out_dir / name / MANIFEST}: {exc}")
            continue
        log.info("%s: manifest %s%s", name, path, describe_servers(servers), extra={
            "dataset": name, "manifest": str(path), "servers": len(servers or [])})
    return servers



@dataclass
class Stats:
    """Counts over records; a record's finish reason is its last turn's."""

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
        self.truncated += record.is_truncated(rec)
        self.reasoning_truncated += any(t.get("reasoning_truncated") for t in turns)
        self.reasoning_unclosed += any(t.get("reasoning_unclosed") for t in turns)
        self.prompt_tokens += sum(t["prompt_tokens"] for t in turns)
        self.completion_tokens += rec["completion_tokens"]
        self.tool_calls += sum(len(t.get("tool_calls") or ()) for t in turns)
        self.tool_call_errors += sum(int(t.get("tool_call_errors") or 0) for t in turns)
        self.finish_reasons[turns[-1]["finish_reason"]] += 1
        self.record_versions[str(rec["record_version"])] += 1
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
        counts = {reason: 0 for reason in record.STOPPED_BY}
        counts.update(self.stopped_by)
        return dict(sorted(counts.items()))

    def completion_length(self) -> dict[str, float | int | None]:
        ordered = sorted(self.lengths)
        mean = round(sum(ordered) / len(ordered), 2) if ordered else None
        return {"mean": mean, "p50": nearest_rank(ordered, 0.50), "p95": nearest_rank(ordered, 0.95),
                "max": ordered[-1] if ordered else None}


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
                      servers: Sequence[Mapping[str, Any]] | None, extra: Mapping[str, Any] | None, *,
                      path: Path | None = None) -> Path:
    """Write the manifest to ``path`` (default ``<dataset_dir>/manifest.json``). Another ``path`` is the manifest
    of an export made while the run still runs: it says ``"running": true``, and what it keeps of the previous
    manifest (servers, extra) comes from the run's ``manifest.json``, which is left as it is."""
    own = dataset_dir / MANIFEST
    path = own if path is None else path
    previous = _previous_manifest(own)
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
        "reasoning_parser": settings.get("reasoning_parser"),
        # the order prompts were sent in, so which subset a budget kept
        "order": settings.get("order"),
        "settings": dict(settings),
    }
    if servers is not None:
        entries = [serverinfo.clean(e) for e in servers]
        manifest["server"] = serverinfo.common(entries)
        unknown = serverinfo.unknown(entries)
        if unknown:
            manifest["server_unknown"] = unknown
        manifest["servers"] = entries
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
    if path != own:
        manifest["running"] = True
    text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    with atomic(path) as fh:
        fh.write(text)
    return path

