"""Turn a dataset's regenerated responses into training data (ShareGPT, OpenAI messages or token ids), and its
manifest.

``raw_responses.jsonl`` keeps what SGLang returned, verbatim; training pipelines (EAGLE-3 draft training in
SpecForge, SFT tools) want one conversation per line with the model's own answers as the assistant turns. This
module is that conversion and nothing else: the CLI (``produce export``) only parses options into an `ExportJob`
and calls `export_datasets`, which decides where each dataset goes and which servers its manifest names, then
`export_dataset` for each. docs/export.md describes the formats, the decisions and their sharp edges. The pieces live
beside it: producer/results.py (reading and checking the files, the atomic write), producer/export/manifest.py
(the manifest), budget/record.py (which messages each turn answers).

The rows a conversation export writes are built here too (`conversation_row`, `turn_rows`): a record's
conversation in OpenAI messages or ShareGPT shape, whole (every regenerated turn in place, the dataset's assistant
turns never) or one row per regenerated turn (``--per-turn``: the history the turn's prompt was rendered from, then
the turn); docs/export.md ("Multi-turn records") shows the shapes. Below them: whether a row trains on exactly
what the model generated, rendered as its trainer renders it (`trained_conversations`, `is_exact`).

Rules kept here:

- Only committed results are exported: a last line without its newline (a crash mid-write, which the next
  collector cuts) is skipped, and an id listed in ``failed.jsonl`` is never exported.
- A record (budget/record.py) is a conversation of one or more regenerated turns; a record of another version is
  refused (exit 2) where the file is read.
- A truncated conversation (a turn cut by ``max_new_tokens`` or stopped in an unclosed thinking block) or an
  incomplete one (ended before its last user turn: ``stopped_by`` length, budget, failed, context, tool_mismatch)
  is dropped unless asked for (``truncated="keep"``), whole and in every format alike.
- The export is written to a temporary file beside ``dest`` and renamed over it: a reader never sees half a file.
- Token ids (``tokens`` format, ``token_ids``) are each turn's prompt rendered again with the run's tokenizer and
  template kwargs, kept only if it is the prompt the worker sent (its digest), and the server's own
  ``output_ids``; nothing is re-encoded from text. A turn that fails the check, or has no server ids,
  is left out and counted, never written with ids that are wrong.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, Iterator, Mapping, Sequence

from budget import record, serverinfo
from producer.export.manifest import (
    Stats,
    budget_state,
    choose_servers,
    describe_servers,
    read_manifest,
    running_manifest_path,
    still_running,
    template_hash,
    write_manifest,
    write_manifest_of,
)
from producer.generations import record_key
from producer.results import (
    DEFAULT_THINK,
    MANIFEST,
    RESULTS,
    ExportError,
    Results,
    atomic,
    check_dest,
    failed_ids,
    markers,
    read_run_json,
)
from producer.settings import CHAT_TEMPLATE, CHAT_TEMPLATE_PATH, TOKENIZER_PATH
from render.chat import ChatTemplate, Renderer, RenderError, load_tokenizer, read_chat_template

if TYPE_CHECKING:
    import redis

__all__ = ["CONVERSATION_FORMATS", "DEFAULT_THINK", "FORMATS", "MANIFEST", "REASONING_MODES", "SHAREGPT_FROM",
           "TOKEN_FORMATS", "TRAINERS", "TRUNCATED_MODES", "ExportError", "ExportJob", "ExportOptions", "ExportReport",
           "export_dataset", "export_datasets", "read_manifest", "template_hash", "write_manifest"]

log = logging.getLogger("budgetq.produce")

FORMATS: Final = ("sharegpt", "openai-messages", "tokens")
CONVERSATION_FORMATS: Final = ("sharegpt", "openai-messages")
#: Formats that write token ids and so need the run's tokenizer (to render the prompt again and check it).
TOKEN_FORMATS: Final = ("tokens",)
TRUNCATED_MODES: Final = ("drop", "keep")
REASONING_MODES: Final = ("inline", "field", "drop")
#: ``--for``: the trainer a conversation export is read by, which decides its rows (docs/export.md, "Trainers").
#: SpecForge renders a row whole and supervises its assistant turns there (every one, or the last with
#: ``train_only_last_turn``): one row per turn, trained with train_only_last_turn, is the exact shape. speculators
#: renders every assistant turn on its own prefix and supervises each (it fans a conversation out per turn
#: itself): one row per conversation; per-turn rows would train the earlier turns again.
TRAINERS: Final = ("specforge", "speculators")
PER_TURN_FOR: Final = {"specforge": True, "speculators": False}
_BATCH: Final = 256  # records whose prompts are rendered per apply_chat_template call when token ids are asked for
_MAX_LISTED_IDS: Final = 20


@dataclass(frozen=True)
class ExportOptions:
    """How to export; see docs/export.md for what each choice writes."""

    format: str  # "sharegpt" | "openai-messages" | "tokens"
    # "drop" | "keep": truncated (a turn cut by max_new_tokens), unclosed (thinking never closed) and incomplete
    # (ended before the last user turn) conversations, whole, in every format
    truncated: str = "drop"
    reasoning: str = "inline"  # "inline" | "field" | "drop" (conversation formats)
    token_ids: bool = False  # add the server's input_ids/output_ids to conversations (needs the run's tokenizer)
    # conversation formats: one row per regenerated turn instead of one per conversation; None: what `trainer`
    # reads exactly (PER_TURN_FOR), and without a trainer a conversation of several turns is refused
    per_turn: bool | None = None
    trainer: str | None = None  # "specforge" | "speculators" (``--for``)
    # conversation rows a trainer would not train on exactly (producer/export/writer.py; checked when the run's
    # tokenizer is given): "drop" leaves them out, "keep" writes them with "inexact": true; both count them
    inexact: str = "drop"

    @property
    def rows_per_turn(self) -> bool:
        if self.per_turn is not None:
            return self.per_turn
        return PER_TURN_FOR.get(self.trainer or "", False)

    @property
    def shape_chosen(self) -> bool:
        """Whether multi-turn rows have a shape: --per-turn/--whole said, or the trainer that decides it."""
        return self.per_turn is not None or self.trainer is not None

    @property
    def needs_tokenizer(self) -> bool:
        return self.token_ids or self.format in TOKEN_FORMATS

    def __post_init__(self) -> None:
        for name, value, allowed in (("format", self.format, FORMATS),
                                     ("truncated", self.truncated, TRUNCATED_MODES),
                                     ("reasoning", self.reasoning, REASONING_MODES)):
            if value not in allowed:
                raise ExportError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        if self.trainer is not None and self.trainer not in TRAINERS:
            raise ExportError(f"trainer must be one of {', '.join(TRAINERS)}, not {self.trainer!r}")
        if self.inexact not in TRUNCATED_MODES:
            raise ExportError(f"inexact must be one of {', '.join(TRUNCATED_MODES)}, not {self.inexact!r}")
        if self.trainer == "speculators" and self.per_turn:
            raise ExportError("--for speculators reads whole conversations: it trains every assistant turn of a "
                              "row on its own prefix, so per-turn rows would train each turn's history again")


@dataclass
class ExportReport:
    """What an export wrote and what it left out, and why."""

    written: int  # rows: conversations, or turns with per_turn and the tokens format
    dropped_truncated: int  # conversations left out with truncated="drop" (truncated, unclosed or incomplete)
    skipped_failed: int  # ids in failed.jsonl: never exported
    path: Path
    manifest: Path
    empty_turns: int = 0  # written regenerated turns that hold no text (no answer, no exported reasoning, no call)
    prompt_mismatch: int = 0  # token ids: turns whose re-rendered prompt is not the one sent (digest or length)
    no_output_ids: int = 0  # token ids: records with a turn the server gave no output_ids for; left out
    conversations: int = 0  # conversations with at least one row written
    mismatched_ids: list[str] = field(default_factory=list)  # the first prompt mismatches, for the message
    torn_tail: bool = False  # raw_responses.jsonl ended in a partial line (skipped)
    template_hash: str | None = None
    tokenizer_revision: str | None = None
    superseded: int = 0  # failed conversations a rerun's record of the same id replaced (only the last is exported)
    # conversation rows checked as their trainer renders them (producer/export/writer.py), with the run's tokenizer:
    inexact: int = 0  # rows that would not train on exactly the generated ids (left out with inexact="drop")
    inexact_ids: list[str] = field(default_factory=list)  # the first of their conversations, for the message
    unchecked: int = 0  # rows written unchecked: no tokenizer given, or a turn without server ids
    #: of dropped_truncated, the incomplete ones (ended early, no turn cut), by ``stopped_by`` (budget, tool_mismatch...)
    dropped_incomplete: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class ExportJob:
    """``produce export``'s request, checked before any server or Redis is asked: which datasets, how, and the
    run's tokenizer (loaded) when token ids are asked for."""

    names: tuple[str, ...]
    out_dir: Path
    options: ExportOptions
    dest: Path | None = None  # --dest: a file (one dataset, a path with a suffix) or a directory
    tokenizer: Any | None = None

    @classmethod
    def build(cls, names: Sequence[str], out_dir: Path, options: ExportOptions, *, dest: Path | None,
              tokenizer_dir: str | None) -> "ExportJob":
        """Raises ExportError (exit 2) when token ids have no tokenizer, or --dest is a file for several.

        Token ids without --tokenizer use the run's, named in each dataset's run.json (``tokenizer_path``); an explicit --tokenizer wins.
        A run's ``--chat-template`` file (run.json ``chat_template_path``) replaces the tokenizer's template either
        way: rows are checked as the run rendered its prompts."""
        tokenizer = None
        if options.needs_tokenizer and not tokenizer_dir:
            tokenizer_dir = _stored_tokenizer(Path(out_dir), names)
        if options.needs_tokenizer and not tokenizer_dir:
            raise ExportError(f"{'--token-ids' if options.token_ids else '--format tokens'} needs --tokenizer "
                              "(no run.json of these datasets names the run's tokenizer, or they name different ones)")
        if tokenizer_dir:  # also checks conversation rows as their trainer renders them
            try:
                tokenizer = load_tokenizer(tokenizer_dir, _stored_template(Path(out_dir), names))
            except RenderError as exc:
                raise ExportError(str(exc)) from None
        if dest is not None and len(names) > 1 and dest.suffix:
            raise ExportError("--dest must be a directory when exporting several datasets")
        return cls(tuple(names), Path(out_dir), options, dest, tokenizer)

    def destination(self, name: str) -> Path:
        """Where dataset ``name`` goes: --dest itself (one dataset, a path with a suffix), DEST/<name>.jsonl, or by
        default OUT/<name>/<format>.jsonl."""
        if self.dest is None:
            return self.out_dir / name / f"{self.options.format}.jsonl"
        if len(self.names) == 1 and self.dest.suffix:
            return self.dest
        return self.dest / f"{name}.jsonl"


def _stored_tokenizer(out_dir: Path, names: Sequence[str]) -> str | None:
    """The tokenizer the runs of ``names`` stored in run.json (`TOKENIZER_PATH`), when they all name the same one;
    None when one names none or they differ. Raises ExportError naming a stored
    directory that no longer exists."""
    found: set[str] = set()
    for name in names:
        try:
            path = read_run_json(out_dir / name).get(TOKENIZER_PATH)
        except ExportError:
            return None  # said by the export of that dataset, in its own words
        if not isinstance(path, str) or not path:
            return None
        found.add(path)
    if len(found) != 1:
        return None
    (path,) = found
    if Path(path).is_absolute() and not Path(path).is_dir():
        raise ExportError(f"the run's tokenizer {path} (run.json {TOKENIZER_PATH}) no longer exists: give "
                          "--tokenizer DIR, the run's tokenizer where it is now")
    log.info("using the run's tokenizer %s (run.json %s)", path, TOKENIZER_PATH, extra={"tokenizer": path})
    return path


def _stored_template(out_dir: Path, names: Sequence[str]) -> ChatTemplate | None:
    """The ``--chat-template`` the runs of ``names`` rendered with (run.json `CHAT_TEMPLATE_PATH`, checked against
    its digest `CHAT_TEMPLATE`), None when they had none. Raises ExportError when the datasets ran with different
    templates, or the file is gone or changed since: rendering with another template would fail every check."""
    found: set[tuple[str | None, str | None]] = set()
    for name in names:
        try:
            stored = read_run_json(out_dir / name)
        except ExportError:
            continue  # said by the export of that dataset, in its own words
        found.add((stored.get(CHAT_TEMPLATE_PATH), stored.get(CHAT_TEMPLATE)))
    if len(found) > 1:
        raise ExportError(f"{', '.join(names)} were run with different --chat-template files (run.json "
                          f"{CHAT_TEMPLATE_PATH}): export them one at a time")
    path, digest = next(iter(found), (None, None))
    if not path:
        return None
    try:
        template = read_chat_template(path)
    except RenderError as exc:
        raise ExportError(f"the run's {exc} (run.json {CHAT_TEMPLATE_PATH}): put the run's template back there") from None
    if template.digest != digest:
        raise ExportError(f"the run's chat template file {path} (run.json {CHAT_TEMPLATE_PATH}) changed since the "
                          f"run: sha256 {template.digest[:12]}, the run's {str(digest)[:12]}; put the run's template "
                          "back there")
    log.info("using the run's chat template %s (run.json %s)", path, CHAT_TEMPLATE_PATH, extra={"chat_template": path})
    return template


def export_datasets(job: ExportJob, *, client: "redis.Redis | None" = None,
                    fetched: list[dict[str, Any]] | None = None) -> Iterator[tuple[str, ExportReport]]:
    """Export each dataset of ``job`` (`export_dataset`), yielding its name and report as it is done.

    Each manifest names the servers `choose_servers` picks: ``fetched`` (``--server-url``: asked just now), else
    those the workers recorded in ``client``'s Redis, which also gives each manifest the dataset's budget state."""
    recorded: list[dict[str, Any]] | None = None
    if client is not None and fetched is None:
        recorded = serverinfo.load(client) or None
        log.debug("%d SGLang server(s) recorded in Redis by the workers", len(recorded or []))
    for name in job.names:
        dataset_dir = job.out_dir / name
        extra = budget_state(client, name) if client is not None else None
        servers = choose_servers(dataset_dir, fetched=fetched, recorded=recorded)
        dest = job.destination(name)
        running = still_running(client, name) if client is not None else None
        manifest = None
        if running is not None:  # its files still grow: the run's manifest.json is the run's end's to write
            manifest = running_manifest_path(dest)
            done, selected = running
            log.warning("%s is still running (%d/%s samples done): this export holds what is on disk now, and "
                        "its manifest goes to %s (the run's %s is left as it is)", name, done,
                        "?" if selected is None else selected, manifest, dataset_dir / MANIFEST,
                        extra={"dataset": name, "done": done, "selected": selected})
        report = export_dataset(dataset_dir, dest, job.options, tokenizer=job.tokenizer,
                                servers=servers, extra=extra, manifest=manifest)
        yield name, report
        # Said once the caller has printed the dataset's line, as notes on it.
        if servers is not None:
            log.info("%s: manifest %s%s", name, report.manifest, describe_servers(servers),
                     extra={"dataset": name, "manifest": str(report.manifest), "servers": len(servers)})
        if report.no_output_ids and job.options.needs_tokenizer:  # conversation rows are written, unchecked
            log.warning("%s: %d records of %s left out: they have no server token ids", name, report.no_output_ids, dataset_dir / RESULTS,
                        extra={"dataset": name, "no_output_ids": report.no_output_ids})
        if report.prompt_mismatch:
            log.warning("%s: %d turns left out: the re-rendered prompt differs (first: %s)", name,
                        report.prompt_mismatch, ", ".join(report.mismatched_ids[:5]),
                        extra={"dataset": name, "prompt_mismatch": report.prompt_mismatch})
        if report.inexact:
            log.warning("%s: %d rows %s: %s would not train on exactly what the model generated (the template "
                        "renders them otherwise; first: %s); docs/export.md, \"Trainers\"", name, report.inexact,
                        "left out" if job.options.inexact == "drop" else "written with inexact: true",
                        job.options.trainer or "a trainer", ", ".join(report.inexact_ids[:5]),
                        extra={"dataset": name, "inexact": report.inexact})
        if report.unchecked and job.options.format != "tokens":
            log.warning("%s: %d rows not checked against the ids the model generated: %s", name, report.unchecked,
                        "give --tokenizer (the run's)" if job.tokenizer is None else
                        "their records have no server ids",
                        extra={"dataset": name, "unchecked": report.unchecked})


def export_dataset(dataset_dir: Path, dest: Path, options: ExportOptions, *, tokenizer: Any | None = None,
                   servers: Sequence[Mapping[str, Any]] | None = None,
                   extra: Mapping[str, Any] | None = None, manifest: Path | None = None) -> ExportReport:
    """Export ``dataset_dir``'s responses to the JSONL file ``dest`` and refresh the dataset's manifest (or, with
    ``manifest``, write it there instead, marked ``"running": true``: a run still going on).

    `tokenizer` (a transformers tokenizer, the one the run used) is required with ``options.token_ids`` and the
    ``tokens`` format.
    `servers` and `extra` go to the manifest (see `write_manifest`). Raises ExportError on a user error; ``dest`` is
    then left as it was.
    """
    dataset_dir, dest = Path(dataset_dir), Path(dest)
    settings = read_run_json(dataset_dir)
    source = dataset_dir / RESULTS
    if not source.is_file():
        raise ExportError(f"{source} not found: nothing was collected for this dataset yet")
    check_dest(dest, dataset_dir)
    failed = failed_ids(dataset_dir)
    # The run's tokenizer also checks conversation rows (producer/export/writer.py): given, it is used.
    ids = _TokenIds(tokenizer, settings) if options.needs_tokenizer or tokenizer is not None else None
    think = markers(settings)
    report = ExportReport(written=0, dropped_truncated=0, skipped_failed=len(failed), path=dest,
                          manifest=dataset_dir / MANIFEST if manifest is None else manifest)
    if ids is not None:
        report.template_hash, report.tokenizer_revision = ids.template_hash, ids.revision
    stats = Stats()
    results = Results(source)
    with atomic(dest) as fh:
        batch: list[tuple[int, dict[str, Any]]] = []

        def take(number: int, rec: dict[str, Any]) -> None:
            nonlocal batch
            stats.add(rec)
            if record_key(rec) in failed:
                return
            if options.truncated == "drop" and record.is_truncated(rec):
                _points(rec, number, source)  # a malformed record is an error whether it would be written or not
                report.dropped_truncated += 1
                reason = _ended_early(rec)
                if reason is not None:
                    report.dropped_incomplete[reason] += 1
                return
            batch.append((number, rec))
            if len(batch) >= _BATCH:
                _write_batch(fh, batch, options, think, ids, report, source)
                batch = []

        # An id's last record is its record: a conversation that ended with a failed turn may be followed by the
        # rerun's record of it (producer/results.py ResultsFile). Those are held back until the file is read.
        held: dict[str, tuple[int, dict[str, Any]]] = {}
        for number, rec in results:
            key = record_key(rec)  # a sample: the prompt's id and the generation (producer/generations.py)
            superseded = held.pop(key, None) is not None
            if rec.get("stopped_by") == record.FAILED:
                held[key] = (number, rec)
                continue
            if superseded:
                report.superseded += 1
            take(number, rec)
        for number, rec in held.values():
            take(number, rec)
        _write_batch(fh, batch, options, think, ids, report, source)
        if ids is not None and report.no_output_ids and not report.written:  # inside: dest is left as it was
            raise ExportError(f"{source}: none of its {report.no_output_ids} records has the server's token ids "
                              "(output_ids): a token export needs them; regenerate the dataset (produce --new-run) or export it without "
                              "token ids")
    report.torn_tail = results.torn_tail
    write_manifest_of(dataset_dir, settings, stats, len(failed), servers, extra, path=manifest)
    return report


def _ended_early(rec: Mapping[str, Any]) -> str | None:
    """Why an incomplete conversation ended before its last user turn (its ``stopped_by``: budget, failed,
    context, tool_mismatch), or None for one dropped because a turn was cut (length, an unclosed thinking block)."""
    if not rec["incomplete"] or record.is_truncated({**rec, "incomplete": False}):
        return None
    stopped_by = rec.get("stopped_by")
    if stopped_by in (record.LENGTH, record.REASONING_UNCLOSED):
        return None
    return str(stopped_by or "incomplete")


def _write_batch(fh: IO[str], batch: list[tuple[int, dict[str, Any]]], options: ExportOptions,
                 think: tuple[str, str], ids: _TokenIds | None, report: ExportReport, source: Path) -> None:
    """Write the rows of ``batch``'s records; with token ids, every turn's prompt is rendered again (one
    apply_chat_template call for the batch) and checked against the turn's digest first."""
    if not batch:
        return
    points: list[list[int]] = []
    for number, rec in batch:
        turns = rec["turns"]
        points.append(_points(rec, number, source))
        if options.format != "tokens" and len(turns) > 1 and not options.shape_chosen:
            raise ExportError(f"{source}:{number}: a conversation of {len(turns)} turns: SpecForge and speculators "
                              "train on multi-turn rows differently; say which reads the file: --for specforge "
                              "(one row per turn; train with train_only_last_turn) or --for speculators (one row "
                              "per conversation), or --per-turn / --whole (docs/export.md, \"Trainers\")")
        if options.token_ids and options.format != "tokens" and not options.rows_per_turn and len(turns) > 1:
            raise ExportError(f"{source}:{number}: {len(turns)} turns: --token-ids writes one prompt per row, so "
                              "a conversation of several turns needs --per-turn (or --format tokens)")
        if options.format != "tokens" and options.reasoning == "inline":
            for turn in turns:
                reasoning = turn.get("reasoning")
                if reasoning and think[1] in reasoning:
                    # Cannot happen with budgetq's split (reasoning ends at the first end marker); if it did, the
                    # inline text would be split elsewhere by every template: refuse rather than write another answer.
                    raise ExportError(f"{source}:{number}: reasoning contains {think[1]!r}: it cannot be inlined")
    checked: list[list[tuple[list[int], list[int]] | None]] = [[] for _ in batch]
    if ids is not None:
        prompts = ids.prompt_ids([prompt for _n, rec in batch
                                  for prompt in record.turn_prompts(rec["messages"], rec["turns"])],
                                 [rec.get("chat_template_kwargs") for _n, rec in batch for _turn in rec["turns"]],
                                 [rec.get("tools") for _n, rec in batch for _turn in rec["turns"]])
        k = 0
        for j, (number, rec) in enumerate(batch):
            for n, turn in enumerate(rec["turns"]):
                ids.check_vocabulary(turn.get("output_ids"), f"{source}:{number}: turns[{n}]")
                checked[j].append(_checked_turn(turn, prompts[k], rec["id"], report))
                k += 1
    for j, (_number, rec) in enumerate(batch):
        rows = _rows(rec, points[j], checked[j], options, think, ids, report)
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        report.written += len(rows)
        report.conversations += bool(rows)
        if ids is None and options.format != "tokens":
            report.unchecked += len(rows)


def _points(rec: Mapping[str, Any], number: int, source: Path) -> list[int]:
    """Where each turn of ``rec`` answers (budget.record); a record that does not fit is an error at its line."""
    try:
        return record.answer_points(rec["messages"], len(rec["turns"]))
    except record.HistoryError as exc:
        raise ExportError(f"{source}:{number}: {exc}") from None


def _checked_turn(turn: Mapping[str, Any], prompt: list[int] | None, rid: str,
                  report: ExportReport) -> tuple[list[int], list[int]] | None:
    """(prompt ids, output ids) of a turn whose re-rendered prompt is the one sent; None (counted) otherwise."""
    output = turn.get("output_ids")
    if output is None:
        report.no_output_ids += 1
        return None
    if prompt is None or not _same_prompt(prompt, turn):
        report.prompt_mismatch += 1
        if len(report.mismatched_ids) < _MAX_LISTED_IDS and rid not in report.mismatched_ids:
            report.mismatched_ids.append(rid)
        return None
    return prompt, list(output)


def _rows(rec: Mapping[str, Any], points: list[int], checked: list[tuple[list[int], list[int]] | None],
          options: ExportOptions, think: tuple[str, str], ids: _TokenIds | None,
          report: ExportReport) -> list[dict[str, Any]]:
    """The rows one record becomes; with token ids, only those of turns whose ids passed the check."""
    turns = rec["turns"]
    if options.format == "tokens":
        assert ids is not None
        return _token_rows(rec, checked, ids)
    if options.rows_per_turn:
        rows = turn_rows(rec, options.format, options.reasoning, think, points)
        indexed = list(enumerate(rows))
    else:
        rows = [conversation_row(rec, options.format, options.reasoning, think, points)]
        indexed = [(len(turns) - 1, rows[0])]  # token ids: one-turn records only (checked above)
    trained = _trained(rec, points, options, think) if ids is not None else None
    out = []
    for j, (i, row) in enumerate(indexed):
        if ids is not None and options.token_ids:
            pair = checked[i]
            if pair is None:
                continue
            row.update(input_ids=pair[0], output_ids=pair[1], template_hash=ids.template_hash,
                       tokenizer_revision=ids.revision)
        if trained is not None and ids is not None:
            verdict = _verdict(trained[j], turns, checked, ids, rec.get("tools"))
            if verdict is None:
                report.unchecked += 1
            elif not verdict:
                report.inexact += 1
                if len(report.inexact_ids) < _MAX_LISTED_IDS and rec["id"] not in report.inexact_ids:
                    report.inexact_ids.append(rec["id"])
                if options.inexact == "drop":
                    continue
                row["inexact"] = True
        out.append(row)
        for turn in ([turns[i]] if options.rows_per_turn else turns):
            exported_reasoning = None if options.reasoning == "drop" else turn.get("reasoning")
            if not turn["content"] and not exported_reasoning and not turn.get("tool_calls"):
                report.empty_turns += 1
    return out


def _token_rows(rec: Mapping[str, Any], checked: list[tuple[list[int], list[int]] | None],
                ids: _TokenIds) -> list[dict[str, Any]]:
    """--format tokens: one row of input_ids and loss_mask per turn whose ids passed the check."""
    out = []
    for i, pair in enumerate(checked):
        if pair is None:
            continue
        prompt, output = pair
        row: dict[str, Any] = {"id": rec["id"], **generation(rec), "turn": i, "input_ids": prompt + output,
                               "loss_mask": [0] * len(prompt) + [1] * len(output)}
        if record.is_truncated(rec):
            row["truncated"] = True
        row.update(template_hash=ids.template_hash, tokenizer_revision=ids.revision)
        out.append(row)
    return out


def _trained(rec: Mapping[str, Any], points: list[int], options: ExportOptions,
             think: tuple[str, str]) -> list[list[tuple[int, list[dict[str, Any]]]]]:
    """What the trainer renders for each turn of each row (producer/export/writer.py)."""
    return trained_conversations(rec["messages"], answers(rec, options.reasoning, think),
                                 [record.history_message(t) for t in rec["turns"]], points,
                                 per_turn=options.rows_per_turn, trainer=options.trainer)


def _verdict(trained: list[tuple[int, list[dict[str, Any]]]], turns: Sequence[Mapping[str, Any]],
             checked: list[tuple[list[int], list[int]] | None], ids: _TokenIds,
             tools: Sequence[Mapping[str, Any]] | None) -> bool | None:
    """Whether a row trains on exactly the generated ids, rendered with the record's ``tools`` as the trainers
    render the row; None when a turn has no server ids."""
    for i, conversation in trained:
        if turns[i].get("output_ids") is None:
            return None
        pair = checked[i]
        if pair is None or not is_exact(ids.plain, conversation, pair[0], pair[1], tools):
            return False
    return True


def _same_prompt(prompt: list[int], turn: Mapping[str, Any]) -> bool:
    """The re-rendered prompt is the one the turn was generated from: id by id through the digest the worker
    took of what it sent, or by length alone for a turn that has no digest."""
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
        #: a record's own chat_template_kwargs (--template-kwargs-mix) -> its Renderer
        self._renderers: dict[str, Renderer] = {}
        self.revision: str | None = settings.get("tokenizer")
        if self._renderer.fingerprint() != self.revision:
            # Same fingerprint as the producer's check on resume: template, vocabulary, special tokens, kwargs.
            raise ExportError("the tokenizer given is not the one the run used (its fingerprint differs from "
                              f"run.json's {self.revision!r}): token ids would not match the responses")
        self._tokenizer = tokenizer
        self.template_hash = template_hash(tokenizer)
        self.vocabulary = len(tokenizer)  # ids 0 .. len-1, added tokens included
        self.plain = Renderer(tokenizer)  # as the trainers render a row: without the run's template kwargs

    def check_vocabulary(self, output: Sequence[int] | None, where: str) -> None:
        """Refuse output ids the tokenizer does not have: they cannot be the model's (a server run with another
        tokenizer, or a simulator without one), and a trainer would index past its embedding."""
        bad = next((i for i in output or () if not 0 <= i < self.vocabulary), None)
        if bad is not None:
            raise ExportError(f"{where}: output_ids holds id {bad}, outside the tokenizer's {self.vocabulary}-id "
                              "vocabulary: these are not the ids of this tokenizer (was the server, or "
                              "sglang_sim without --tokenizer, running another one?)")

    def prompt_ids(self, conversations: list[list[dict[str, Any]]],
                   kwargs: Sequence[Mapping[str, Any] | None] | None = None,
                   tools: Sequence[Any] | None = None) -> list[list[int] | None]:
        """The run's own rendering (render/chat.py); None for a prompt the template now refuses. ``kwargs``: each
        conversation's own chat_template_kwargs (a record of a --template-kwargs-mix), None: the run's; ``tools``:
        each conversation's record's tools (None: none)."""
        each = list(tools) if tools is not None else [None] * len(conversations)
        if kwargs is None or all(k is None for k in kwargs):
            return self._render_all(self._renderer, conversations, each)
        groups: dict[str, list[int]] = {}
        for i, k in enumerate(kwargs):
            groups.setdefault("" if k is None else json.dumps(k, sort_keys=True), []).append(i)
        out: list[list[int] | None] = [None] * len(conversations)
        for key, at in groups.items():
            renderer = self._renderer if not key else self._renderer_for(key)
            rendered = self._render_all(renderer, [conversations[i] for i in at], [each[i] for i in at])
            for i, ids in zip(at, rendered, strict=True):
                out[i] = ids
        return out

    def _renderer_for(self, key: str) -> Renderer:
        if key not in self._renderers:
            try:
                self._renderers[key] = Renderer(self._tokenizer, chat_template_kwargs=json.loads(key))
            except RenderError as exc:
                raise ExportError(f"a record's chat_template_kwargs {key}: {exc}") from None
        return self._renderers[key]

    @staticmethod
    def _render_all(renderer: Renderer, conversations: list[list[dict[str, Any]]],
                    tools: list[Any]) -> list[list[int] | None]:
        try:
            return [r.input_ids for r in renderer.render_many(conversations, tools)]
        except RenderError:
            pass
        out: list[list[int] | None] = []
        for messages, one in zip(conversations, tools, strict=True):
            try:
                out.append(renderer.render(messages, one).input_ids)
            except RenderError:
                out.append(None)
        return out


#: OpenAI role -> ShareGPT "from". SpecForge's parser maps human/gpt back and passes system/tool through.
SHAREGPT_FROM: Final = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def assistant_turn(reasoning: str | None, content: str, mode: str, think: tuple[str, str],
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


def sharegpt_turn(message: Mapping[str, Any]) -> dict[str, Any]:
    """One message as a ShareGPT turn: ``from``/``value``, every other key kept as it is (``tool_calls``,
    ``reasoning_content``, ``tool_call_id``, ``name``). SpecForge and speculators both read ``from``/``value`` and
    keep ``tool_calls`` on the turn, which the chat template renders as the model wrote them; a null content (a
    turn that only calls tools) is ``""``, which templates render as null."""
    role = message.get("role")
    if role not in SHAREGPT_FROM:
        raise ExportError(f"message role {role!r} has no ShareGPT equivalent")
    content = message.get("content")
    turn: dict[str, Any] = {"from": SHAREGPT_FROM[str(role)], "value": content if isinstance(content, str) else ""}
    turn.update((key, value) for key, value in message.items() if key not in ("role", "content"))
    return turn


def answers(rec: Mapping[str, Any], reasoning_mode: str, think: tuple[str, str]) -> list[dict[str, Any]]:
    """Every regenerated turn as the assistant message the export writes (``--reasoning`` applied)."""
    out = []
    for t in rec["turns"]:
        reasoning = None if reasoning_mode == "drop" else t.get("reasoning")
        out.append(assistant_turn(reasoning, t["content"], reasoning_mode, think, t.get("tool_calls") or ()))
    return out


def _shaped(fmt: str, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    # Both formats under ``conversations``: the only key SpecForge's and speculators' loaders read.
    if fmt == "openai-messages":
        return {"conversations": [dict(m) for m in messages]}
    return {"conversations": [sharegpt_turn(m) for m in messages]}


def generation(rec: Mapping[str, Any]) -> dict[str, int]:
    """A row's ``generation`` (docs/generations.md), after its ``id``: the record's; none for a record
    without one."""
    return {"generation": int(rec["generation"])} if "generation" in rec else {}


def template_kwargs(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A row's ``chat_template_kwargs``: the record's own, which a --template-kwargs-mix drew for it (a trainer
    renders the row with them, e.g. gpt-oss's reasoning_effort); none for every other record (the run's)."""
    kwargs = rec.get("chat_template_kwargs")
    return {"chat_template_kwargs": kwargs} if kwargs is not None else {}


def record_tools(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A row's ``tools``: the tool definitions its prompts were rendered with (a trainer renders the row with
    them too); none for a record without any."""
    tools = rec.get("tools")
    return {"tools": tools} if tools else {}


def conversation_row(rec: Mapping[str, Any], fmt: str, reasoning_mode: str, think: tuple[str, str],
                     points: Sequence[int]) -> dict[str, Any]:
    """One conversation: the record's messages with every regenerated turn at its answer point (a one-turn
    record: the messages, then the turn)."""
    out: dict[str, Any] = {"id": rec["id"], **generation(rec)}
    out.update(_shaped(fmt, record.conversation(rec["messages"], answers(rec, reasoning_mode, think), points)))
    out.update(template_kwargs(rec))
    out.update(record_tools(rec))
    if record.is_truncated(rec):
        out["truncated"] = True
    return out


def turn_rows(rec: Mapping[str, Any], fmt: str, reasoning_mode: str, think: tuple[str, str],
              points: Sequence[int]) -> list[dict[str, Any]]:
    """``--per-turn``: one row per regenerated turn, its history exactly the messages its prompt was rendered
    from (earlier turns as budget.record.history_message: the template decides what of them it renders, as it
    did for the prompt), then the turn itself as the answer, ``--reasoning`` applied to it alone."""
    written = answers(rec, reasoning_mode, think)
    past = [record.history_message(t) for t in rec["turns"]]
    rows = []
    for i, answer in enumerate(written):
        row: dict[str, Any] = {"id": rec["id"], **generation(rec), "turn": i}
        row.update(_shaped(fmt, [*record.conversation(rec["messages"], past, points, upto=i), answer]))
        row.update(template_kwargs(rec))
        row.update(record_tools(rec))
        if record.is_truncated(rec):
            row["truncated"] = True
        rows.append(row)
    return rows


# Whether a conversation row trains on exactly what the model generated, rendered the way its trainer renders it.
#
# A row is exact when, for every turn it trains, the trainer's rendering of the row (or of the part it trains that
# turn on) starts with that turn's prompt ids, the ones the worker sent (checked by their digest), followed by the
# server's ``output_ids``: the trainer then supervises the model's own tokens, from the prompt's end. How each
# trainer renders a row (read from their source; tests/e2e/test_trainers.py runs both):
#
# - SpecForge renders a row whole and supervises its assistant spans; with ``train_only_last_turn`` (which
#   ``--for specforge`` rows need: one row per turn) only the last. A whole row (``--whole``) trains every turn on
#   the whole row's rendering, where templates that drop earlier turns' reasoning (Qwen3, GLM-4.5, DeepSeek-R1,
#   Kimi-K2) render the earlier turns without it: not exact.
# - speculators renders every assistant turn on its own prefix (the conversation through that turn) and
#   supervises each: a whole row (``--for speculators``) is exact turn by turn; a per-turn row would train its
#   history's turns again, so that combination is refused (producer/export/writer.py).
#
# Both render without budgetq's ``chat_template_kwargs`` (neither takes them from a row), so the check renders
# without them too; both render with the row's ``tools`` (the record's), so the check renders with them. The check needs the run's tokenizer (``produce export --tokenizer``); producer/export/writer.py counts
# the rows that fail it and leaves them out unless asked (``--inexact keep``).


#: The message keys speculators passes to the template (data_generation/preprocessing.py
#: ``_normalize_conversation``): a tool message's ``name`` is not one of them.
SPECULATORS_KEYS: Final = ("role", "content", "tool_calls", "tool_call_id", "reasoning_content")


def trained_conversations(messages: Sequence[Mapping[str, Any]], written: Sequence[Mapping[str, Any]],
                          past: Sequence[Mapping[str, Any]], points: Sequence[int], *, per_turn: bool,
                          trainer: str | None) -> list[list[tuple[int, list[dict[str, Any]]]]]:
    """For each row a record gives, the turns it trains and the messages its trainer renders for each: a
    per-turn row trains its last turn on the row itself; a whole row trains every turn, on the row (SpecForge)
    or on the conversation through that turn (speculators, and by default), each message with only the keys
    speculators keeps."""
    if trainer == "speculators":
        messages, written = [_speculators(m) for m in messages], [_speculators(m) for m in written]
    if per_turn:
        return [[(i, [*record.conversation(messages, past, points, upto=i), dict(written[i])])]
                for i in range(len(written))]
    if trainer == "specforge":
        whole = record.conversation(messages, written, points)
        return [[(i, whole) for i in range(len(written))]]
    return [[(i, [*record.conversation(messages, written, points, upto=i), dict(written[i])])
             for i in range(len(written))]]


def _speculators(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as speculators gives it to the template: content always (null as ""), the other keys it keeps
    only when they are not empty."""
    out = {"role": message["role"], "content": message.get("content") or ""}
    out.update((k, message[k]) for k in SPECULATORS_KEYS[2:] if message.get(k))
    return out


def is_exact(renderer: Renderer, conversation: list[dict[str, Any]], prompt: list[int],
             output: Sequence[int], tools: Sequence[Mapping[str, Any]] | None = None) -> bool:
    """The trainer's rendering of ``conversation`` (no generation prompt) starts with ``prompt`` + ``output``.
    ``tools``: the record's (the row's ``tools``), which both trainers pass to the chat template with the row
    (SpecForge's parsers: ``apply_chat_template(messages, tools=tools or None)``; speculators: the render
    request's ``tools``), as the prompt was rendered with them."""
    try:
        ids = renderer.render(conversation, tools or None, generation_prompt=False).input_ids
    except RenderError:
        return False
    want = [*prompt, *output]
    return ids[:len(want)] == want
