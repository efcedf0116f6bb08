"""The attached producer's loop: keep the queue topped up, recover dead chunks, collect results onto disk.

One ``Producer`` per ``produce`` command. It attaches first (producer/session/attach.py: the collector locks, the settings
check, each dataset's state rebuilt from Redis and the output files), so killing it (Ctrl-C, kill -9, a crash)
loses nothing: the next ``produce`` with the same arguments picks up where the run is. It reports with
producer/ops/status.py (the progress line, the summary table).

Per loop step and dataset, in this order (the order is what keeps a sample from being enqueued twice):
1. reclaim chunks whose lease expired (their worker died);
2. snapshot the live chunks;
3. collect committed results onto disk (a commit always precedes its chunk leaving the live set, so any
   sample of a chunk missing from the snapshot is already collected or truly unfinished);
4. give the unfinished samples of chunks that left the live set back to the to-do list;
5. discard queued chunks if the dataset closed, else top the queue up to ``queue_depth`` chunks.

``MixKeeper`` (below) is the attached producer's side of a mix (docs/mix.md): which mix this run is, the shares at attach, a member that
runs dry passing its rest on, and the shares applied again on every lease check (a ``produce budget --mix`` from
elsewhere, or another producer's apply, converges here).

The numbers come from budget/ledger.py; each share becomes a member's budget through ``Ledger.set_budget``, so the
per-dataset scripts enforce it in every worker.

How samples go onto the queue (`enqueue_chunks`, the last section): as chunk jobs on the shared RQ queue, atomically
with budgetq's bookkeeping. A batch of chunks goes in one MULTI/EXEC: the RQ jobs, their ids in the dataset's
live-chunk set (score +inf: queued) and each sample's holder in the pending hash. A ``produce`` killed mid-enqueue
leaves either a whole batch or nothing, so a rerun never enqueues a sample twice and never loses one. ``produce
--detach`` sends a dataset in batches of ``BATCH_CHUNKS`` chunks: one MULTI/EXEC of everything would hold every
payload in memory at once (1.9 GB for 100,000 prompts) for no gain in safety, since each batch is atomic.

Serialization is the producer's hot spot (benchmark 4, docs/performance.md): a chunk of 64 prompts is ~100 KB of
JSON. RQ's own path (stdlib ``json`` of Python int lists, then ``zlib`` at level 6 in ``Job.to_dict``) cost
103 µs a sample, more than a third of ``produce``. Here the job data is the same standard JSON, written by orjson
straight from the rendered ``array``s (through a zero-copy numpy view: no Python int per token) and compressed
at level 1: ~17 µs a sample, for ~15% more bytes in Redis. Workers need no change: they read job data with rq's
``JSONSerializer`` (stdlib ``json.loads``), and RQ's ``Job.restore`` decompresses any zlib level.
"""
from __future__ import annotations

import json
import logging
import math
import time
import zlib
from array import array
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Union

import numpy as np
import orjson
import redis
from rq import Queue, Worker
from rq.job import Job

from budget import keys, record, serverinfo
from budget.ledger import (
    LEASE_MS,
    REDIS_DOWN,
    DatasetState,
    EndVerdict,
    Ledger,
    Mix,
    MixStore,
    default_prior_mean,
    mix_id,
)
from budget.record import JOB_FUNCTION, VERSION, ConversationPayload, ThinkPayload, end_as_is
from budget.runstate import RunState
from producer.errors import ProduceError
from producer.generations import record_key, split_key
from producer.ops.status import DatasetSummary, progress_line, summaries
from producer.prepare import Prepared, Prompt, progress_bar
from producer.results import FAILED_FILE, collect, write_failed
from producer.session.attach import LOCK_TTL_MS, Attacher, DatasetRun, JobSettings, RunOptions

log = logging.getLogger("budgetq.produce")

#: A chunk reclaimed this many times (its worker died each time it ran it) fails its unfinished samples:
#: a sample that kills workers must not kill them forever.
MAX_RECLAIMS = 3
#: A queued chunk whose RQ job ended without the chunk ever starting (a failed job, a worker killed between
#: dequeue and start) is checked this often and taken back.
STALE_CHECK_S = 5.0
#: A queued chunk a worker popped from the queue and has not started this long after (three leases) is taken
#: back as well: that worker died between dequeue and start.
POPPED_OVERDUE_S = 3 * LEASE_MS / 1000
#: After a Redis outage, leases are not reclaimed for one lease and this long: their workers are alive and
#: refresh them as soon as they reach Redis again.
OUTAGE_GRACE_S = 5.0


def pop_chunk(todo: deque[str], returned: int, size: int) -> list[str]:
    """Pop the next chunk's sample ids from the front of ``todo``: at most ``size``, and none past the ``returned``
    front (samples given back) when there is one, so a chunk is all given back (to the queue's front) or all new."""
    return [todo.popleft() for _ in range(min(size, returned or len(todo)))]


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
        self._last_progress = 0.0
        self._down: set[tuple[str, str]] = set()  # (worker, server) pairs last said down (budget/serverinfo.py)
        self._last_stale_check = 0.0
        self._grace_until = 0.0
        self.epoch = ""
        self.mixer = MixKeeper(client, self.ledger, options.mix, options.new_run, echo, pace=options.mix_pacing)

    # -- attach (producer/session/attach.py) -------------------------------------------------------------------
    def attach(self) -> None:
        """Take every dataset's collector lock and rebuild its state. Nothing is enqueued yet.

        Every dataset's stored settings are checked before anything is written, so a refused rerun
        leaves Redis as it was."""
        attacher = Attacher(self.r, self.ledger, self.store, self.opt, self.echo, self._locks)
        attacher.check(self.datasets)
        self.epoch = self.store.claim_epoch()
        self.mixer.settle(p.name for p in self.datasets)
        attacher.shares = self.mixer.shares()
        try:
            for prepared in self.datasets:
                self.runs.append(attacher.attach_one(prepared))
            self.mixer.attached(self.runs)
        except BaseException:
            self.release()
            raise

    # -- the loop --------------------------------------------------------------------------------------
    def to_enqueue(self) -> int:
        """Samples the attached datasets have yet to enqueue (0 for a rerun of a finished run)."""
        return sum(len(d.todo) for d in self.runs if not d.finished)

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
        self._grace_until = time.monotonic() + LEASE_MS / 1000 + OUTAGE_GRACE_S

    def _wait(self) -> None:
        # Wake up as soon as a result arrives, or after poll_s to look after leases and the queue.
        self.store.wait_for_results([d.name for d in self.runs if not d.finished], int(self.opt.poll_s * 1000))

    def step(self) -> bool:
        self._check_epoch()
        now = time.monotonic()
        check_stale = now - self._last_stale_check >= STALE_CHECK_S
        if check_stale:
            self._last_stale_check = now
        if check_stale:
            self.mixer.apply()  # a produce budget --mix from elsewhere: its shares, in this loop's budgets too
        for d in self.runs:
            if d.finished and check_stale:
                self._reopen(d)
            if not d.finished:
                self._step_one(d, check_stale)
        if now - self._last_progress >= self.opt.progress_s:
            self._last_progress = now
            self.echo(self.progress_line())
            self._warn_down_servers()
        return all(d.finished for d in self.runs)

    def _reopen(self, d: DatasetRun) -> None:
        """A finished dataset whose budget was raised (produce budget, or a mix's member that ran dry passing its
        rest on) and that has samples left: top it up again."""
        if d.todo and self.ledger.state(d.name).has_room():
            d.finished = False
            self.echo(f"{d.name}: reopened")

    def _warn_down_servers(self) -> None:
        """Name each worker whose SGLang servers are down once when that starts, and say when they answer again:
        its chunks went back to the queue for the others, but the run has that much less throughput."""
        entries = serverinfo.read_down(self.r)
        down = {(str(e.get("worker")), url) for e in entries for url in e["down"]}
        for line, e in zip(serverinfo.describe_down(entries), entries, strict=True):
            if any((str(e.get("worker")), url) not in self._down for url in e["down"]):
                self.echo(f"warning: {line}")
        for worker, url in sorted(self._down - down):
            self.echo(f"SGLang {url} answers worker {worker} again (or the worker stopped)")
        self._down = down

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
                               f"one stalled for {LOCK_TTL_MS // 1000} s)", 1)
        reclaimed: set[str] = set()
        if time.monotonic() >= self._grace_until:
            reclaimed = set(self.ledger.reclaim(d.name))
            if check_stale:
                reclaimed |= self._reclaim_stale_queued(d)
        for cid in sorted(reclaimed):
            self.echo(f"{d.name}: chunk {cid} lost its worker; its unfinished samples go back in the queue")
        live = self.ledger.live_chunks(d.name)
        prompts = d.prepared.prompts
        for rec in collect(self.store, d.name, d.out, lambda sid: _messages(prompts, sid)):
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
            # budget still keeps the first prompts of the order (producer/settings.py).
            d.todo.extendleft(reversed(back))
            d.returned += len(back)
        state = self.ledger.state(d.name)
        if state.used < d.out.total_tokens:
            # Redis restarted empty since the step began (the epoch check at its start saw the old Redis): say that,
            # not "an older state", whichever moment in the step the restart fell on.
            self._check_epoch()
            raise ProduceError(f"dataset {d.name}: Redis counts {state.used} tokens but {d.out.path} already holds "
                               f"{d.out.total_tokens}: Redis went back to an older state. Nothing on disk is lost: "
                               "run the same produce command again to recount from the output files.", 1)
        d.status, d.used, d.stats, d.budget = state.status, state.used, state.stats, state.budget
        d.closed_by = state.fields.get("closed_by", "")
        d.deadline = int(state.fields["deadline"]) / 1000 if state.fields.get("deadline") else None
        d.turns_committed = int(state.stats.get("turns", 0) or 0)
        self.store.set_progress(d.name, selected=d.prepared.selected, todo=len(d.todo))
        if state.status != "open":
            if state.queued_chunks or state.discards_to_mark:
                self.ledger.discard(d.name, "budget reached")
            if d.prepared.conversations:
                self._end_stranded(d, back if ended else [])
        elif d.todo and state.queued_chunks < self.opt.queue_depth and state.has_room() \
                and not self.mixer.ahead(d, self.runs, self._mean):
            # A paced mix's member gets one chunk at a time, so the members' chunks interleave in the queue.
            chunks = 1 if self.mixer.paces(d) else self.opt.queue_depth - state.queued_chunks
            self._refill(d, max_chunks=chunks, max_samples=self._samples_needed(d, state))
        if (state.status != "open" or not d.todo) and not d.chunk_samples and not live \
                and self.store.unwritten(d.name) == 0:
            self._finish(d)

    def _finish(self, d: DatasetRun) -> None:
        """Nothing of ``d`` is left to run or to collect. A mix's member that ran dry passes the rest of its share on
        (docs/mix.md): the others that had finished at their old shares reopen."""
        if self.mixer.ran_dry(d):
            state = self.ledger.state(d.name)
            d.status, d.budget = state.status, state.budget
            for other in self.runs:
                if other is not d and other.finished:
                    self._reopen(other)
        d.failed = self.ledger.failed(d.name)
        write_failed(self.opt.out_dir / d.name / FAILED_FILE, d.failed)
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
        ended = 0
        for sid in started:
            params, kwargs = self._sent_with(d, sid)
            outcome = end_as_is(self.ledger, d.name, sid, d.prepared.messages(split_key(sid)[0]),
                                reasoning_parser=d.prepared.settings.reasoning_parser, sampling_params=params,
                                chat_template_kwargs=kwargs, tools=d.prepared.tools(split_key(sid)[0]))
            if outcome is not None and outcome.verdict is EndVerdict.MISMATCH:
                d.stranded.add(sid)  # a worker still commits to it (a zombie): look again next step
                continue
            d.stranded.discard(sid)
            ended += 1
        if ended:
            gone = set(started) - d.stranded
            d.returned = sum(1 for sid in islice(d.todo, d.returned) if sid not in gone)
            d.todo = deque(sid for sid in d.todo if sid not in gone)
            self.echo(f"{d.name}: {ended} started conversations ended with the turns they have (stopped_by budget): "
                      "the dataset closed after the worker carrying them stopped")

    def _sent_with(self, d: DatasetRun, sid: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """What sample ``sid``'s turns were sent with, for a record the producer writes in a worker's stead: the
        chunks' sampling parameters with its generation's override, and the template kwargs it drew (None: the
        run's)."""
        pid, generation = split_key(sid)
        settings = d.prepared.settings
        params = {**settings.chunk_params, **(settings.generations.overrides(pid, generation) or {})}
        variants = settings.variants
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
                        outcome = end_as_is(self.ledger, d.name, sid, d.prepared.messages(split_key(sid)[0]),
                                            reasoning_parser=d.prepared.settings.reasoning_parser,
                                            sampling_params=params,
                                            stopped_by=record.FAILED, failed_reason=why,
                                            chat_template_kwargs=kwargs, tools=d.prepared.tools(split_key(sid)[0]))
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
        overdue = [cid for cid, first in d.queued_seen.items() if now - first > POPPED_OVERDUE_S]
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
        mean = state.used / state.done if state.done else self._prior_mean(d)
        needed = math.ceil(room / max(mean, 1.0) * self.opt.margin) + self.opt.chunk_size
        held = sum(1 for ids in d.chunk_samples.values() for sid in ids if sid not in d.done)
        return max(0, needed - held) if not everything else max(0, needed)

    def _mean(self, d: DatasetRun) -> float:
        """The mean tokens of ``d``'s samples so far, else its prior."""
        return d.used / len(d.done) if d.done else self._prior_mean(d)

    def _prior_mean(self, d: DatasetRun) -> float:
        raw = self.store.field(d.name, "prior_mean")
        if raw:
            return float(raw)
        return default_prior_mean(d.prepared.settings.max_new_tokens)

    def _refill(self, d: DatasetRun, max_chunks: int | None = None, max_samples: int | None = None,
                progress: Callable[[int], None] | None = None) -> None:
        """Enqueue up to ``max_chunks`` chunks holding up to ``max_samples`` of ``d``'s to-do samples.

        In batches of ``BATCH_CHUNKS`` chunks, each one MULTI/EXEC (all of it or none): a ``--detach`` of a
        whole dataset never holds more than one batch's payloads, and a produce killed between batches leaves
        whole batches, which its rerun finds live and does not enqueue again. Chunk data is compressed in a
        small thread pool while this thread serializes and builds the jobs (``enqueue_chunks``)."""
        with ThreadPoolExecutor(COMPRESS_THREADS, thread_name_prefix="bq-zlib") as pool:
            for chunks, front in self._batches(d, max_chunks, max_samples):
                try:
                    settings = d.prepared.settings
                    cids = enqueue_chunks(self.r, self.queue, d.name, chunks, sampling_params=settings.chunk_params,
                                          think=settings.think, settings=self.opt.job, compress=pool,
                                          reasoning_parser=settings.reasoning_parser,
                                          conversation=self.opt.conversation, at_front=front)
                except BaseException:
                    # Not enqueued (or, after a lost EXEC reply, perhaps enqueued): the samples go back to the
                    # front of the to-do list either way. Enqueued twice is harmless: the holder hash names the
                    # newer chunk, so the older one's admits are refused, and done samples are skipped.
                    ids = [it.id for items in chunks for it in items]
                    d.todo.extendleft(reversed(ids))
                    if front:
                        d.returned += len(ids)
                    raise
                n = 0
                for cid, items in zip(cids, chunks, strict=True):
                    d.chunk_samples[cid] = [it.id for it in items]
                    n += len(items)
                d.enqueued_samples += n
                if progress is not None:
                    progress(n)

    def _batches(self, d: DatasetRun, max_chunks: int | None,
                 max_samples: int | None) -> Iterator[tuple[list[list[Item]], bool]]:
        """Pop ``d``'s to-do samples into chunks, one batch at a time: only the batch being sent exists as Items.
        Each chunk's size is ``chunk_size_for`` the to-do left: --chunk-size at most.
        Items keep the prepared ``array``s; their JSON is written from the arrays (no Python int per token).

        Yields (chunks, front). ``front``: the chunks hold only samples that came back (``d.returned``), which come
        before every queued chunk in the run's order, so they go to the front of the queue: a budget closing
        later keeps rounds and the order's first prompts (docs/generations.md). A batch never mixes the two."""
        p = d.prepared
        workers = listening_count(self.queue)
        samples = len(d.todo) if max_samples is None else max_samples
        chunks_left = max_chunks
        while d.todo and samples > 0 and (chunks_left is None or chunks_left > 0):
            n_chunks = BATCH_CHUNKS if chunks_left is None else min(BATCH_CHUNKS, chunks_left)
            front = d.returned > 0
            chunks: list[list[Item]] = []
            while d.todo and samples > 0 and len(chunks) < n_chunks and front == (d.returned > 0):
                # --chunk-size is a maximum: chunks shrink as the to-do list runs out (no idle tail)
                size = chunk_size_for(len(d.todo), self.opt.chunk_size, workers)
                ids = pop_chunk(d.todo, d.returned, min(size, samples))
                samples -= len(ids)
                if front:
                    d.returned -= len(ids)
                chunks.append([self._item(p, sid) for sid in ids])
            if chunks_left is not None:
                chunks_left -= len(chunks)
            yield chunks, front

    def _item(self, p: Prepared, key: str) -> Item:
        """The sample ``key``: its prompt's rendering, and what its generation sends differently from the chunk
        (its sampling parameters; with a template kwargs mix, the kwargs it drew and their rendering)."""
        pid, generation = split_key(key)
        prompt = p.prompts[pid]
        overrides = p.settings.generations.overrides(pid, generation)
        ids, opens = prompt.input_ids, prompt.opens_think
        kwargs: dict[str, Any] | None = None
        fingerprint: str | None = None
        variants = p.settings.variants
        if variants is not None:
            name = variants.name(pid, generation)
            ids, opens = prompt.renderings[name]
            kwargs = variants.kwargs(name)
            fingerprint = variants.fingerprint(name) if prompt.turns > 1 else None
        if prompt.turns == 1:
            return Item(key, ids, opens, sampling_params=overrides, chat_template_kwargs=kwargs,
                        tools=prompt.sample.tools)
        return Item(key, ids, opens, messages=prompt.sample.messages, turns=prompt.turns, sampling_params=overrides,
                    chat_template_kwargs=kwargs, tokenizer=fingerprint, tools=prompt.sample.tools)

    # -- reporting (producer/ops/status.py) ----------------------------------------------------------------
    def progress_line(self, now: float | None = None) -> str:
        return progress_line(self.runs, now)

    def summaries(self) -> list[DatasetSummary]:
        return summaries(self.runs, self.opt.out_dir)

    def release(self) -> None:
        for name, token in self._locks.items():
            try:
                self.store.release_collector(name, token)
            except redis.RedisError:
                pass  # it expires by itself
        self._locks.clear()
        for d in self.runs:
            d.out.close()


def _messages(prompts: Mapping[str, Prompt], key: str) -> Any:
    """The prompt messages of sample ``key``, for its line on disk; None for a prompt no longer selected."""
    prompt = prompts.get(split_key(key)[0])
    return prompt.sample.messages if prompt is not None else None


def _same(a: Mix, b: Mix) -> bool:
    return a.total == b.total and dict(a.weights) == dict(b.weights)


#: A member is ahead, and gets no new chunks, while its share is this much more spent than the least spent open
#: member's (fractions of their shares): what is queued already still runs, so this is a band, not a hard cap.
PACE_SLACK = 0.02


class MixKeeper:
    """``given``: the run's --mix (None: none given; a mix stored for exactly these datasets still applies)."""

    def __init__(self, client: "redis.Redis", ledger: Ledger, given: Mix | None, new_run: bool,
                 echo: Callable[[str], None], pace: bool = True) -> None:
        self.store = MixStore(client)
        self.ledger = ledger
        self.given = given
        self.new_run = new_run
        self.echo = echo
        self.pace = pace
        self.mix: Mix | None = None
        self._given: str | None = None  # what ``attached`` records as the command's mix (None: keep the record)

    def settle(self, names: Iterable[str]) -> Mix | None:
        """Before the datasets attach, read-only: the mix this run applies (``attached`` writes it).

        A rerun giving the last command's mix again keeps a total or weights ``produce budget --mix`` set since
        (saying so), as a rerun's --budget does; another mix replaces it (saying so). Without --mix, the mix stored
        for exactly these datasets applies."""
        names = sorted(names)
        if self.given is None:
            ids = {self.store.mix_of(n) for n in names}
            self.mix = self.store.load(mix_id(names)) if ids == {mix_id(names)} else None
            return self.mix
        wanted = self.given
        stored = None if self.new_run else self.store.load(wanted.id)
        if stored is not None and self.store.given(wanted.id) == wanted.given() and not _same(stored, wanted):
            self.echo(f"keeps the {stored.describe()}, set since the last run; --mix is the last run's (give "
                      "another --budget or --mix to replace it)")
            self.mix, self._given = stored, None
        else:
            kept = Mix(wanted.total, wanted.weights, stored.dry if stored is not None else {})
            if stored is not None and not _same(stored, wanted):
                self.echo(f"mix changed: {stored.describe()} -> {kept.describe()}")
            self.mix, self._given = kept, wanted.given()
        return self.mix

    def shares(self) -> dict[str, int]:
        return self.mix.shares() if self.mix is not None else {}

    def attached(self, runs: list["DatasetRun"]) -> None:
        """After every member attached: a member marked dry that has prompts to run again (a rerun with more data,
        or more --max-samples) is a member again; then every share is applied."""
        if self.mix is None:
            return
        if self.given is not None:
            if self.new_run:
                self.store.forget(self.mix.id)
            self.store.save(self.mix, given=self._given)
        back = [d.name for d in runs if d.name in self.mix.dry and (d.todo or d.chunk_samples)]
        if back:
            self.store.clear_dry(self.mix.id, back)
        self.apply()

    def ran_dry(self, d: "DatasetRun") -> bool:
        """``d`` has nothing left to run while open and under its share: it keeps what it used, and the rest of its
        share goes to the others by weight. Returns whether that happened."""
        if self.mix is None or d.name not in self.mix.weights or d.name in self.mix.dry:
            return False
        if d.status != "open" or d.budget is None or d.used >= d.budget:
            return False
        self.store.mark_dry(self.mix.id, d.name, d.used)
        others = ", ".join(n for n in sorted(self.mix.weights) if n != d.name and n not in self.mix.dry)
        self.apply()
        self.echo(f"{d.name}: ran dry at {d.used:,} tokens of its share {d.budget:,}; the rest goes to "
                  f"{others or 'no other dataset (every one ran dry)'} by weight")
        return True

    def paces(self, d: "DatasetRun") -> bool:
        return self.pace and self.mix is not None and d.name in self.mix.weights

    def ahead(self, d: "DatasetRun", runs: list["DatasetRun"], mean: Callable[["DatasetRun"], float]) -> bool:
        """Proportion at any moment (docs/mix.md): should ``d`` wait for the other members before it gets another
        chunk? A member's progress is the part of its share it used or holds in live chunks (their samples at its
        mean length, ``mean``): counting only what is used, the first member to be enqueued would fill the queue
        before its first result. ``d`` waits while it is PACE_SLACK ahead of the least advanced member that can
        still go on (open, prompts left, not dry). Workers pull chunks in queue order, so the members' token
        rates follow what the producer queues."""
        if not self.pace or self.mix is None or d.name not in self.mix.weights:
            return False

        def progress(x: "DatasetRun") -> float:
            held = sum(1 for ids in x.chunk_samples.values() for sid in ids if sid not in x.done)
            return (x.used + held * mean(x)) / x.budget if x.budget else 1.0

        behind = [progress(x) for x in runs if x is not d and x.name in self.mix.weights
                  and x.name not in self.mix.dry and x.status == "open" and x.todo and not x.finished]
        return bool(behind) and progress(d) > min(behind) + PACE_SLACK

    def apply(self) -> None:
        """Read the mix again and set every member's budget to its share; closing a member discards its queued
        chunks in the loop's next step (a closed dataset's queue is discarded there)."""
        if self.mix is None:
            return
        self.mix = self.store.load(self.mix.id) or self.mix
        self.store.apply(self.ledger, self.mix)

# -- enqueue: rendered samples into chunk jobs, atomically with the bookkeeping ------------------------------

#: Chunks per MULTI/EXEC when a whole dataset is enqueued (``--detach``, the first fill): 64 chunks of 64
#: prompts are ~2 MB on the wire, so a batch costs little memory and the round trips stay few.
BATCH_CHUNKS = 64
#: Threads compressing chunk data while the producer's thread serializes the next chunks: zlib releases the GIL.
COMPRESS_THREADS = 2
#: zlib level of job data. Level 1 compresses a chunk's JSON ~2.9x (level 6: ~3.7x) at a third of the CPU.
ZLIB_LEVEL = 1
#: The tail (docs/performance.md, figure 8): a chunk's unstarted samples start only on the worker holding it, so
#: when the queue runs dry the other workers idle while it works through them. Chunks shrink as a dataset's
#: to-do list falls: a chunk holds at most 1/(TAIL_SPREAD x workers) of the to-do left when it is made, so what
#: comes after it always gives every worker TAIL_SPREAD chunks of at least its size.
TAIL_SPREAD = 2
#: ... but never fewer samples than this (unless --chunk-size is smaller): a chunk costs a job, a start and a
#: finish; the last chunks of a run are this size, and a worker's window (BUDGETQ_CONCURRENCY, 64) starts one
#: in a single admission.
MIN_CHUNK = 8
#: Workers assumed while none is registered on the queue: a first fill made before the workers start would
#: otherwise cut the tail of a small dataset into chunks sized for one worker.
ASSUMED_WORKERS = 4


TokenIds = Union[list[int], "array[int]"]


@dataclass(frozen=True)
class Item:
    """A sample ready to send. ``input_ids`` may stay the compact ``array('i')`` prepare made: it is written to
    JSON from the array itself."""

    id: str
    input_ids: TokenIds
    opens_think: bool
    #: ``--turns all``, a conversation of more than one turn: the dataset's messages and its turns at most
    #: (budget/record.py SamplePayload); None and 1 for every other sample.
    messages: list[dict[str, Any]] | None = None
    turns: int = 1
    #: What this sample's generation sends differently from the chunk (producer/generations.py); None: the chunk's.
    sampling_params: dict[str, Any] | None = None
    #: --template-kwargs-mix: the kwargs the sample was rendered with, and (a conversation) their Renderer's
    #: fingerprint (budget/record.py SamplePayload); None: the run's.
    chat_template_kwargs: dict[str, Any] | None = None
    tokenizer: str | None = None
    #: The record's tool definitions (budget/record.py SamplePayload); None: none.
    tools: list[dict[str, Any]] | None = None


class ChunkSerializer:
    """Standard JSON out (orjson, numpy int arrays as JSON arrays), stdlib ``json`` in, as the workers read it.

    Only this process writes with it; anything reading a chunk job (workers, rq-dashboard, tests) uses rq's
    ``JSONSerializer`` and gets the same values."""

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)

    @staticmethod
    def loads(data: bytes) -> Any:
        return json.loads(data)


class ChunkJob(Job):
    """RQ's job, with its data compressed at ``ZLIB_LEVEL`` instead of zlib's default level 6, possibly ahead of
    time in another thread (``compressed``: zlib releases the GIL, so a batch's chunks compress in parallel
    with the job bookkeeping on this thread).

    ``Job.to_dict`` calls ``zlib.compress(self.data)`` with no level and offers no hook, so the data is swapped
    for an empty string while RQ builds the rest of the hash (every other field stays RQ's), then put in
    compressed here. tests/redis/test_enqueue.py checks the result against RQ's own ``to_dict``."""

    compressed: "Future[bytes] | None" = None

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict[str, Any]:
        data = self.data
        self._data = b""
        try:
            obj = super().to_dict(include_meta=include_meta, include_result=include_result)
        finally:
            self._data = data
        obj["data"] = self.compressed.result() if self.compressed is not None else zlib.compress(data, ZLIB_LEVEL)
        return obj


def chunk_size_for(todo: int, maximum: int, workers: int) -> int:
    """Samples in the next chunk of a dataset with ``todo`` samples not yet in any chunk: ``maximum``
    (--chunk-size) while the to-do list is long, then ceil(todo / (TAIL_SPREAD x workers)), down to MIN_CHUNK.
    ``workers``: the RQ workers listening; before any has registered (produce usually starts first),
    ASSUMED_WORKERS."""
    spread = TAIL_SPREAD * (workers if workers > 0 else ASSUMED_WORKERS)
    return max(1, min(maximum, max(MIN_CHUNK, -(-todo // spread))))


def listening_count(queue: Queue) -> int:
    """RQ workers registered on the chunk queue (RQ's own registry; a crashed worker stays in it until RQ's
    cleanup), for ``chunk_size_for``. 0 when none has started yet."""
    return Worker.count(queue=queue)


def make_queue(client: "redis.Redis") -> Queue:
    return Queue(keys.QUEUE_NAME, connection=client, serializer=ChunkSerializer, job_class=ChunkJob)


def wire_ids(ids: TokenIds) -> Any:
    """What orjson writes as the JSON array of ``ids``: a numpy view of an ``array('i')`` (no copy, no Python
    ints), a list as it is."""
    if isinstance(ids, array):
        return np.frombuffer(ids, dtype=np.intc)
    return ids


def _sample(it: Item) -> dict[str, Any]:
    sample: dict[str, Any] = {"id": it.id, "input_ids": wire_ids(it.input_ids), "opens_think": it.opens_think}
    if it.turns > 1:
        sample["messages"] = it.messages
        sample["turns"] = it.turns
    if it.sampling_params:
        sample["sampling_params"] = it.sampling_params
    if it.chat_template_kwargs is not None:
        sample["chat_template_kwargs"] = it.chat_template_kwargs
        if it.turns > 1 and it.tokenizer is not None:
            sample["tokenizer"] = it.tokenizer
    if it.tools:
        sample["tools"] = it.tools
    return sample


def enqueue_chunks(client: "redis.Redis", queue: Queue, dataset: str, chunks: Sequence[Sequence[Item]], *,
                   sampling_params: dict[str, Any], think: ThinkPayload | None,
                   settings: JobSettings, reasoning_parser: str = "none", compress: Executor | None = None,
                   conversation: ConversationPayload | None = None, at_front: bool = False) -> list[str]:
    """Enqueue ``chunks`` (lists of samples) for ``dataset`` in one MULTI/EXEC; returns their chunk ids in order.

    The payload is ``budget.record.ChunkPayload`` on the wire; ``input_ids`` arrays are written as JSON arrays
    without becoming lists first. ``reasoning_parser`` names the parser the workers split the responses with (``none``: no split). With ``compress`` (a thread pool), each chunk's data is compressed there while
    the next chunks are serialized and the jobs built here. A sample with ``turns`` > 1 carries its ``messages`` and
    ``turns``, and its chunk carries ``conversation`` (what a worker needs to render the later turns: required
    then, and left out of a chunk of one-turn samples). ``at_front``: the chunks go to the front of the queue, in
    their order (samples given back, which come before what is queued)."""
    if not chunks:
        return []
    store = RunState(client)
    ids = store.next_chunk_ids(dataset, len(chunks))
    jobs = []
    pending: dict[str, str] = {}
    for cid, items in zip(ids, chunks, strict=True):
        samples = [_sample(it) for it in items]
        payload: dict[str, Any] = {"v": VERSION, "dataset": dataset, "chunk": cid, "sampling_params": sampling_params,
                                   "think": think, "reasoning_parser": reasoning_parser, "samples": samples}
        if any(it.turns > 1 for it in items):
            if conversation is None:
                raise ValueError(f"chunk {cid} holds multi-turn samples but no conversation block was given")
            payload["conversation"] = conversation
        first, final = items[0].id, items[-1].id
        job = queue.create_job(
            JOB_FUNCTION, args=(payload,), job_id=cid, timeout=settings.job_timeout,
            result_ttl=settings.result_ttl, failure_ttl=settings.failure_ttl,
            description=f"{dataset}: {len(items)} samples ({first} .. {final})",
            meta={"dataset": dataset, "samples": len(items), "first": first, "last": final})
        if compress is not None and isinstance(job, ChunkJob):
            job.compressed = compress.submit(zlib.compress, job.data, ZLIB_LEVEL)
        jobs.append(job)
        for it in items:
            pending[it.id] = cid
    with client.pipeline(transaction=True) as pipe:
        pipe.multi()  # explicit: RQ's enqueue_job puts a pipeline in MULTI mode itself unless it already is
        store.hold(pipe, dataset, ids, pending)
        for job in reversed(jobs) if at_front else jobs:  # each at_front push goes before the one pushed before it
            queue.enqueue_job(job, pipeline=pipe, at_front=at_front)
        pipe.execute()
    return ids
