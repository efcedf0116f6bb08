"""Turn a dataset's regenerated responses into training data (ShareGPT or OpenAI messages), and its manifest.

``raw_responses.jsonl`` keeps what SGLang returned, verbatim; training pipelines (EAGLE-3 draft training in
SpecForge, SFT tools) want one conversation per line with the new answer as the last assistant turn. This module
is that conversion and nothing else: the CLI (``produce export``) only parses options and calls `export_dataset`.
docs/export.md describes the formats, the decisions and their sharp edges.

Rules kept here:

- Only committed results are exported: a last line without its newline (a crash mid-write, which the next
  collector cuts) is skipped, and an id listed in ``failed.jsonl`` is never exported.
- A sample cut by ``max_new_tokens`` is dropped unless asked for: its answer (or its thinking) is incomplete, and a
  chat template would still close it as a finished turn.
- The export is written to a temporary file beside ``dest`` and renamed over it: a reader never sees half a file.
- With token ids, the prompt is rendered again with the run's tokenizer and template kwargs; a record whose
  length differs from what the server counted is left out and reported, never written with ids that are wrong.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import IO, Any, Final, Iterator, Mapping, Sequence

from budget import serverinfo
from producer.output import FAILED, RESULTS, RUN
from producer.render import RenderError, Renderer

MANIFEST: Final = "manifest.json"
FORMATS: Final = ("sharegpt", "openai-messages")
TRUNCATED_MODES: Final = ("drop", "keep")
REASONING_MODES: Final = ("inline", "field", "drop")
#: OpenAI role -> ShareGPT "from". SpecForge's parser maps human/gpt back and passes system/tool through.
SHAREGPT_FROM: Final = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
DEFAULT_THINK: Final = ("<think>", "</think>")
#: What a manifest keeps of SGLang's /get_server_info (defined in budget/serverinfo.py, shared with the workers):
#: it returns every server argument, api_key included, so only what identifies the model and the engine is
#: copied, never the whole dict.
SERVER_INFO_KEYS: Final = serverinfo.SERVER_INFO_KEYS
_BATCH: Final = 256  # prompts rendered per apply_chat_template call when token ids are asked for
_MAX_LISTED_IDS: Final = 20
_REQUIRED: Final[dict[str, type]] = {
    "id": str, "messages": list, "response": str, "content": str, "finish_reason": str,
    "prompt_tokens": int, "completion_tokens": int,
}


class ExportError(Exception):
    """A user error (missing or malformed output files, bad options, wrong tokenizer), fit to show as is."""


@dataclass(frozen=True)
class ExportOptions:
    """How to export; see docs/export.md for what each choice writes."""

    format: str  # "sharegpt" | "openai-messages"
    truncated: str = "drop"  # "drop" | "keep": samples with finish_reason "length"
    reasoning: str = "inline"  # "inline" | "field" | "drop"
    token_ids: bool = False  # add input_ids/output_ids (needs the run's tokenizer)

    def __post_init__(self) -> None:
        for name, value, allowed in (("format", self.format, FORMATS),
                                     ("truncated", self.truncated, TRUNCATED_MODES),
                                     ("reasoning", self.reasoning, REASONING_MODES)):
            if value not in allowed:
                raise ExportError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")


@dataclass
class ExportReport:
    """What an export wrote and what it left out, and why."""

    written: int
    dropped_truncated: int  # finish_reason "length", left out with truncated="drop"
    skipped_failed: int  # ids in failed.jsonl: never exported
    path: Path
    manifest: Path
    empty_turns: int = 0  # written records whose assistant turn holds no text (no answer, no exported reasoning)
    prompt_mismatch: int = 0  # token_ids: re-rendered prompt length != prompt_tokens; left out
    output_len_differs: int = 0  # token_ids: len(output_ids) != completion_tokens less the stop's EOS; written
    mismatched_ids: list[str] = field(default_factory=list)  # the first prompt mismatches, for the message
    torn_tail: bool = False  # raw_responses.jsonl ended in a partial line (skipped)
    template_hash: str | None = None
    tokenizer_revision: str | None = None


def export_dataset(dataset_dir: Path, dest: Path, options: ExportOptions, *, tokenizer: Any | None = None,
                   server_info: Mapping[str, Any] | None = None,
                   servers: Sequence[Mapping[str, Any]] | None = None,
                   extra: Mapping[str, Any] | None = None) -> ExportReport:
    """Export ``dataset_dir``'s responses to the JSONL file ``dest`` and refresh the dataset's manifest.

    `tokenizer` (a transformers tokenizer, the one the run used) is required with ``options.token_ids``.
    `server_info`, `servers` and `extra` go to the manifest (see `write_manifest`). Raises ExportError on a user error;
    ``dest`` is then left as it was.
    """
    dataset_dir, dest = Path(dataset_dir), Path(dest)
    settings = _run_settings(dataset_dir)
    source = dataset_dir / RESULTS
    if not source.is_file():
        raise ExportError(f"{source} not found: nothing was collected for this dataset yet")
    _check_dest(dest, dataset_dir)
    failed = _failed_ids(dataset_dir)
    ids = _TokenIds(tokenizer, settings) if options.token_ids else None
    think = _markers(settings)
    report = ExportReport(written=0, dropped_truncated=0, skipped_failed=len(failed), path=dest,
                          manifest=dataset_dir / MANIFEST)
    if ids is not None:
        report.template_hash, report.tokenizer_revision = ids.template_hash, ids.revision
    stats = _Stats()
    results = _Results(source)
    with _atomic(dest) as fh:
        batch: list[tuple[int, dict[str, Any]]] = []
        for number, rec in results:
            stats.add(rec)
            if rec["id"] in failed:
                continue
            if options.truncated == "drop" and _is_truncated(rec):
                report.dropped_truncated += 1
                continue
            batch.append((number, rec))
            if len(batch) >= _BATCH:
                _write_batch(fh, batch, options, think, ids, report, source)
                batch = []
        _write_batch(fh, batch, options, think, ids, report, source)
    report.torn_tail = results.torn_tail
    _write_manifest(dataset_dir, settings, stats, len(failed), server_info, servers, extra)
    return report


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
    settings = _run_settings(dataset_dir)
    source = dataset_dir / RESULTS
    stats = _Stats()
    if source.is_file():
        for _number, rec in _Results(source):
            stats.add(rec)
    return _write_manifest(dataset_dir, settings, stats, len(_failed_ids(dataset_dir)), server_info, servers,
                           extra)


def template_hash(tokenizer: Any) -> str:
    """sha256 hex of the tokenizer's chat template text (canonical JSON when it holds several named templates)."""
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# -- records ---------------------------------------------------------------------------------------------------


def _is_truncated(rec: Mapping[str, Any]) -> bool:
    """Cut off, or a thinking block that never closed (``reasoning_unclosed``, written by parsers): such a turn
    has no answer, and exported as a complete turn it would teach the model to stop in mid-thought."""
    return (rec["finish_reason"] == "length" or bool(rec.get("reasoning_truncated"))
            or bool(rec.get("reasoning_unclosed")))


def _assistant_turn(reasoning: str | None, content: str, mode: str, think: tuple[str, str]) -> dict[str, Any]:
    """The regenerated turn. Inline is the shape Qwen3/DeepSeek-R1 templates render and split again."""
    if mode == "inline" and reasoning is not None:
        start, end = think
        return {"role": "assistant", "content": f"{start}\n{reasoning}\n{end}\n\n{content}"}
    turn: dict[str, Any] = {"role": "assistant", "content": content}
    if mode == "field" and reasoning is not None:
        turn["reasoning_content"] = reasoning
    return turn


def _sharegpt_turn(message: Mapping[str, Any]) -> dict[str, Any]:
    """One prompt message as a ShareGPT turn.

    ShareGPT has no tool_calls: an assistant turn's calls are appended to its text as the JSON list the dataset
    had (one line, keys in the dataset's order), after a newline when there is text. Keys ShareGPT has no place
    for (tool_call_id, name, reasoning_content...) stay on the turn, so nothing the dataset said is lost.
    """
    role = message.get("role")
    if role not in SHAREGPT_FROM:
        raise ExportError(f"message role {role!r} has no ShareGPT equivalent")
    content = message.get("content")
    text = content if isinstance(content, str) else ""
    tool_calls = message.get("tool_calls")
    rendered = bool(tool_calls)
    if rendered:
        text = (text + "\n" if text else "") + json.dumps(tool_calls, ensure_ascii=False)
    turn: dict[str, Any] = {"from": SHAREGPT_FROM[str(role)], "value": text}
    skip = {"role", "content", "tool_calls"} if rendered else {"role", "content"}
    turn.update((key, value) for key, value in message.items() if key not in skip)
    return turn


def _export_record(rec: Mapping[str, Any], options: ExportOptions, think: tuple[str, str]) -> dict[str, Any]:
    reasoning = None if options.reasoning == "drop" else rec.get("reasoning")
    turn = _assistant_turn(reasoning, rec["content"], options.reasoning, think)
    if rec.get("tool_calls"):  # parsed by the run's reasoning parser (worker/toolcalls.py)
        turn["tool_calls"] = rec["tool_calls"]
    out: dict[str, Any] = {"id": rec["id"]}
    if options.format == "openai-messages":
        out["messages"] = [*rec["messages"], turn]
    else:
        gpt = _sharegpt_turn(turn)  # calls appended to the text, reasoning_content kept, as for prompt turns
        out["conversations"] = [*(_sharegpt_turn(m) for m in rec["messages"]), gpt]
    if _is_truncated(rec):
        out["truncated"] = True
    return out


def _write_batch(fh: IO[str], batch: list[tuple[int, dict[str, Any]]], options: ExportOptions,
                 think: tuple[str, str], ids: _TokenIds | None, report: ExportReport, source: Path) -> None:
    if not batch:
        return
    prompts = ids.prompt_ids([rec["messages"] for _n, rec in batch]) if ids else []
    outputs = ids.output_ids([rec["response"] for _n, rec in batch]) if ids else []
    for i, (number, rec) in enumerate(batch):
        reasoning = rec.get("reasoning")
        if options.reasoning == "inline" and reasoning and think[1] in reasoning:
            # Cannot happen with budgetq's split (reasoning ends at the first end marker); if it did, the inline
            # text would be split elsewhere by every template, so refuse rather than write a different answer.
            raise ExportError(f"{source}:{number}: reasoning contains {think[1]!r}: it cannot be inlined")
        out = _export_record(rec, options, think)
        if ids is not None:
            prompt = prompts[i]
            if prompt is None or len(prompt) != rec["prompt_tokens"]:
                report.prompt_mismatch += 1
                if len(report.mismatched_ids) < _MAX_LISTED_IDS:
                    report.mismatched_ids.append(rec["id"])
                continue
            # A "stop" is the EOS token: counted by the server, absent from the text.
            expected = rec["completion_tokens"] - (1 if rec["finish_reason"] == "stop" else 0)
            if len(outputs[i]) != expected:
                report.output_len_differs += 1
            out.update(input_ids=prompt, output_ids=outputs[i], template_hash=ids.template_hash,
                       tokenizer_revision=ids.revision)
        exported_reasoning = None if options.reasoning == "drop" else reasoning
        if not rec["content"] and not exported_reasoning:
            report.empty_turns += 1
        fh.write(json.dumps(out, ensure_ascii=False) + "\n")
        report.written += 1


class _TokenIds:
    """Prompt and output ids with the run's tokenizer, refused up front when it is not the run's tokenizer."""

    def __init__(self, tokenizer: Any | None, settings: Mapping[str, Any]) -> None:
        if tokenizer is None:
            raise ExportError("token ids need the run's tokenizer")
        kwargs = settings.get("chat_template_kwargs") or {}
        try:
            self._renderer = Renderer(tokenizer, chat_template_kwargs=kwargs)
        except RenderError as exc:
            raise ExportError(str(exc)) from None
        self.revision: str | None = settings.get("tokenizer")
        if self._renderer.fingerprint() != self.revision:
            # Same fingerprint as the producer's check on resume: template, vocabulary, special tokens, kwargs.
            raise ExportError("the tokenizer given is not the one the run used (its fingerprint differs from "
                              f"run.json's {self.revision!r}): token ids would not match the responses")
        self._tokenizer = tokenizer
        self.template_hash = template_hash(tokenizer)

    def prompt_ids(self, conversations: list[list[dict[str, Any]]]) -> list[list[int] | None]:
        """The run's own rendering (producer.render); None for a prompt the template now refuses."""
        try:
            return [r.input_ids for r in self._renderer.render_many(conversations)]
        except RenderError:
            pass
        out: list[list[int] | None] = []
        for messages in conversations:
            try:
                out.append(self._renderer.render(messages).input_ids)
            except RenderError:
                out.append(None)
        return out

    def output_ids(self, texts: list[str]) -> list[list[int]]:
        """``tokenizer.encode(text, add_special_tokens=False)`` for each text, in one batched call."""
        return [list(row) for row in self._tokenizer(texts, add_special_tokens=False)["input_ids"]]


# -- files -----------------------------------------------------------------------------------------------------


class _Results:
    """The records of raw_responses.jsonl with their line numbers; remembers whether the last line was torn."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.torn_tail = False

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        with open(self.path, "rb") as fh:
            for number, raw in enumerate(fh, 1):
                if not raw.endswith(b"\n"):
                    self.torn_tail = True  # a crash mid-write; the result is still in Redis
                    return
                try:
                    rec = json.loads(raw)
                except ValueError as exc:
                    raise ExportError(f"{self.path}:{number}: not valid JSON ({exc})") from None
                _check_record(rec, f"{self.path}:{number}")
                yield number, rec


def _check_record(rec: Any, where: str) -> None:
    if not isinstance(rec, dict):
        raise ExportError(f"{where}: expected a JSON object")
    for key, kind in _REQUIRED.items():
        value = rec.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ExportError(f"{where}: {key} missing or not a {kind.__name__}")
    if rec.get("reasoning") is not None and not isinstance(rec["reasoning"], str):
        raise ExportError(f"{where}: reasoning must be a string or null")


def _run_settings(dataset_dir: Path) -> dict[str, Any]:
    path = dataset_dir / RUN
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path} not found: {dataset_dir} is not a budgetq dataset output directory") from None
    except ValueError as exc:
        raise ExportError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return settings


def _markers(settings: Mapping[str, Any]) -> tuple[str, str]:
    from producer.parsers import PARSER_MARKERS
    parser_markers = PARSER_MARKERS.get(str(settings.get("reasoning_parser")))
    if parser_markers is not None and parser_markers.start != DEFAULT_THINK[0]:  # Kimi's ◁think▷
        return parser_markers.start, parser_markers.end
    think = settings.get("think")
    if isinstance(think, list) and len(think) == 2 and all(isinstance(t, str) and t for t in think):
        return think[0], think[1]
    return DEFAULT_THINK


def _failed_ids(dataset_dir: Path) -> set[str]:
    path = dataset_dir / FAILED
    if not path.is_file():
        return set()
    ids: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            ids.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            raise ExportError(f"{path}:{number}: expected a JSON object with an id") from None
    return ids


def _check_dest(dest: Path, dataset_dir: Path) -> None:
    if dest.is_dir():
        raise ExportError(f"{dest} is a directory: give the path of the file to write")
    own = {(dataset_dir / name).resolve() for name in (RESULTS, FAILED, RUN, MANIFEST)}
    if dest.resolve() in own:
        raise ExportError(f"{dest} is one of the dataset's own files: export elsewhere")


@contextmanager
def _atomic(dest: Path) -> Iterator[IO[str]]:
    """A text file that appears at ``dest`` complete (fsynced, then renamed) or not at all."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A unique name: two exports to one path must not write into each other's temporary file.
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8", newline="\n") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# -- manifest --------------------------------------------------------------------------------------------------


@dataclass
class _Stats:
    samples: int = 0
    truncated: int = 0
    reasoning_truncated: int = 0
    reasoning_unclosed: int = 0
    tool_calls: int = 0
    tool_call_errors: int = 0  # calls that did not parse: their text stayed in the content
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    lengths: list[int] = field(default_factory=list)

    def add(self, rec: Mapping[str, Any]) -> None:
        self.samples += 1
        self.truncated += _is_truncated(rec)
        self.reasoning_truncated += bool(rec.get("reasoning_truncated"))
        self.reasoning_unclosed += bool(rec.get("reasoning_unclosed"))
        self.tool_calls += len(rec.get("tool_calls") or [])
        self.tool_call_errors += int(rec.get("tool_call_errors") or 0)
        self.prompt_tokens += rec["prompt_tokens"]
        self.completion_tokens += rec["completion_tokens"]
        self.finish_reasons[rec["finish_reason"]] += 1
        self.lengths.append(rec["completion_tokens"])

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


def _write_manifest(dataset_dir: Path, settings: Mapping[str, Any], stats: _Stats, failed: int,
                    server_info: Mapping[str, Any] | None, servers: Sequence[Mapping[str, Any]] | None,
                    extra: Mapping[str, Any] | None) -> Path:
    path = dataset_dir / MANIFEST
    previous = _previous_manifest(path)
    manifest: dict[str, Any] = {
        "dataset": dataset_dir.name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "budgetq_version": _budgetq_version(),
        "counts": {"samples": stats.samples, "failed": failed, "truncated": stats.truncated,
                   "reasoning_truncated": stats.reasoning_truncated,
                   "reasoning_unclosed": stats.reasoning_unclosed, "tool_calls": stats.tool_calls,
                   "tool_call_errors": stats.tool_call_errors},
        "tokens": {"prompt": stats.prompt_tokens, "completion": stats.completion_tokens},
        "finish_reasons": dict(sorted(stats.finish_reasons.items())),
        "completion_length": stats.completion_length(),
        "sampling_params": settings.get("sampling_params"),
        # null: a run stored before parsers, split on the think markers only
        "reasoning_parser": settings.get("reasoning_parser"),
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
    kept_extra = dict(extra) if extra is not None else previous.get("extra")
    if kept_extra is not None:
        manifest["extra"] = kept_extra
    text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    with _atomic(path) as fh:
        fh.write(text)
    return path
