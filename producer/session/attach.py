"""Attach the producer to its datasets' runs: take each dataset's collector lock, check the stored settings, and
rebuild each dataset's state (``DatasetRun``) from Redis and the output files. Nothing is enqueued here; the loop
(producer/session/loop.py) does that.

Every time ``produce`` starts, for each dataset (docs/architecture.md, "Attach"):
1. refuse a rerun whose settings differ from the stored run, or whose ``--out`` resolves to another directory
   than the stored one (exit 2, unless ``--new-run``), before anything is written, so a refused rerun leaves Redis as it was; a multi-turn run stores its tokenizer files for the
   workers (``share_tokenizer``);
2. take the dataset's collector lock (a lock left by a dead ``produce`` on this host is taken over at once);
3. register the run's settings (Redis and ``run.json``) and its resolved ``--out``, set the budget (a rerun
   giving the last run's ``--budget`` again keeps one ``produce budget`` set since) and the mode;
4. open the output file (cutting a torn last line), count the responses on disk that Redis lost, uncount those
   Redis counted that exist nowhere (they are generated again), reopen failed conversations;
5. compute the to-do list: the selected samples in the run's order - done - held by a live chunk.

What the attached producer is told is a ``RunOptions``; what it knows of each dataset, a ``DatasetRun``: rebuilt
here by every attach, kept up to date by the loop and read by the report (producer/ops/status.py). A killed
``produce`` loses only what it counts in memory: a sample's reclaims (``MAX_RECLAIMS``, counted from 0 again) and
when it saw a chunk queued.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import redis

from budget import runstate
from budget.ledger import Ledger, Mix
from budget.record import OTHER_VERSION, VERSION, ConversationPayload
from budget.runstate import RunState
from producer.errors import ProduceError, UsageError
from producer.generations import SETTING as GENERATIONS
from producer.prepare import Prepared
from producer.results import RESULTS, RUN, ResultsFile, check_version
from producer.settings import VERSION_KEY, Budget, budget_limit, run_json, settings_diff, without_location
from render import tokfiles
from render.chat import ChatTemplate
from render.modeldir import ModelDirError, resolve_tokenizer

#: The collector lock's time to live: the loop refreshes it every step, so another ``produce`` may take a dataset
#: over this long after its collector died or stalled (at once when it died on the same host: ``pid_alive``).
LOCK_TTL_MS = 30_000


@dataclass(frozen=True)
class JobSettings:
    """What RQ keeps of each chunk job the loop enqueues."""

    job_timeout: int = 6 * 3600  # a chunk's whole run; liveness is the lease, not this
    result_ttl: int = 24 * 3600  # how long finished chunks stay visible in rq-dashboard
    failure_ttl: int = 7 * 24 * 3600  # always explicit: RQ's failure stream never expires otherwise


@dataclass(frozen=True)
class RunOptions:
    """What the attached producer is told: where it writes, each dataset's budget and mode as given, how it sizes
    and paces its chunks, what a chunk of a multi-turn sample tells its worker. What a dataset is rendered, sent
    and stored with is its ``Prepared.settings`` (producer/settings.py ``DatasetSettings``)."""

    out_dir: Path
    budgets: Mapping[str, Budget | None]  # explicit --budget per dataset (or UNLIMITED); None: keep the stored one
    modes: Mapping[str, str | None] = field(default_factory=dict)  # --budget-mode; None: stored, else predict
    expect_mean: float | None = None  # prior completion length for predict before results arrive
    chunk_size: int = 256
    queue_depth: int = 16
    margin: float = 1.25  # just-in-time: hold this many times the samples the remaining budget needs
    new_run: bool = False
    job: JobSettings = field(default_factory=JobSettings)
    poll_s: float = 0.2
    progress_s: float = 5.0
    show_progress: bool = False  # a bar on stderr while --detach enqueues (produce: a terminal and not --quiet)
    #: ``--turns all``: what a chunk holding a multi-turn sample tells its worker (budget/record.py; built by
    #: producer/prepare.py ``Inputs.conversation``); None: no dataset has one.
    conversation: ConversationPayload | None = None
    #: --budget TOTAL --mix ...: the mix as given (budget/ledger.py); None: no --mix (a stored mix still applies).
    mix: Mix | None = None
    #: --no-mix-pacing: let a mix's members progress at whatever rate their chunks are pulled (for comparison).
    mix_pacing: bool = True
    #: --deadline / --for, unix seconds (None: keep the stored one, if any).
    deadline: float | None = None


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
    closed_by: str = ""  # "deadline" when the deadline closed it (the admit script's meta closed_by)
    deadline: float | None = None  # its deadline as last read (the meta's deadline, unix s); None: none
    used: int = 0
    budget: int | None = None
    finished: bool = False
    queued_seen: dict[str, float] = field(default_factory=dict)
    #: The dataset's stats hash as last read (``DatasetState.stats``): its 10-second token buckets give the progress
    #: line's tok/s, the one ``produce status`` shows (producer/ops/status.py ``tokens_per_second``).
    stats: dict[str, str] = field(default_factory=dict)
    enqueued_samples: int = 0
    #: How many samples at the front of ``todo`` came back from ended chunks: they go to the front of the RQ queue
    #: too, ahead of chunks of later samples enqueued meanwhile (producer/session/loop.py ``_batches``).
    returned: int = 0
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



def _less_generations(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings a rerun must keep: all but ``generations``, which may grow (``Attacher._check_generations``)."""
    return {key: value for key, value in settings.items() if key != GENERATIONS}


def _shown(budget: int | None) -> str:
    return "unlimited" if budget is None else f"{budget:,}"


def pid_alive(pid: int) -> bool:
    """Is a process with this pid running on this host? (EPERM: it exists, owned by someone else.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_out_dir(store: RunState, names: Iterable[str], out_dir: Path) -> None:
    """Refuse (exit 2) a rerun whose ``--out`` resolves to another directory than the one the dataset's run
    recorded in Redis: ``--out`` is relative to the current directory, and a rerun from elsewhere (or a typo)
    found no output there, generated every sample again and left the first run's tokens out of the budget.
    Read-only: called before anything is written (``--new-run`` starts the dataset over, so it skips this)."""
    here = out_dir.resolve()
    for name in sorted(names):
        stored = store.field(name, "out_dir")
        if stored and Path(stored) != here:
            raise ProduceError(
                f"dataset {name}: its run writes to {stored} (recorded in Redis), but this run's --out {out_dir} is "
                f"{here}. Rerun with --out {stored} to resume it (what is there counts toward the budget), or "
                "--new-run to start the dataset over in this --out", 2)


def holder_text(holder: str | None) -> str:
    """Who holds a collector lock, from its token (``host:pid:uuid``, written by ``Attacher.attach_one``)."""
    if holder is None:
        return "a produce that just released it"
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    return f"produce pid {pid} on {host}" if host and pid.isdigit() else f"token {holder!r}"


def share_tokenizer(client: "redis.Redis", tokenizer: str | Path, fingerprint: str,
                    chat_template: ChatTemplate | None = None) -> int:
    """Store the tokenizer files of ``tokenizer`` (``--tokenizer``: a directory, or a hub id's cached snapshot)
    under ``fingerprint`` (the run's ``Renderer.fingerprint()``), for the workers that render a conversation's
    later turns (worker/turns.py loads them and checks the fingerprint; a GPU host has no
    ``--tokenizer``); a ``--chat-template`` goes as their chat_template.jinja. Returns the files newly stored (0: stored by an earlier run). Raises UsageError (exit 2)
    naming the directory (missing files, over the size limit)."""
    try:
        return runstate.store_files(client, fingerprint, tokfiles.pack(
            resolve_tokenizer(tokenizer), chat_template=None if chat_template is None else chat_template.text))
    except (ModelDirError, tokfiles.TokenizerFilesError, runstate.TokenizerStoreError) as exc:
        raise UsageError(f"--turns all: cannot share the tokenizer with the workers: {exc} (the workers render a "
                         "conversation's later turns with the run's tokenizer; --turns last regenerates only the "
                         "last turn)") from None


class Attacher:
    """One attach of a ``produce`` to its datasets (``Producer.attach`` drives it). ``locks`` is the producer's own
    dict of the collector locks taken, by dataset: a dataset whose attach fails after its lock was taken must
    still have it released (else a rerun from another host waits out its TTL)."""

    def __init__(self, client: "redis.Redis", ledger: Ledger, store: RunState, options: RunOptions,
                 echo: Callable[[str], None], locks: dict[str, str]) -> None:
        self.r = client
        self.ledger = ledger
        self.store = store
        self.opt = options
        self.echo = echo
        self.locks = locks
        #: The budget of each dataset in a mix: its share (budget/ledger.py), set by ``Producer.attach`` first.
        self.shares: dict[str, int] = {}

    def check(self, datasets: list[Prepared]) -> None:
        """Every dataset's stored settings, checked before anything is written, so a refused rerun leaves Redis as
        it was (exit 2): a run or a record of another format, or other settings; then a multi-turn run's tokenizer files are
        stored for the workers."""
        if not self.opt.new_run:
            check_out_dir(self.store, [p.name for p in datasets], self.opt.out_dir)
            for prepared in datasets:
                check_version(self.opt.out_dir / prepared.name / RESULTS)
                stored = self._stored_settings(prepared.name, self.opt.out_dir / prepared.name)
                if stored is None:
                    continue
                if stored.get(VERSION_KEY) != VERSION:
                    raise ProduceError(f"dataset {prepared.name}: the stored run was {OTHER_VERSION}", 2)
                settings = dict(prepared.settings.stored)
                self._check_generations(prepared.name, stored, settings)
                if _less_generations(stored) != _less_generations(settings):
                    diff = "; ".join(settings_diff(_less_generations(stored), _less_generations(settings)))
                    raise ProduceError(
                        f"dataset {prepared.name}: this run's settings differ from the stored run ({diff}). "
                        "Use the same options to resume, or --new-run to start the dataset over "
                        "(its old output is kept aside).", 2)
        self._share_tokenizer(datasets)

    def _check_generations(self, name: str, stored: dict[str, Any], settings: dict[str, Any]) -> None:
        """More generations than the stored run extends it (new rounds; nothing made is made again); fewer is a
        settings change (exit 2): the records of the dropped rounds would stay in a run that no longer asks for
        them. No ``generations`` key: one generation."""
        old, new = int(stored.get(GENERATIONS, 1)), int(settings.get(GENERATIONS, 1))
        if new < old:
            raise ProduceError(
                f"dataset {name}: this run's settings differ from the stored run (generations: stored {old}, now "
                f"{new}: fewer generations is a settings change). Give --generations {old} (or more) to resume, or "
                "--new-run to start the dataset over (its old output is kept aside).", 2)
        if new > old:
            self.echo(f"{name}: --generations {new} extends the stored run of {old}: generations {old}..{new - 1} "
                      "are new samples")

    def _share_tokenizer(self, datasets: list[Prepared]) -> None:
        """A run with multi-turn conversations stores its tokenizer files in Redis once (bq:tok:{fingerprint}):
        GPU workers render the later turns with them (docs/multiturn.md). Refused files are an input error
        (exit 2), found before anything of the run is written."""
        multi = next((p.settings for p in datasets if p.conversations), None)
        if multi is None:
            return
        if self.opt.conversation is None:
            raise ProduceError("multi-turn conversations need their chunks' conversation block "
                               "(RunOptions.conversation: producer/prepare.py Inputs.conversation)", 2)
        stored = share_tokenizer(self.r, multi.tokenizer, str(multi.stored["tokenizer"]), multi.chat_template)
        if stored:
            self.echo(f"stored the tokenizer files in Redis for the workers ({stored} files)")

    def attach_one(self, p: Prepared) -> DatasetRun:
        """Take ``p``'s collector lock, set up its run in Redis and on disk, reconcile the file with Redis both ways,
        and return its state: the to-do list = the selected samples - done - held by a live chunk."""
        out_dir = self.opt.out_dir / p.name
        stored = self._stored_settings(p.name, out_dir)
        token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        if not self._take_lock(p.name, token):
            holder = holder_text(self.store.collector_holder(p.name))
            raise ProduceError(f"dataset {p.name}: another produce is attached to it ({holder} holds "
                               f"{self.store.collector_key(p.name)}); stop that one, or wait up to "
                               f"{LOCK_TTL_MS // 1000} s after it died", 1)
        self.locks[p.name] = token
        if self.opt.new_run and (stored is not None or self.store.exists(p.name)):
            self._start_over(p.name, out_dir)
        self.store.register(p.name, json.dumps(p.settings.stored, sort_keys=True), created_at=time.time(),
                            out_dir=str(self.opt.out_dir.resolve()))
        out_dir.mkdir(parents=True, exist_ok=True)
        stored_json = run_json(p.settings.stored, p.settings.tokenizer, p.settings.chat_template)
        (out_dir / RUN).write_text(json.dumps(stored_json, indent=2, sort_keys=True) + "\n")

        budget = self._set_budget(p)
        if self.opt.deadline is not None:
            self.ledger.set_deadline(p.name, round(self.opt.deadline * 1000))
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

        chunk_samples = self._live_chunk_samples(p.name)
        held = {sid for samples in chunk_samples.values() for sid in samples}
        done_ids = (set(done) | set(out.tokens)) - resuming
        # The to-do list: the selected samples in the run's order (producer/settings.py), in rounds of generations
        # (producer/generations.py) - done - held by a live chunk.
        # A started conversation (in convs) is not done: unless a live chunk holds it, it is enqueued again and its
        # worker resumes it at the turn Redis has (docs/multiturn.md).
        keys = p.keys()
        todo = deque(k for k in keys if k not in done_ids and k not in held)
        return DatasetRun(prepared=p, out=out, lock_token=token, todo=todo, chunk_samples=chunk_samples,
                          done=done_ids, budget=budget, resuming=resuming & set(keys))

    def _set_budget(self, p: Prepared) -> int | None:
        """Set the dataset's mode (--budget-mode, else the stored one, else predict) and budget; returns the budget.

        The budget: without --budget, the live one (or none). A --budget is what this command sets, and the last
        run's is stored (``run_budget``): rerunning the same command after ``produce budget NAME 60k`` keeps the
        60k (saying so), where it would silently restore the command's budget; a --budget other than the last
        run's wins (saying so when it changes the live one)."""
        if p.name in self.shares:  # a mix's member: its share, whatever --budget said (docs/mix.md)
            self.ledger.set_mode(p.name, self.opt.modes.get(p.name) or self.store.field(p.name, "mode") or "predict",
                                 p.settings.max_new_tokens)
            self.ledger.set_budget(p.name, self.shares[p.name])
            return self.shares[p.name]
        given = self.opt.budgets.get(p.name)
        live_raw = self.store.field(p.name, "budget")
        live = int(live_raw) if live_raw else None
        if given is None:
            budget = live
        else:
            wanted = budget_limit(given)
            last_raw = self.store.field(p.name, "run_budget")  # None: no run gave --budget yet
            last_given = last_raw is not None and (int(last_raw) if last_raw else None) == wanted
            if last_given and live_raw is not None and live != wanted:
                self.echo(f"{p.name}: keeps its budget {_shown(live)}, set since the last run; --budget "
                          f"{_shown(wanted)} is the last run's (give another --budget to replace it)")
                budget = live
            else:
                if live_raw is not None and live != wanted:
                    self.echo(f"{p.name}: budget {_shown(live)} -> {_shown(wanted)} (--budget)")
                budget = wanted
            self.store.set_run_budget(p.name, wanted)
        mode = self.opt.modes.get(p.name) or self.store.field(p.name, "mode") or "predict"
        self.ledger.set_mode(p.name, mode, p.settings.max_new_tokens)
        self.ledger.set_budget(p.name, budget)
        return budget

    def _live_chunk_samples(self, name: str) -> dict[str, list[str]]:
        """The samples each live chunk holds (chunk id -> sample keys)."""
        live = self.ledger.live_chunks(name)
        chunk_samples: dict[str, list[str]] = {}
        for sid, cid in self.ledger.holders(name).items():
            if cid in live:
                chunk_samples.setdefault(cid, []).append(sid)
        return chunk_samples

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
            return without_location(json.loads(run_file.read_text()))
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
