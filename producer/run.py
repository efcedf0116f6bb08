"""The attached producer: attach to (or start) a run, keep the queue topped up, recover dead chunks, collect.

One ``Producer`` per ``produce`` command. Its state is rebuilt from Redis and the output files every time it
attaches, so killing it (Ctrl-C, kill -9, a crash) loses nothing: the next ``produce`` with the same
arguments picks up where the run is.

Per loop step and dataset, in this order (the order is what keeps a sample from being enqueued twice):
1. reclaim chunks whose lease expired (their worker died);
2. snapshot the live chunks;
3. collect committed results onto disk (a commit always precedes its chunk leaving the live set, so any
   sample of a chunk missing from the snapshot is already collected or truly unfinished);
4. give the unfinished samples of chunks that left the live set back to the to-do list;
5. discard queued chunks if the dataset closed, else top the queue up to ``queue_depth`` chunks.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import redis

from budget.conversation import end_as_is
from budget.ledger import LEASE_MS, REDIS_DOWN, Ledger, default_prior_mean
from budget.outcomes import DatasetState, EndVerdict
from budget.payload import ConversationPayload, ThinkPayload
from budget.runstate import RunState
from producer.errors import ProduceError
from producer.enqueue import (BATCH_CHUNKS, COMPRESS_THREADS, Item, JobSettings, chunk_size_for, enqueue_chunks,
                              listening_workers, make_queue)
from producer.generations import SETTING as GENERATIONS, Generations, chunk_params, record_key, split_key
from producer.order import FILE, SETTING as ORDER
from producer.output import FAILED, RESULTS, RUN, STOPPED_BY_FAILED, ResultsFile, collect, write_failed
from producer.prepare import ALL, LAST, TURNS_SETTING, Prepared, Variants, resume_settings, settings_diff
from producer.progress import progress_bar

log = logging.getLogger("budgetq.produce")

LOCK_TTL_MS = 30_000
#: A chunk reclaimed this many times (its worker died each time it ran it) fails its unfinished samples:
#: a sample that kills workers must not kill them forever.
MAX_RECLAIMS = 3
#: A queued chunk whose RQ job ended without the chunk ever starting (a failed job, a worker killed between
#: dequeue and start) is checked this often and taken back.
STALE_CHECK_S = 5.0


def _less_generations(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings a rerun must keep: all but ``generations``, which may grow (``Producer._check_generations``)."""
    return {key: value for key, value in settings.items() if key != GENERATIONS}


def pid_alive(pid: int) -> bool:
    """Is a process with this pid running on this host? (EPERM: it exists, owned by someone else.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class RunOptions:
    out_dir: Path
    budgets: dict[str, int | None]  # explicit --budget per dataset; None: keep the stored one (or unlimited)
    sampling_params: dict[str, Any]
    settings: dict[str, Any]  # the run's fingerprinted settings (producer.prepare.run_settings)
    think: ThinkPayload | None
    reasoning_parser: str | None = None  # what settings["reasoning_parser"] says; None: the think-marker split
    parser_explicit: bool = False  # --reasoning-parser named it (not auto)
    order_explicit: bool = False  # --order or --order-seed given (not the default)
    turns_explicit: bool = False  # --turns given (not the default)
    #: ``--turns all``: what a chunk holding a multi-turn sample tells its worker (budget/payload.py), and the
    #: --tokenizer whose files are stored in Redis for the workers to render later turns with (attach, once).
    conversation: ConversationPayload | None = None
    tokenizer: str | None = None
    modes: dict[str, str | None] = field(default_factory=dict)  # --budget-mode; None: stored, else predict
    expect_mean: float | None = None  # prior completion length for predict before results arrive
    chunk_size: int = 256
    queue_depth: int = 16
    margin: float = 1.25  # just-in-time: hold this many times the samples the remaining budget needs
    new_run: bool = False
    job: JobSettings = field(default_factory=JobSettings)
    poll_s: float = 0.2
    progress_s: float = 5.0
    show_progress: bool = False  # a bar on stderr while --detach enqueues (produce: a terminal and not --quiet)
    #: --generations and what generation k sends differently (producer/generations.py); one generation: as ever.
    generations: Generations = field(default_factory=Generations)
    #: --template-kwargs-mix: the renderer of each drawn combination (producer/prepare.py Variants); None: no mix.
    variants: Variants | None = None


@dataclass
class DatasetRun:
    prepared: Prepared
    out: ResultsFile
    lock_token: str
    todo: deque[str]
    chunk_samples: dict[str, list[str]]
    done: set[str]
    failed: dict[str, dict[str, Any]] = field(default_factory=dict)
    reclaims: dict[str, int] = field(default_factory=dict)
    status: str = "open"
    used: int = 0
    budget: int | None = None
    finished: bool = False
    queued_seen: dict[str, float] = field(default_factory=dict)
    rate: deque[tuple[float, int]] = field(default_factory=deque)
    enqueued_samples: int = 0
    reasoning_parser: str | None = None  # None: a run stored before parsers, resumed with the think-marker split
    sampling_params: dict[str, Any] = field(default_factory=dict)  # what its chunks send (resume_settings)
    #: Conversations whose record on disk ended ``stopped_by: failed`` and that this run carries on (``reopen``):
    #: not done until their new record is collected, though the file holds an id for them.
    resuming: set[str] = field(default_factory=set)
    turns_committed: int = 0  # the stats' ``turns`` (commit_turn): turns of multi-turn conversations committed
    #: Closed: started conversations in the to-do list are looked for once (then only samples given back), since
    #: no worker may resume them; ``stranded`` are the ones a worker was still committing to when looked at.
    reclaim_turns: dict[str, int] = field(default_factory=dict)  # a conversation's turns at its last reclaim
    stranded_checked: bool = False
    stranded: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.prepared.name


@dataclass
class DatasetSummary:
    name: str
    status: str
    done: int
    selected: int
    tokens: int
    budget: int | None
    failed: dict[str, dict[str, Any]]
    not_run: int
    invalid: int
    duplicates: int
    over_context: int
    output: Path


class Producer:
    def __init__(self, client: "redis.Redis", datasets: list[Prepared], options: RunOptions,
                 echo: Callable[[str], None] = print) -> None:
        self.r = client
        self.ledger = Ledger(client)
        self.store = RunState(client)
        self.queue = make_queue(client)
        self.datasets = datasets
        self.opt = options
        self.echo = echo
        self.runs: list[DatasetRun] = []
        # Collector locks taken, by dataset: a dataset whose attach fails after its lock was taken is not in
        # ``runs`` yet, and its lock must still be released (else a rerun from another host waits out its TTL).
        self._locks: dict[str, str] = {}
        # A resumed dataset's settings: the run's, less what a run stored before they existed lacks (resume_settings)
        self.effective: dict[str, dict[str, Any]] = {}
        self._last_progress = 0.0
        self._last_stale_check = 0.0
        self._grace_until = 0.0
        self.epoch = ""

    # -- attach ----------------------------------------------------------------------------------------
    def attach(self) -> None:
        """Take every dataset's collector lock and rebuild its state. Nothing is enqueued yet.

        Every dataset's stored settings are checked before anything is written, so a refused rerun
        leaves Redis as it was."""
        if not self.opt.new_run:
            for prepared in self.datasets:
                stored = self._stored_settings(prepared.name, self.opt.out_dir / prepared.name)
                if stored is None:
                    continue
                settings, notes = resume_settings(stored, self._settings_for(stored))
                for note in notes:
                    self.echo(f"{prepared.name}: {note}")
                self.effective[prepared.name] = settings
                self._check_generations(prepared.name, stored, settings)
                if _less_generations(stored) != _less_generations(settings):
                    diff = "; ".join(settings_diff(_less_generations(stored), _less_generations(settings)))
                    raise ProduceError(
                        f"dataset {prepared.name}: this run's settings differ from the stored run ({diff}). "
                        "Use the same options to resume, or --new-run to start the dataset over "
                        "(its old output is kept aside).", 2)
        for prepared in self.datasets:
            self._check_turns(prepared)
        self._share_tokenizer()
        self.epoch = self.store.claim_epoch()
        try:
            for prepared in self.datasets:
                self.runs.append(self._attach_one(prepared))
        except BaseException:
            self.release()
            raise

    def _check_generations(self, name: str, stored: dict[str, Any], settings: dict[str, Any]) -> None:
        """More generations than the stored run extends it (new rounds; nothing made is made again); fewer is a
        settings change (exit 2): the records of the dropped rounds would stay in a run that no longer asks for
        them. A stored run without the key made one generation."""
        old, new = int(stored.get(GENERATIONS, 1)), int(settings.get(GENERATIONS, 1))
        if new < old:
            raise ProduceError(
                f"dataset {name}: this run's settings differ from the stored run (generations: stored {old}, now "
                f"{new}: fewer generations is a settings change). Give --generations {old} (or more) to resume, or "
                "--new-run to start the dataset over (its old output is kept aside).", 2)
        if new > old:
            self.echo(f"{name}: --generations {new} extends the stored run of {old}: generations {old}..{new - 1} "
                      "are new samples")

    def _turns_of(self, prepared: Prepared) -> str:
        """The --turns mode a dataset runs in: its stored run's (a run stored before --turns: ``last``), or
        this run's when it starts now."""
        if self.opt.new_run:
            return str(self.opt.settings.get(TURNS_SETTING, LAST))
        stored = self._stored_settings(prepared.name, self.opt.out_dir / prepared.name)
        settings = self.effective.get(prepared.name) or self._settings_for(stored)
        return str(settings.get(TURNS_SETTING, LAST))

    def _check_turns(self, prepared: Prepared) -> None:
        """The samples were prepared for the mode the run goes on in (prepare read run.json; Redis may hold a
        stored run whose run.json is gone, or another one)."""
        mode = self._turns_of(prepared)
        if prepared.turns_mode != mode:
            what = "every turn" if mode == ALL else "the last turn only"
            raise ProduceError(
                f"dataset {prepared.name}: the run stored in Redis regenerates {what} (--turns {mode}), but "
                f"{self.opt.out_dir / prepared.name / RUN} does not say so: give --turns {mode} to resume it, or "
                "--new-run to start the dataset over", 2)

    def _share_tokenizer(self) -> None:
        """A run with multi-turn conversations stores its tokenizer files in Redis once (bq:tok:{fingerprint}):
        GPU workers render the later turns with them (docs/multiturn.md). Refused files are an input error
        (exit 2), found before anything of the run is written."""
        if not any(p.turns and p.turns_mode == ALL for p in self.datasets):
            return
        from producer.tokenizer_files import ShareError, share_tokenizer
        if self.opt.tokenizer is None or self.opt.conversation is None:
            raise ProduceError("multi-turn conversations need the tokenizer directory and the conversation block "
                               "(RunOptions.tokenizer, RunOptions.conversation)", 2)
        try:
            stored = share_tokenizer(self.r, self.opt.tokenizer, self.opt.conversation["tokenizer"])
        except ShareError as exc:
            raise ProduceError(f"--turns all: {exc} (the workers render a conversation's later turns with the run's "
                               "tokenizer; --turns last regenerates only the last turn)", 2) from None
        if stored:
            self.echo(f"stored the tokenizer files in Redis for the workers ({stored} files)")

    def _settings_for(self, stored: dict[str, Any] | None) -> dict[str, Any]:
        """This run's settings for a dataset whose stored settings are `stored`.

        A run stored before reasoning parsers existed has no ``reasoning_parser``: it resumes with the
        think-marker split it started with (a new key is not a settings change), unless --reasoning-parser
        names a parser, which is one (the records would be split two ways in one file). A run stored before
        --order has no ``order``: it resumes in file order (producer/order.py), unless --order or --order-seed
        is given, which is a settings change (its selection so far is the file's first prompts). A run stored
        before --turns has no ``turns``: it resumes as ``last`` (what it did), unless --turns all is given, which is
        a settings change (its records so far answer the last turn only)."""
        settings = self.opt.settings
        if stored is not None and "reasoning_parser" not in stored and not self.opt.parser_explicit:
            settings = {key: value for key, value in settings.items() if key != "reasoning_parser"}
        if stored is not None and ORDER not in stored and not self.opt.order_explicit:
            settings = {key: value for key, value in settings.items() if key != ORDER}
        if stored is not None and TURNS_SETTING not in stored and (
                not self.opt.turns_explicit or settings.get(TURNS_SETTING) == LAST):
            settings = {key: value for key, value in settings.items() if key != TURNS_SETTING}
        return settings

    def _attach_one(self, p: Prepared) -> DatasetRun:
        out_dir = self.opt.out_dir / p.name
        stored = self._stored_settings(p.name, out_dir)
        settings = self.opt.settings if self.opt.new_run else self._settings_for(stored)
        if "reasoning_parser" in self.opt.settings and "reasoning_parser" not in settings:
            self.echo(f"{p.name}: stored before reasoning parsers: it resumes splitting on the think markers only "
                      "(--new-run to regenerate it with the parser)")
        token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        if not self._take_lock(p.name, token):
            raise ProduceError(f"dataset {p.name}: another produce is attached to it (it holds "
                               f"{self.store.collector_key(p.name)}); stop that one, or wait up to 30 s after it "
                               "died", 1)
        self._locks[p.name] = token
        if self.opt.new_run and (stored is not None or self.store.exists(p.name)):
            self._start_over(p.name, out_dir)
        if not self.opt.new_run:
            settings = self.effective.get(p.name, settings)  # less the sampling params a stored run predates
        self.store.register(p.name, json.dumps(settings, sort_keys=True), created_at=time.time())
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / RUN).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")

        explicit = self.opt.budgets.get(p.name)
        stored_budget = self.store.field(p.name, "budget")
        if explicit is not None:
            budget: int | None = explicit
        elif stored_budget:
            budget = int(stored_budget)
        else:
            budget = None
        mode = self.opt.modes.get(p.name) or self.store.field(p.name, "mode") or "predict"
        self.ledger.set_mode(p.name, mode, int(self.opt.sampling_params["max_new_tokens"]))
        self.ledger.set_budget(p.name, budget)

        out = ResultsFile(out_dir / RESULTS)
        if out.truncated_bytes:
            self.echo(f"{p.name}: cut a torn last line ({out.truncated_bytes} bytes) from {out.path}")
        if self.opt.expect_mean:
            self.ledger.set_prior(p.name, self.opt.expect_mean)
        elif out.tokens:
            self.ledger.set_prior(p.name, out.total_tokens / len(out.tokens))
        # Failed conversations on disk (a later turn failed every attempt) that Redis carries on already: reopened
        # by an earlier rerun (in convs), or ended again since (in the stream: a newer record to collect). Read in
        # that order: a conversation ending in between is in the stream. The file does not count for them.
        carried = set(self.ledger.conversation_turns(p.name, list(out.superseded)))
        newer = (self.store.result_ids(p.name) & set(out.superseded)) - carried if out.superseded else set()
        added, tokens = self.ledger.reconcile(
            p.name, [(sid, n) for sid, n in out.tokens.items() if sid not in carried and sid not in newer])
        if added:
            self.echo(f"{p.name}: counted {added} responses ({tokens} tokens) found in {out.path}")
        cleaned, turn_tokens = self.ledger.reconcile_turns(p.name, list(out.tokens))
        if cleaned:
            self.echo(f"{p.name}: {cleaned} conversations found in {out.path} still had committed turns in Redis "
                      f"({turn_tokens} tokens): dropped, the file counts them")
        resuming = carried | self._reopen_failed(p.name, out, skip=carried | newer)
        # Order matters: done first, then the stream. A commit landing in between is in both.
        done = self.ledger.done_ids(p.name)
        in_stream = self.store.result_ids(p.name)
        orphans = [sid for sid in done if sid not in out.tokens and sid not in in_stream]
        if orphans:
            removed, t = self.ledger.uncommit(p.name, orphans)
            self.echo(f"{p.name}: {removed} committed responses ({t} tokens) are neither in {out.path} nor in "
                      "Redis; they are uncounted and will be generated again")
            for sid in orphans:
                done.pop(sid, None)
        self.store.clear_failed(p.name)  # a rerun retries what failed before

        live = self.ledger.live_chunks(p.name)
        chunk_samples: dict[str, list[str]] = {}
        held: set[str] = set()
        for sid, cid in self.ledger.holders(p.name).items():
            if cid in live:
                chunk_samples.setdefault(cid, []).append(sid)
                held.add(sid)
        done_ids = (set(done) | set(out.tokens)) - resuming
        samples = p.samples
        if ORDER not in settings and ORDER in self.opt.settings and p.order.mode != FILE:
            # Stored before --order, found in Redis but not in run.json (which prepare looked at): file order.
            samples = sorted(p.samples, key=lambda s: s.line)
        # The to-do list: the selected samples in the run's order (producer/order.py), in rounds of generations
        # (producer/generations.py) - done - held by a live chunk.
        # A started conversation (in convs) is not done: unless a live chunk holds it, it is enqueued again and its
        # worker resumes it at the turn Redis has (docs/multiturn.md).
        keys = p.keys(samples)
        todo = deque(k for k in keys if k not in done_ids and k not in held)
        return DatasetRun(prepared=p, out=out, lock_token=token, todo=todo, chunk_samples=chunk_samples,
                          done=done_ids, budget=budget, reasoning_parser=settings.get("reasoning_parser"),
                          sampling_params=chunk_params(dict(settings.get("sampling_params")
                                                            or self.opt.sampling_params)),
                          resuming=resuming & set(keys))

    def _reopen_failed(self, name: str, out: ResultsFile, skip: set[str]) -> set[str]:
        """The failed conversations on disk (last record ``stopped_by: failed``) made committed-unwritten again
        (``reopen``), so this run resumes each at the turn that failed; returns their ids. One whose turns do not
        add up to what Redis counted for it stays as it is (a warning): it is not generated again."""
        reopened: set[str] = set()
        refused = []
        for sid, line in out.superseded.items():
            if sid in skip:
                continue
            verdict = self.ledger.reopen(name, sid, json.loads(line)["turns"])
            if verdict >= 0:  # 0: reopened already by a rerun that died before enqueueing it
                reopened.add(sid)
            else:
                refused.append(sid)
        if reopened:
            self.echo(f"{name}: {len(reopened)} conversations whose turn failed resume at that turn")
        if refused:
            self.echo(f"{name}: {len(refused)} failed conversations are not resumed: their turns in {out.path} do "
                      f"not add up to what Redis counted (first: {refused[0]})")
        return reopened

    def _take_lock(self, name: str, token: str) -> bool:
        """The dataset's collector lock; a lock left by a dead produce on this host is taken over at once
        instead of making the user wait for its TTL after a crash or kill -9."""
        if self.store.take_collector(name, token, LOCK_TTL_MS):
            return True
        holder = self.store.collector_holder(name)
        if holder is None:
            return self.store.take_collector(name, token, LOCK_TTL_MS)
        host, _, rest = holder.partition(":")
        pid = rest.partition(":")[0]
        if host != socket.gethostname() or not pid.isdigit() or pid_alive(int(pid)):
            return False
        self.store.release_collector(name, holder)
        if self.store.take_collector(name, token, LOCK_TTL_MS):
            self.echo(f"took over {self.store.collector_key(name)} from produce pid {pid}, which is no longer "
                      "running")
            return True
        return False

    def _stored_settings(self, name: str, out_dir: Path) -> dict[str, Any] | None:
        raw = self.store.field(name, "settings")
        if raw:
            return dict(json.loads(raw))
        run_file = out_dir / RUN
        if run_file.exists():
            return dict(json.loads(run_file.read_text()))
        return None

    def _start_over(self, name: str, out_dir: Path) -> None:
        """--new-run: close and forget the dataset's stored run; keep its files aside, never delete them."""
        self.ledger.close(name)
        self.ledger.discard(name, "replaced by --new-run")
        self.store.forget(name)
        if out_dir.exists() and any(out_dir.iterdir()):
            aside = out_dir.parent / f"{name}.previous-{time.strftime('%Y%m%d-%H%M%S')}"
            out_dir.rename(aside)
            self.echo(f"{name}: --new-run: previous output moved to {aside}")
        out_dir.mkdir(parents=True, exist_ok=True)

    # -- the loop --------------------------------------------------------------------------------------
    def run(self, detach: bool = False) -> list[DatasetSummary]:
        try:
            if detach:
                self._enqueue_all()
                return self.summaries()
            while True:
                try:
                    if self.step():
                        break
                    self._wait()
                except REDIS_DOWN as exc:
                    self._ride_out_outage(exc)
            return self.summaries()
        finally:
            self.release()

    def _enqueue_all(self) -> None:
        """--detach: enqueue what each dataset's budget needs (everything when unbudgeted), batch by batch."""
        plan = []
        for d in self.runs:
            state = self.ledger.state(d.name)
            d.status = state.status
            if state.has_room():
                plan.append((d, self._samples_needed(d, state, everything=True)))
        bar = progress_bar(sum(min(n, len(d.todo)) for d, n in plan), "enqueueing", show=self.opt.show_progress)
        try:
            for d, n in plan:
                self._refill(d, max_samples=n, progress=bar.update)
        finally:
            bar.close()

    def _ride_out_outage(self, exc: Exception) -> None:
        """Wait for Redis to come back, check it still holds this run's state, then go on. Leases that ran out
        during the outage are not reclaimed for one lease period: their workers are alive and refresh them as
        soon as they reach Redis again (reclaiming them would redo their GPU work)."""
        self.echo(f"Redis unavailable ({exc}); waiting for it to come back")
        delay = 0.2
        while True:
            time.sleep(delay)
            try:
                self.r.ping()
                break
            except REDIS_DOWN:
                delay = min(5.0, delay * 2)
        self.echo("Redis is back")
        self._grace_until = time.monotonic() + LEASE_MS / 1000 + 5

    def _wait(self) -> None:
        # Wake up as soon as a result arrives, or after poll_s to look after leases and the queue.
        self.store.wait_for_results([d.name for d in self.runs if not d.finished], int(self.opt.poll_s * 1000))

    def step(self) -> bool:
        self._check_epoch()
        now = time.monotonic()
        check_stale = now - self._last_stale_check >= STALE_CHECK_S
        if check_stale:
            self._last_stale_check = now
        for d in self.runs:
            if d.finished and check_stale and d.todo and self.ledger.state(d.name).has_room():
                d.finished = False  # its budget was raised (produce budget): top it up again
                self.echo(f"{d.name}: reopened")
            if not d.finished:
                self._step_one(d, check_stale)
        if now - self._last_progress >= self.opt.progress_s:
            self._last_progress = now
            self.echo(self.progress_line())
        return all(d.finished for d in self.runs)

    def _check_epoch(self) -> None:
        now = self.store.epoch()
        if now != self.epoch:
            raise ProduceError("Redis lost this run's state (it restarted empty or from another snapshot: "
                               f"{self.store.EPOCH_KEY} is {'gone' if now is None else 'different'}). Nothing on disk is "
                               "lost: run the same produce command again to rebuild the counters from the output "
                               "files.", 1)

    def _step_one(self, d: DatasetRun, check_stale: bool) -> None:
        if not self.store.refresh_collector(d.name, d.lock_token, LOCK_TTL_MS) \
                and not self.store.take_collector(d.name, d.lock_token, LOCK_TTL_MS):
            raise ProduceError(f"dataset {d.name}: lost the collector lock (another produce took over after this "
                               "one stalled for 30 s)", 1)
        reclaimed: set[str] = set()
        if time.monotonic() >= self._grace_until:
            reclaimed = set(self.ledger.reclaim(d.name))
            if check_stale:
                reclaimed |= self._reclaim_stale_queued(d)
        for cid in sorted(reclaimed):
            self.echo(f"{d.name}: chunk {cid} lost its worker; its unfinished samples go back in the queue")
        live = self.ledger.live_chunks(d.name)
        messages = d.prepared.messages_by_id
        for rec in collect(self.store, d.name, d.out, lambda sid: messages.get(split_key(sid)[0])):
            d.rate.append((time.monotonic(), int(rec["completion_tokens"])))
            d.resuming.discard(record_key(rec))
        # What is on disk is done, including results a failed collect wrote before Redis could drop them (but not
        # the old record of a failed conversation this run carries on).
        d.done.update(d.out.tokens.keys() - d.done - d.resuming)
        ended = [cid for cid in d.chunk_samples if cid not in live]
        back: list[str] = []
        if ended:
            d.failed = self.ledger.failed(d.name)
            for cid in ended:  # in enqueue order
                back.extend(self._release(d, cid, cid in reclaimed))
            # To the front: every sample of a chunk came before the whole to-do list in the run's order, so a
            # budget still keeps the first prompts of the order (producer/order.py).
            d.todo.extendleft(reversed(back))
        state = self.ledger.state(d.name)
        if state.used < d.out.total_tokens:
            raise ProduceError(f"dataset {d.name}: Redis counts {state.used} tokens but {d.out.path} already holds "
                               f"{d.out.total_tokens}: Redis went back to an older state. Nothing on disk is lost: "
                               "run the same produce command again to recount from the output files.", 1)
        d.status, d.used = state.status, state.used
        d.turns_committed = int(state.stats.get("turns", 0) or 0)
        self.store.set_progress(d.name, selected=d.prepared.selected, todo=len(d.todo))
        if state.status != "open":
            if state.queued_chunks or state.discards_to_mark:
                self.ledger.discard(d.name, "budget reached")
            if d.prepared.conversations:
                self._end_stranded(d, back if ended else [])
        elif d.todo and state.queued_chunks < self.opt.queue_depth and state.has_room():
            self._refill(d, max_chunks=self.opt.queue_depth - state.queued_chunks,
                         max_samples=self._samples_needed(d, state))
        if (state.status != "open" or not d.todo) and not d.chunk_samples and not live \
                and self.store.unwritten(d.name) == 0:
            d.failed = self.ledger.failed(d.name)
            write_failed(self.opt.out_dir / d.name / FAILED, d.failed)
            d.finished = True

    def _end_stranded(self, d: DatasetRun, released: list[str]) -> None:
        """End, with the turns they have (``stopped_by: budget``), the started conversations of a closed dataset
        that no live chunk holds: a closed dataset starts no chunk, so none may resume them (their worker died,
        or gave them back, after the close). Their committed turns are counted; this puts them on disk.
        docs/multiturn.md, failure cases."""
        if d.stranded_checked:
            candidates = list(d.stranded) + [sid for sid in released if sid not in d.stranded]
        else:
            candidates = list(d.todo)
            d.stranded_checked = True
        if not candidates:
            return
        started = self.ledger.conversation_turns(d.name, candidates)
        if not started:
            return
        messages = d.prepared.messages_by_id
        ended = 0
        for sid in started:
            params, kwargs = self._sent_with(d, sid)
            outcome = end_as_is(self.ledger, d.name, sid, messages[split_key(sid)[0]],
                                reasoning_parser=d.reasoning_parser, sampling_params=params,
                                chat_template_kwargs=kwargs)
            if outcome is not None and outcome.verdict is EndVerdict.MISMATCH:
                d.stranded.add(sid)  # a worker still commits to it (a zombie): look again next step
                continue
            d.stranded.discard(sid)
            ended += 1
        if ended:
            gone = set(started) - d.stranded
            d.todo = deque(sid for sid in d.todo if sid not in gone)
            self.echo(f"{d.name}: {ended} started conversations ended with the turns they have (stopped_by budget): "
                      "the dataset closed after the worker carrying them stopped")

    def _sent_with(self, d: DatasetRun, sid: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """What sample ``sid``'s turns were sent with, for a record the producer writes in a worker's stead: the
        chunks' sampling parameters with its generation's override, and the template kwargs it drew (None: the
        run's)."""
        pid, generation = split_key(sid)
        params = d.sampling_params or self.opt.sampling_params
        params = {**params, **(self.opt.generations.overrides(pid, generation) or {})}
        variants = self.opt.variants
        return params, variants.kwargs(variants.name(pid, generation)) if variants is not None else None

    def _release(self, d: DatasetRun, cid: str, reclaimed: bool) -> list[str]:
        """The chunk's samples that go back to the to-do list (not done, not failed by now)."""
        back: list[str] = []
        samples = [sid for sid in d.chunk_samples.pop(cid, []) if sid not in d.done and sid not in d.failed]
        # A conversation that committed a turn since its last reclaim made progress: not a sample that kills its
        # worker, so its count starts again (a long conversation may outlive several workers that die for other
        # reasons, as bench.chaos worker-kill-turns kills one every 5 s).
        started = self.ledger.conversation_turns(d.name, samples) if reclaimed and d.prepared.conversations else {}
        for sid in samples:
            if reclaimed:
                if started.get(sid, 0) > d.reclaim_turns.get(sid, 0):
                    d.reclaims[sid] = 0
                    d.reclaim_turns[sid] = started[sid]
                d.reclaims[sid] = d.reclaims.get(sid, 0) + 1
                if d.reclaims[sid] >= MAX_RECLAIMS:
                    why = f"its chunk lost its worker {MAX_RECLAIMS} times"
                    if started.get(sid):
                        # Its committed turns are counted: they go to the file as a conversation that failed
                        # (a rerun reopens it at the failed turn), never left in Redis unwritten.
                        params, kwargs = self._sent_with(d, sid)
                        outcome = end_as_is(self.ledger, d.name, sid, d.prepared.messages_by_id[split_key(sid)[0]],
                                            reasoning_parser=d.reasoning_parser, sampling_params=params,
                                            stopped_by=STOPPED_BY_FAILED, failed_reason=why,
                                            chat_template_kwargs=kwargs)
                        if outcome is not None and outcome.verdict is not EndVerdict.MISMATCH:
                            continue
                    else:
                        reason = {"id": sid, "reason": why, "status": None}
                        if self.ledger.fail(d.name, sid, cid, reason):
                            d.failed[sid] = reason
                            continue
            back.append(sid)
        return back

    def _reclaim_stale_queued(self, d: DatasetRun) -> set[str]:
        """Queued chunks whose RQ job is gone or ended without starting the chunk, or that a worker popped and
        has not started for three leases (it died between dequeue and start). The decision is one script
        (``Ledger.reclaim_queued``): a chunk a worker starts meanwhile is not taken back."""
        now = time.monotonic()
        overdue = [cid for cid, first in d.queued_seen.items() if now - first > 3 * LEASE_MS / 1000]
        stale, popped = self.ledger.reclaim_queued(d.name, overdue)
        d.queued_seen = {cid: d.queued_seen.get(cid, now) for cid in popped}
        return set(stale)

    def _samples_needed(self, d: DatasetRun, state: DatasetState, everything: bool = False) -> int:
        """Just in time: how many more samples to hand out now. Unbudgeted (or --detach without a budget):
        everything. Budgeted: enough to fill what the budget still has room for, at the mean completion length
        seen so far, times a margin, plus one chunk, minus what live chunks already hold."""
        if state.budget is None:
            return len(d.todo)
        room = max(0, state.budget - state.used - state.reserved)
        mean = state.used / state.done if state.done else self._prior_mean(d.name)
        needed = math.ceil(room / max(mean, 1.0) * self.opt.margin) + self.opt.chunk_size
        held = sum(1 for ids in d.chunk_samples.values() for sid in ids if sid not in d.done)
        return max(0, needed - held) if not everything else max(0, needed)

    def _prior_mean(self, name: str) -> float:
        raw = self.store.field(name, "prior_mean")
        if raw:
            return float(raw)
        return default_prior_mean(int(self.opt.sampling_params["max_new_tokens"]))

    def _refill(self, d: DatasetRun, max_chunks: int | None = None, max_samples: int | None = None,
                progress: Callable[[int], None] | None = None) -> None:
        """Enqueue up to ``max_chunks`` chunks holding up to ``max_samples`` of ``d``'s to-do samples.

        In batches of ``BATCH_CHUNKS`` chunks, each one MULTI/EXEC (all of it or none): a ``--detach`` of a
        whole dataset never holds more than one batch's payloads, and a produce killed between batches leaves
        whole batches, which its rerun finds live and does not enqueue again. Chunk data is compressed in a
        small thread pool while this thread serializes and builds the jobs (producer/enqueue.py)."""
        with ThreadPoolExecutor(COMPRESS_THREADS, thread_name_prefix="bq-zlib") as pool:
            for chunks in self._batches(d, max_chunks, max_samples):
                try:
                    cids = enqueue_chunks(self.r, self.queue, d.name, chunks,
                                          sampling_params=d.sampling_params or self.opt.sampling_params,
                                          think=self.opt.think, settings=self.opt.job, compress=pool,
                                          reasoning_parser=d.reasoning_parser, conversation=self.opt.conversation)
                except BaseException:
                    # Not enqueued (or, after a lost EXEC reply, perhaps enqueued): the samples go back to the
                    # front of the to-do list either way. Enqueued twice is harmless: the holder hash names the
                    # newer chunk, so the older one's admits are refused, and done samples are skipped.
                    d.todo.extendleft(reversed([it.id for items in chunks for it in items]))
                    raise
                n = 0
                for cid, items in zip(cids, chunks):
                    d.chunk_samples[cid] = [it.id for it in items]
                    n += len(items)
                d.enqueued_samples += n
                if progress is not None:
                    progress(n)

    def _batches(self, d: DatasetRun, max_chunks: int | None, max_samples: int | None) -> Iterator[list[list[Item]]]:
        """Pop ``d``'s to-do samples into chunks, one batch at a time: only the batch being sent exists as Items.
        Each chunk's size is ``chunk_size_for`` the to-do left (producer/enqueue.py): --chunk-size at most.
        Items keep the prepared ``array``s; their JSON is written from the arrays (no Python int per token)."""
        p = d.prepared
        workers = listening_workers(self.queue)
        samples = len(d.todo) if max_samples is None else max_samples
        chunks_left = max_chunks
        while d.todo and samples > 0 and (chunks_left is None or chunks_left > 0):
            n_chunks = BATCH_CHUNKS if chunks_left is None else min(BATCH_CHUNKS, chunks_left)
            chunks: list[list[Item]] = []
            while d.todo and samples > 0 and len(chunks) < n_chunks:
                # --chunk-size is a maximum: chunks shrink as the to-do list runs out (no idle tail)
                size = chunk_size_for(len(d.todo), self.opt.chunk_size, workers)
                ids = [d.todo.popleft() for _ in range(min(size, len(d.todo), samples))]
                samples -= len(ids)
                chunks.append([self._item(p, sid) for sid in ids])
            if chunks_left is not None:
                chunks_left -= len(chunks)
            yield chunks

    def _item(self, p: Prepared, key: str) -> Item:
        """The sample ``key``: its prompt's rendering, and what its generation sends differently from the chunk
        (its sampling parameters; with a template kwargs mix, the kwargs it drew and their rendering)."""
        pid, generation = split_key(key)
        overrides = self.opt.generations.overrides(pid, generation)
        turns = p.turns_of(pid)
        ids, opens = p.input_ids[pid], p.opens_think[pid]
        kwargs: dict[str, Any] | None = None
        fingerprint: str | None = None
        variants = self.opt.variants
        if variants is not None:
            name = variants.name(pid, generation)
            ids, opens = p.variant_ids[name][pid], p.variant_opens[name][pid]
            kwargs = variants.kwargs(name)
            fingerprint = variants.fingerprint(name) if turns > 1 else None
        if turns == 1:
            return Item(key, ids, opens, sampling_params=overrides, chat_template_kwargs=kwargs)
        return Item(key, ids, opens, messages=p.messages_by_id[pid], turns=turns, sampling_params=overrides,
                    chat_template_kwargs=kwargs, tokenizer=fingerprint)

    # -- reporting -------------------------------------------------------------------------------------
    def progress_line(self) -> str:
        parts = []
        now = time.monotonic()
        for d in self.runs:
            while d.rate and now - d.rate[0][0] > 60:
                d.rate.popleft()
            span = now - d.rate[0][0] if d.rate else 0.0
            tps = sum(n for _, n in d.rate) / span if span > 1 else 0.0
            budget = f"{d.used}/{d.budget}" if d.budget is not None else f"{d.used}/unlimited"
            eta = ""
            if tps > 0 and d.budget is not None and d.used < d.budget:
                eta = f" eta {int((d.budget - d.used) / tps)}s"
            state = "done" if d.finished else d.status
            turns = ""
            if d.prepared.conversations or d.turns_committed:  # --turns all: multi-turn conversations' turns
                p = d.prepared
                ended = sum(1 for sid in d.done if p.turns_of(sid) > 1)
                turns = f" conversations {ended}/{p.conversations} turns {d.turns_committed}/{p.conversation_turns}"
            parts.append(f"{d.name}: {state} tokens {budget} samples {len(d.done)}/{d.prepared.selected}{turns} "
                         f"{tps:.0f} tok/s{eta}")
        return " | ".join(parts)

    def summaries(self) -> list[DatasetSummary]:
        out = []
        for d in self.runs:
            p = d.prepared
            closed = d.status == "closed"
            keys = p.keys()
            complete = all(k in d.done or k in d.failed for k in keys)
            status = "complete" if complete else ("budget reached" if closed else
                                                  ("running (detached)" if d.chunk_samples else "incomplete"))
            not_run = sum(1 for k in keys if k not in d.done and k not in d.failed)
            out.append(DatasetSummary(
                name=d.name, status=status, done=len(d.done), selected=p.selected, tokens=d.used,
                budget=d.budget, failed=d.failed, not_run=not_run, invalid=len(p.invalid),
                duplicates=len(p.duplicates), over_context=len(p.over_context),
                output=self.opt.out_dir / d.name / RESULTS))
        return out

    def release(self) -> None:
        for name, token in self._locks.items():
            try:
                self.store.release_collector(name, token)
            except redis.RedisError:
                pass  # it expires by itself
        self._locks.clear()
        for d in self.runs:
            d.out.close()
