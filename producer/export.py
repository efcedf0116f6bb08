"""Turn a dataset's regenerated responses into training data (ShareGPT, OpenAI messages or token ids), and its
manifest.

``raw_responses.jsonl`` keeps what SGLang returned, verbatim; training pipelines (EAGLE-3 draft training in
SpecForge, SFT tools) want one conversation per line with the new answer as the last assistant turn. This module
is that conversion and nothing else: the CLI (``produce export``) only parses options and calls `export_dataset`.
docs/export.md describes the formats, the decisions and their sharp edges.

Rules kept here:

- Only committed results are exported: a last line without its newline (a crash mid-write, which the next
  collector cuts) is skipped, and an id listed in ``failed.jsonl`` is never exported.
- Records are read in their version 2 view (budget/record.as_v2), whichever version the line is.
- An incomplete sample (cut by ``max_new_tokens``, or stopped in an unclosed thinking block) is dropped unless asked
  for: a chat template would still close it as a finished turn.
- The export is written to a temporary file beside ``dest`` and renamed over it: a reader never sees half a file.
- Token ids (``tokens`` format, ``token_ids``) are the prompt rendered again with the run's tokenizer and template
  kwargs, kept only if it is the prompt the worker sent (its digest), and the server's own ``output_ids``; nothing
  is re-encoded from text. A record that fails the check, or has no server ids (version 1), is left out and
  counted, never written with ids that are wrong.
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

from budget import record, serverinfo
from producer.output import FAILED, RESULTS, RUN
from producer.render import RenderError, Renderer

MANIFEST: Final = "manifest.json"
FORMATS: Final = ("sharegpt", "openai-messages", "tokens")
CONVERSATION_FORMATS: Final = ("sharegpt", "openai-messages")
#: Formats that write token ids and so need the run's tokenizer (to render the prompt again and check it).
TOKEN_FORMATS: Final = ("tokens",)
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
#: What a version 1 record must hold (flat), and what every turn of a version 2 record must hold.
_REQUIRED: Final[dict[str, type]] = {
    "id": str, "messages": list, "response": str, "content": str, "finish_reason": str,
    "prompt_tokens": int, "completion_tokens": int,
}
_REQUIRED_V2: Final[dict[str, type]] = {"id": str, "messages": list, "turns": list, "completion_tokens": int}
_REQUIRED_TURN: Final[dict[str, type]] = {
    "response": str, "content": str, "finish_reason": str, "prompt_tokens": int, "completion_tokens": int,
}


class ExportError(Exception):
    """A user error (missing or malformed output files, bad options, wrong tokenizer), fit to show as is."""


@dataclass(frozen=True)
class ExportOptions:
    """How to export; see docs/export.md for what each choice writes."""

    format: str  # "sharegpt" | "openai-messages" | "tokens"
    truncated: str = "drop"  # "drop" | "keep": incomplete samples (cut by max_new_tokens, or thinking unclosed)
    reasoning: str = "inline"  # "inline" | "field" | "drop" (conversation formats)
    token_ids: bool = False  # add the server's input_ids/output_ids to conversations (needs the run's tokenizer)

    @property
    def needs_tokenizer(self) -> bool:
        return self.token_ids or self.format in TOKEN_FORMATS

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
    prompt_mismatch: int = 0  # token ids: the re-rendered prompt is not the one sent (digest or length); left out
    no_output_ids: int = 0  # token ids: version 1 records, which kept no server ids; left out
    mismatched_ids: list[str] = field(default_factory=list)  # the first prompt mismatches, for the message
    torn_tail: bool = False  # raw_responses.jsonl ended in a partial line (skipped)
    template_hash: str | None = None
    tokenizer_revision: str | None = None


def export_dataset(dataset_dir: Path, dest: Path, options: ExportOptions, *, tokenizer: Any | None = None,
                   server_info: Mapping[str, Any] | None = None,
                   servers: Sequence[Mapping[str, Any]] | None = None,
                   extra: Mapping[str, Any] | None = None) -> ExportReport:
    """Export ``dataset_dir``'s responses to the JSONL file ``dest`` and refresh the dataset's manifest.

    `tokenizer` (a transformers tokenizer, the one the run used) is required with ``options.token_ids`` and the
    ``tokens`` format.
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
    ids = _TokenIds(tokenizer, settings) if options.needs_tokenizer else None
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
        if ids is not None and report.no_output_ids and not report.written:  # inside: dest is left as it was
            raise ExportError(f"{source}: none of its {report.no_output_ids} records has the server's token ids "
                              "(they were written before record version 2, which keeps them): a token export "
                              "needs them; regenerate the dataset (produce --new-run) or export it without "
                              "token ids")
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
    """A record (version 2 view) whose last turn is not finished: cut by max_new_tokens, or stopped inside an
    unclosed thinking block. A chat template would still close it as a finished turn."""
    return bool(rec["incomplete"])


def _assistant_turn(reasoning: str | None, content: str, mode: str, think: tuple[str, str],
                    tool_calls: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The regenerated turn. Inline is the shape Qwen3/DeepSeek-R1 templates render and split again. Parsed tool
    calls go in ``tool_calls`` (OpenAI shape), where chat templates render them back as the model wrote them."""
    if mode == "inline" and reasoning is not None:
        start, end = think
        turn: dict[str, Any] = {"role": "assistant", "content": f"{start}\n{reasoning}\n{end}\n\n{content}"}
    else:
        turn = {"role": "assistant", "content": content}
        if mode == "field" and reasoning is not None:
            turn["reasoning_content"] = reasoning
    if tool_calls:
        turn["tool_calls"] = [dict(call) for call in tool_calls]
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
    """One conversation: the prompt messages, then one assistant turn per regenerated turn."""
    turns = []
    for t in rec["turns"]:
        reasoning = None if options.reasoning == "drop" else t.get("reasoning")
        turns.append(_assistant_turn(reasoning, t["content"], options.reasoning, think, t.get("tool_calls") or ()))
    out: dict[str, Any] = {"id": rec["id"]}
    if options.format == "openai-messages":
        out["messages"] = [*rec["messages"], *turns]
    else:
        out["conversations"] = [*(_sharegpt_turn(m) for m in [*rec["messages"], *turns])]
    if _is_truncated(rec):
        out["truncated"] = True
    return out


def _write_batch(fh: IO[str], batch: list[tuple[int, dict[str, Any]]], options: ExportOptions,
                 think: tuple[str, str], ids: _TokenIds | None, report: ExportReport, source: Path) -> None:
    if not batch:
        return
    prompts = ids.prompt_ids([rec["messages"] for _n, rec in batch]) if ids else []
    for i, (number, rec) in enumerate(batch):
        turns = rec["turns"]
        if len(turns) != 1:
            # The record shape holds several turns (the multi-turn issue fills it); their prompts are the
            # messages plus the earlier turns and what answered them, which this export does not render yet.
            raise ExportError(f"{source}:{number}: {len(turns)} turns: only one-turn records can be exported yet")
        turn = turns[0]
        reasoning = turn.get("reasoning")
        if (options.format != "tokens" and options.reasoning == "inline" and reasoning
                and think[1] in reasoning):
            # Cannot happen with budgetq's split (reasoning ends at the first end marker); if it did, the inline
            # text would be split elsewhere by every template, so refuse rather than write a different answer.
            raise ExportError(f"{source}:{number}: reasoning contains {think[1]!r}: it cannot be inlined")
        prompt: list[int] | None = None
        output: list[int] | None = None
        if ids is not None:
            output = turn.get("output_ids")
            if output is None:
                report.no_output_ids += 1
                continue
            prompt = prompts[i]
            if prompt is None or not _same_prompt(prompt, turn):
                report.prompt_mismatch += 1
                if len(report.mismatched_ids) < _MAX_LISTED_IDS:
                    report.mismatched_ids.append(rec["id"])
                continue
        if options.format == "tokens":
            assert ids is not None and prompt is not None and output is not None
            out: dict[str, Any] = {"id": rec["id"], "turn": 0, "input_ids": prompt + output,
                                   "loss_mask": [0] * len(prompt) + [1] * len(output)}
            if _is_truncated(rec):
                out["truncated"] = True
            out.update(template_hash=ids.template_hash, tokenizer_revision=ids.revision)
        else:
            out = _export_record(rec, options, think)
            if ids is not None:
                out.update(input_ids=prompt, output_ids=output, template_hash=ids.template_hash,
                           tokenizer_revision=ids.revision)
            exported_reasoning = None if options.reasoning == "drop" else reasoning
            if not turn["content"] and not exported_reasoning and not turn.get("tool_calls"):
                report.empty_turns += 1
        fh.write(json.dumps(out, ensure_ascii=False) + "\n")
        report.written += 1


def _same_prompt(prompt: list[int], turn: Mapping[str, Any]) -> bool:
    """The re-rendered prompt is the one the turn was generated from: id by id through the digest the worker
    took of what it sent (version 2), or by length alone for a record that has no digest."""
    digest = turn.get("prompt_ids_sha256")
    if digest is not None:
        return bool(record.prompt_digest(prompt) == digest)
    return len(prompt) == turn["prompt_tokens"]


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
                yield number, record.as_v2(rec)


def _check_fields(obj: Mapping[str, Any], required: Mapping[str, type], where: str) -> None:
    for key, kind in required.items():
        value = obj.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ExportError(f"{where}: {key} missing or not a {kind.__name__}")
    if obj.get("reasoning") is not None and not isinstance(obj["reasoning"], str):
        raise ExportError(f"{where}: reasoning must be a string or null")


def _check_record(rec: Any, where: str) -> None:
    """A version 1 or 2 record as written; the error names the file, the line and the field."""
    if not isinstance(rec, dict):
        raise ExportError(f"{where}: expected a JSON object")
    if record.version(rec) < 2:
        _check_fields(rec, _REQUIRED, where)
        return
    _check_fields(rec, _REQUIRED_V2, where)
    if not rec["turns"]:
        raise ExportError(f"{where}: turns is empty")
    for n, turn in enumerate(rec["turns"]):
        if not isinstance(turn, dict):
            raise ExportError(f"{where}: turns[{n}]: expected a JSON object")
        _check_fields(turn, _REQUIRED_TURN, f"{where}: turns[{n}]")
        out = turn.get("output_ids")
        if out is not None and (not isinstance(out, list) or not all(type(i) is int for i in out)):
            raise ExportError(f"{where}: turns[{n}]: output_ids must be a list of integers or null")


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

    def add(self, rec: Mapping[str, Any]) -> None:
        turns = rec["turns"]
        self.samples += 1
        self.truncated += _is_truncated(rec)
        self.reasoning_truncated += any(t.get("reasoning_truncated") for t in turns)
        self.reasoning_unclosed += any(t.get("reasoning_unclosed") for t in turns)
        self.prompt_tokens += sum(t["prompt_tokens"] for t in turns)
        self.completion_tokens += rec["completion_tokens"]
        self.tool_calls += sum(len(t.get("tool_calls") or ()) for t in turns)
        self.tool_call_errors += sum(int(t.get("tool_call_errors") or 0) for t in turns)
        self.finish_reasons[turns[-1]["finish_reason"]] += 1
        self.record_versions[str(record.version(rec))] += 1
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
                   "reasoning_truncated": stats.reasoning_truncated, "reasoning_unclosed": stats.reasoning_unclosed,
                   "tool_calls": stats.tool_calls, "tool_call_errors": stats.tool_call_errors},
        "record_versions": dict(sorted(stats.record_versions.items())),
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
    with _atomic(path) as fh:
        fh.write(text)
    return path
