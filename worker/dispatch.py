"""The worker's window: up to BUDGETQ_CONCURRENCY requests in flight (unset: as many as its servers can take,
worker/window.py), fed by one chunk after another. The window itself is ``Slots``, a semaphore whose size the
automatic window changes while requests run.

Why not "run a chunk, wait for its last request, take the next": completion lengths are long-tailed (the
longest of 64 lognormal requests is several times the mean), so a chunk that waits for its slowest request
leaves most of its slots idle while that one finishes, and the GPU batch runs half empty (measured here: 4
workers x 64 on a 256-request server kept about a quarter of it busy). Instead an RQ chunk job ends when every
sample of the chunk has *started* (or been given back): ``dispatch`` waits only for free slots. The worker
then takes the next chunk while the previous one's tail still runs, so the window stays full. The chunk stays
live (its lease refreshed, its reservations restated) until its last request is committed; liveness and
recovery never depended on RQ's job status (see budget/ledger.py).

Flow per sample: ``admit`` (dataset open? chunk still the sample's holder? room in the budget?) ->
``POST /generate`` with retries -> ``commit`` (exactly-once, counted, result queued for the producer). Admits
and commits of one loop iteration share a Redis round trip (worker/batch.py). A sample holds its slot from
admission until its request ends, not until its commit's reply: the window counts requests at SGLang. When a
commit closes the dataset, the worker discards the dataset's queued chunks at once; requests in flight finish
and are committed (GPU work is never thrown away), but no new request of the dataset starts.

A 401/403 from SGLang (``SGLANG_API_KEY`` wrong or missing) is the worker's own misconfiguration, not the
sample's: every request it sends would be refused alike, and five attempts per sample would mark a whole
dataset failed in seconds. The first one sets ``fault``, logs one error naming the server and the variable, and
stops the dispatcher as a warm stop does: nothing more starts, the refused samples and the unstarted rest are
given back uncounted and unfailed (the producer re-enqueues them once the chunk ends), requests already running
finish and are committed. ``on_fault`` then tells the worker, which exits non-zero (worker/rqworker.py).

When every server of the worker is down (worker/health.py: no connection, or /health 503), the dispatcher holds
the same way but for as long as the outage lasts: the chunk being dispatched gives its unstarted samples back,
samples between retries are given back instead of waiting out BUDGETQ_RETRY_FOR (SGLangClient.hold), and each
chunk ends as soon as its last request does; no attempt is charged against a sample given back, nothing is
counted, and it is not a reclaim. RQ's loop takes no chunk meanwhile (worker/rqworker.py); when a server answers
/health again the hold is released.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Callable, Mapping

import redis
from rq.serializers import JSONSerializer

from budget.ledger import LEASE_MS, TURN_BUCKETS, Admission, Admit, Ledger, turn_bucket
from budget.record import ChunkPayload, SamplePayload, sampling_params_of
from worker import window
from worker.batch import Batcher, in_thread_until_answered
from worker.config import WorkerConfig
from worker.estimate import LengthModels, TurnModels
from worker.sglang import (
    CLOSE_REASON,
    ChunkReport,
    Flight,
    GenerateError,
    Generation,
    RequestContext,
    RunningChunk,
    SGLangClient,
    result_record,
)
from worker.turns import run_conversation

log = logging.getLogger("budgetq.worker")

#: How often a running chunk's progress is copied into its RQ job's meta, where rq-dashboard's job page shows it.
META_INTERVAL_S = 5.0
#: How often the worker-level task renews the RQ worker's registration while chunks run (RQ's worker TTL: 420 s).
HEARTBEAT_S = 10.0


def _log_meta_error(chunk: str, done: "asyncio.Future[bool]") -> None:
    if not done.cancelled() and done.exception() is not None:
        log.debug("progress of %s not written to its job meta: %s", chunk, done.exception())



# -- the window the dispatcher waits on ------------------------------------------------------------------------
class Slots:
    """asyncio.Semaphore's acquire/release/locked with a size that can change: shrinking takes no slot back (a
    request in flight runs to its end); freed slots are not handed out again until fewer than ``size`` are used."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self.used = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def locked(self) -> bool:
        return self.used >= self.size or any(not w.done() for w in self._waiters)

    async def acquire(self) -> bool:
        if self.used < self.size and not any(not w.done() for w in self._waiters):
            self.used += 1
            return True
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted, then cancelled before it ran: give it back
                self.release()
            raise
        return True

    def release(self) -> None:
        self.used -= 1
        self._wake()

    def resize(self, size: int) -> None:
        self.size = max(1, size)
        self._wake()

    def usage(self) -> tuple[int, int]:
        """(slots used, size): read from the window thread (two ints: a torn read is one look off)."""
        return self.used, self.size

    def _wake(self) -> None:
        while self._waiters and self.used < self.size:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.used += 1
                waiter.set_result(None)


class Dispatcher:
    """One per worker process, living on the Runtime's event loop."""

    def __init__(self, ledger: Ledger, client: SGLangClient, config: WorkerConfig,
                 heartbeat: Callable[[], None] | None = None,
                 on_fault: Callable[[str], None] | None = None) -> None:
        self.ledger = ledger
        self.client = client
        self.config = config
        self.heartbeat = heartbeat
        self.on_fault = on_fault  # called once, on the loop, when a configuration fault stops the dispatcher
        self.fault: str | None = None  # why this worker cannot work (a refused API key), once known
        self._beat: asyncio.Task[None] | None = None  # the worker-level RQ heartbeat (_keep_heartbeat)
        self.batcher = Batcher(ledger.r)
        self.length_models = LengthModels(
            lambda dataset: self.batcher.call_until_answered("length model", ledger.length_sample_call(dataset)),
            refresh_s=5 * config.reserve_interval, model_error=config.predict_model_error,
            reserve_interval=config.reserve_interval)
        #: The window: BUDGETQ_CONCURRENCY slots, or, when it is unset, as many as worker/window.py says.
        self.slots = Slots(config.concurrency or window.START)
        self.window: window.WindowKeeper | None = None
        if config.concurrency is None:
            loop = asyncio.get_running_loop()
            self.window = window.WindowKeeper(
                ledger.r, config, usage=self.slots.usage,
                on_window=lambda size: loop.call_soon_threadsafe(self.slots.resize, size),
                on_load=lambda url, load, peers: loop.call_soon_threadsafe(self._note_load, url, load, peers)).start()
        self.ended = asyncio.Event()  # set whenever any request of this worker ends
        self.running: dict[str, RunningChunk] = {}
        self.finishers: set[asyncio.Task[None]] = set()
        #: A warm shutdown (or a fault) asked for: start nothing more, finish what runs. It also wakes a dispatch
        #: waiting for a free slot (``_take_slots``), so the chunk gives its unstarted samples back at once.
        self.stop_requested = asyncio.Event()
        #: Every server of this worker is down (worker/health.py): start nothing, give chunks back, until one is up.
        self.servers_down = False
        #: Start nothing now: a stop, a fault, or every server down. Set, it wakes a dispatch waiting for a slot
        #: and holds the client (SGLangClient.hold): samples between retries are given back, not retried.
        self.hold = asyncio.Event()
        #: What each request needs of this worker (worker/sglang.py), for one-turn samples and conversations alike.
        self.requests = RequestContext(ledger, self.batcher, client, config, self.length_models, self.ended,
                                       self.stop_requested, self._fault)

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    def stop(self) -> None:
        """Warm stop: start nothing more; requests already running finish and are committed, those waiting to
        retry are given back."""
        self.stop_requested.set()
        self._set_hold()

    def set_servers_down(self, down: bool) -> None:
        """From worker/health.py (on the loop): every server is down (True), or one answers again (False)."""
        self.servers_down = down
        self._set_hold()

    def _set_hold(self) -> None:
        held = self.stopping or self.servers_down
        if held:
            self.hold.set()
        else:
            self.hold.clear()
        self.client.set_hold(held)

    def _note_load(self, url: str, load: window.Load, peers: int) -> None:
        """A server's load, from the window's thread: what the client shares its busy time by."""
        total = None if load.running is None or load.waiting is None else load.running + load.waiting
        self.client.server_time.note_load(url, total, peers=peers, servers=load.servers)

    def _fault(self, message: str, log_extra: Mapping[str, Any]) -> None:
        """A fault of this worker, not of its samples (a refused API key, the run's tokenizer files unusable:
        worker/sglang.py RequestContext): start nothing more and say why, once, however many requests meet it."""
        if self.fault is not None:
            return
        self.fault = message
        log.error("%s", message, extra=dict(log_extra))
        if not self.stopping:
            self.stop()
        if self.on_fault is not None:
            self.on_fault(message)

    # -- the RQ job's part ------------------------------------------------------------------------------
    async def dispatch(self, chunk: ChunkPayload) -> ChunkReport:
        """Start every sample of the chunk as slots free up; return once none is left to start."""
        rc = RunningChunk(chunk)
        started = await self.batcher.call_until_answered("start", self.ledger.start_chunk_call(rc.dataset, rc.id))
        if started != "ok":
            rc.report.status = started
            rc.report.not_started = len(chunk["samples"])
            self._write_meta(rc, started)
            return rc.report
        if chunk.get("conversation"):
            ids = [smp["id"] for smp in chunk["samples"] if smp.get("turns", 1) > 1]
            rc.resume = await in_thread_until_answered("conversations", self.ledger.conversation_turns, rc.dataset,
                                                       ids)
        self.running[rc.id] = rc
        self._write_meta(rc, "running")
        if self.heartbeat is not None and self._beat is None:
            self._beat = asyncio.create_task(self._keep_heartbeat())
        rc.lease = asyncio.create_task(self._keep_lease(rc))
        rc.lease.add_done_callback(lambda lease: self._lease_ended(rc, lease))
        try:
            await self._start_all(rc)
        except BaseException:
            for t in rc.tasks:
                t.cancel()
            await self._finish(rc, cancelled=True)
            raise
        finisher = asyncio.create_task(self._finish(rc))
        self.finishers.add(finisher)
        finisher.add_done_callback(self.finishers.discard)
        return rc.report

    async def _start_all(self, rc: RunningChunk) -> None:
        """Admit and start the chunk's samples as slots free up. Every free slot is filled at once: one
        admission script decides them all (budget/scripts.py ADMIT), then the admitted requests start together."""
        todo = list(reversed(rc.chunk["samples"]))  # a stack: the next sample to start is last
        stop = asyncio.ensure_future(self.hold.wait())  # what wakes a wait for a slot on a stop or an outage
        try:
            await self._start_each(rc, todo, stop)
        finally:
            stop.cancel()

    async def _start_each(self, rc: RunningChunk, todo: list[SamplePayload], stop: "asyncio.Future[Any]") -> None:
        """``_start_all``'s loop: ``todo`` is a stack (the next sample to start is last), ``stop`` the stop request."""
        while todo:
            n = await self._take_slots(len(todo), stop)
            if self.hold.is_set():
                rc.report.status = "unauthorized" if self.fault else "stopped" if self.stopping else "server down"
                rc.report.not_started += len(todo)
                self._release(n)
                return
            batch = [todo.pop() for _ in range(n)]
            if rc.resume:
                # Started conversations go on at their next turn, which admit_turn admits (worker/turns.py).
                fresh = [sample for sample in batch if sample["id"] not in rc.resume]
                for sample in batch:
                    if sample["id"] in rc.resume:
                        self._launch(rc, sample, 0, resumed=True)
                batch, n = fresh, len(fresh)
                if not batch:
                    continue
            turn_models: TurnModels | None = None
            if rc.lost.is_set():
                verdicts = [Admission(Admit.REVOKED, 0)] * n
            else:
                expected = await self.length_models.expected(rc.dataset)
                sd = await self.length_models.sd(rc.dataset)
                turn_models = await self._turn_models(rc)
                verdicts = await self._admit(rc, batch, expected, sd, turn_models)
            refused = self._launch_admitted(rc, batch, verdicts, turn_models)
            if not refused:
                continue
            # Put the refused samples back in order; what is done next depends on the first refusal.
            todo.extend(reversed([sample for sample, _ in refused]))
            verdict = refused[0][1]
            if verdict is Admit.FULL and self._dataset_in_flight(rc.dataset):
                # The budget is reserved by requests in flight; ours will end and free some: wait for that.
                await self.requests.wait_for_room()
                continue
            rc.report.status = {Admit.CLOSED: "closed", Admit.FULL: "full"}.get(verdict, "revoked")
            rc.report.not_started += len(todo)
            if verdict is Admit.CLOSED:
                # strict closes at admission; discard is idempotent
                await in_thread_until_answered("discard", self.ledger.discard, rc.dataset, CLOSE_REASON)
            return

    def _launch_admitted(self, rc: RunningChunk, batch: list[SamplePayload], verdicts: list[Admission],
                         turn_models: TurnModels | None) -> list[tuple[SamplePayload, Admit]]:
        """Start the admitted samples of ``batch``; the slots of the others go back. Returns the refused ones, in
        order, with their verdicts (a skipped sample is done already: counted, not refused)."""
        refused: list[tuple[SamplePayload, Admit]] = []
        for sample, admission in zip(batch, verdicts, strict=True):
            if admission.verdict is Admit.START:
                turns = sample.get("turns", 1)
                future = turn_models.future(0, turns) if turn_models is not None and turns > 1 else 0
                self._launch(rc, sample, admission.reserved, future=future)
            elif admission.verdict is Admit.SKIP:
                rc.report.skipped += 1
                self.slots.release()
            else:
                refused.append((sample, admission.verdict))
                self.slots.release()
        return refused

    async def _turn_models(self, rc: RunningChunk) -> TurnModels | None:
        """The per-turn models predict prices a chunk's conversations with; None when it has none or is not in
        predict mode (strict reserves max_new_tokens a turn, drain nothing)."""
        if not rc.chunk.get("conversation") or (await self.length_models.model(rc.dataset))[0] != "predict":
            return None
        return await self.length_models.turns(rc.dataset)

    async def _admit(self, rc: RunningChunk, batch: list[SamplePayload], expected: int, sd: float,
                     turn_models: TurnModels | None = None) -> list[Admission]:
        """One ADMIT for the batch; with conversations, one per number of turns, since predict reserves a
        conversation's expected tokens for all its turns (turn 0 and the later ones, each priced by its own
        model: ``TurnModels.conversation``), so that the conversations it lets start fit the budget to the end
        (docs/budget.md). They go in one round trip all the same."""
        pooled = (await self.length_models.model(rc.dataset))[1]
        groups: dict[int, list[int]] = {}
        for i, sample in enumerate(batch):
            groups.setdefault(sample.get("turns", 1) if rc.chunk.get("conversation") else 1, []).append(i)

        def call(turns: int, ids: list[str]) -> Any:
            """A conversation is priced whole, and its margin and taper are multiples of its whole spread."""
            price, spread, first = expected, sd, pooled
            if turns > 1:
                price = turn_models.conversation(turns) if turn_models is not None else expected * turns
                spread = turn_models.sd(turns) if turn_models is not None else sd
                first = turn_models.model(0) if turn_models is not None else pooled
            return self.batcher.call_until_answered("admit", self.ledger.admit_call(
                rc.dataset, ids, rc.id, price, self.config.predict_margin * spread,
                self.config.predict_taper * spread, duration_ms=self.length_models.deadline_ms(first)))

        if len(groups) == 1:
            (turns,) = groups
            return await call(turns, [s["id"] for s in batch])
        replies = await asyncio.gather(*(call(turns, [batch[i]["id"] for i in at]) for turns, at in groups.items()))
        verdicts: list[Admission] = [Admission(Admit.REVOKED, 0)] * len(batch)
        for at, got in zip(groups.values(), replies, strict=True):
            for i, admission in zip(at, got, strict=True):
                verdicts[i] = admission
        return verdicts

    def _launch(self, rc: RunningChunk, sample: SamplePayload, reserved: int, resumed: bool = False,
                future: int = 0) -> None:
        """Start a sample admitted with ``reserved`` tokens (a conversation: ``future`` of them for its later
        turns, which its turn-0 reservation holds until turn 1 is admitted)."""
        flight = Flight(time.monotonic(), reserved)
        rc.flights[sample["id"]] = flight
        rc.started += 1
        turns = sample.get("turns", 1)
        if turns > 1 and rc.chunk.get("conversation"):
            flight.conversation = True
            flight.future = min(future, reserved)
            task = asyncio.create_task(self._run_conversation(rc, sample, flight, resumed))
        else:
            task = asyncio.create_task(self._run_one(rc, sample, flight))
        rc.tasks.add(task)
        task.add_done_callback(rc.tasks.discard)

    async def _take_slots(self, most: int, stop: "asyncio.Future[Any]") -> int:
        """Wait for a free slot, then take every free one, up to ``most``. 0 if ``stop`` (the dispatcher's stop
        request) ends the wait first: then no slot is taken."""
        if not self.slots.locked():
            await self.slots.acquire()  # does not suspend while the semaphore is unlocked
        elif not await self._slot_or_stop(stop):
            return 0
        n = 1
        while n < most and not self.slots.locked():
            await self.slots.acquire()  # does not suspend while the semaphore is unlocked
            n += 1
        return n

    async def _slot_or_stop(self, stop: "asyncio.Future[Any]") -> bool:
        """Wait for whichever comes first: a slot frees (True: it is taken) or ``stop`` (False: none is)."""
        if self.hold.is_set():
            return False
        slot = asyncio.ensure_future(self.slots.acquire())
        try:
            await asyncio.wait((slot, stop), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the dispatch itself was cancelled: leave no slot taken
            if not slot.cancel():
                self.slots.release()
            raise
        if slot.done():
            return True
        slot.cancel()  # a slot granted meanwhile goes back to the semaphore (asyncio.Semaphore.acquire)
        return False

    def _release(self, n: int) -> None:
        for _ in range(n):
            self.slots.release()

    def _dataset_in_flight(self, dataset: str) -> bool:
        return any(rc.flights for rc in self.running.values() if rc.dataset == dataset)

    # -- requests ---------------------------------------------------------------------------------------
    async def _run_one(self, rc: RunningChunk, sample: SamplePayload, flight: Flight) -> None:
        sid, report = sample["id"], rc.report
        try:
            try:
                gen = await self.requests.generate(rc, flight, sample, sampling_params_of(rc.chunk, sample),
                                                   label=sid)
            finally:
                # A slot is a request at SGLang: the next sample may start while this one is committed.
                # Held until the commit's reply, each slot spent ~1/3 of its time waiting on Redis
                # (python -m bench.overhead; docs/performance.md, figure 3).
                self.slots.release()
            if isinstance(gen, GenerateError):
                await self.requests.fail(rc, flight, sid, gen)
            if not isinstance(gen, Generation):  # failed, or given back (RequestContext.generate)
                return
            outcome = await self.batcher.call_until_answered("commit", self.ledger.commit_call(
                rc.dataset, sid, gen.completion_tokens, result_record(rc.dataset, sample, gen, rc.chunk),
                chunk=rc.id, reserved=flight.reserved, finish_reason=gen.finish_reason))
            if outcome.committed:
                report.committed += 1
                report.tokens += gen.completion_tokens
                report.late += outcome.late
            else:
                report.duplicates += 1
            await self.requests.after_commit(rc.dataset, outcome.closed_now, outcome.used)
        finally:
            rc.flights.pop(sid, None)
            self.ended.set()

    async def _run_conversation(self, rc: RunningChunk, sample: SamplePayload, flight: Flight,
                                resumed: bool) -> None:
        """A conversation keeps its slot from its first turn to its end (worker/turns.py says why)."""
        try:
            await run_conversation(self.requests, rc, sample, flight, resumed)
        finally:
            self.slots.release()
            rc.flights.pop(sample["id"], None)
            self.ended.set()

    async def _finish(self, rc: RunningChunk, cancelled: bool = False) -> None:
        """Wait for the chunk's last request, then let it go. A chunk interrupted by a crash of this code is
        left to its lease: the producer reclaims it and re-enqueues what is unfinished."""
        if rc.tasks:
            results = await asyncio.gather(*list(rc.tasks), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
            if errors:
                log.error("chunk %s: %d requests ended in an unexpected error (first: %r); its lease will lapse "
                          "and the producer re-enqueues what is unfinished", rc.id, len(errors), errors[0])
                cancelled = True
        if rc.lease is not None:
            if rc.lease.done() and not rc.lease.cancelled() and rc.lease.exception() is not None:
                cancelled = True  # its lease lapses (_lease_ended said why): the producer reclaims the chunk
            rc.lease.cancel()
            await asyncio.gather(rc.lease, return_exceptions=True)
        self.running.pop(rc.id, None)
        if not cancelled:
            await self.batcher.call_until_answered("finish", self.ledger.finish_chunk_call(
                rc.dataset, rc.id, request_ms=round(rc.request_s * 1000), server_ms=round(rc.server_s * 1000)))
        self._write_meta(rc, "interrupted" if cancelled else "done")

    def _write_meta(self, rc: RunningChunk, state: str) -> None:
        """Copy the chunk's progress into its RQ job's ``meta`` field (JSON, as RQ's JSONSerializer writes it).

        Only that one field is written, and RQ never clobbers it: on success it saves the job with
        ``include_meta=False``. The job hash must still exist: an HSET on an expired or deleted job would leave a
        stub hash without a TTL (budget/scripts.py JOB_META). Best effort, and not awaited: it rides in the next
        batch (worker/batch.py); the figures are for people (rq-dashboard's job page), the budget and liveness
        never read them, so a Redis error is logged and the next write catches up."""
        rc.meta_at = time.monotonic()
        sent = self.batcher.call(self.ledger.job_meta_call(rc.id, JSONSerializer.dumps(rc.meta(state))))
        sent.add_done_callback(lambda done: _log_meta_error(rc.id, done))

    async def _keep_lease(self, rc: RunningChunk) -> None:
        """Refresh the lease every LEASE_MS/4 and, in predict mode, grow running requests' reservations every
        BUDGETQ_RESERVE_INTERVAL seconds (more often for short requests: LengthModels.restate_interval): a request
        that has run long is expected to run longer."""
        last_lease = priced = time.monotonic()
        while True:
            await asyncio.sleep(min(self.length_models.restate_interval(), LEASE_MS / 4000))
            now = time.monotonic()
            reserved: int | None = None
            progress: list[int] | None = None
            turn_progress: list[list[int]] | None = None
            try:
                mode, model = await self.length_models.model(rc.dataset)
                if mode == "predict" and rc.flights:
                    progress = []
                    turn_models = await self._turn_models(rc)
                    if turn_models is not None:
                        turn_progress = [[] for _ in range(TURN_BUCKETS)]
                    lag = self.length_models.lag()  # one restatement: the same for every flight
                    for f in rc.flights.values():
                        # Priced, and published as its censored length, at the progress it will have when the next
                        # restatement replaces both (LengthModels.ahead says why).
                        ahead = self.length_models.ahead(now - f.started, lag)
                        if f.conversation and turn_models is not None and turn_progress is not None:
                            f.reserved = turn_models.current(f.turn, ahead) + f.future
                            turn_progress[turn_bucket(f.turn)].append(int(ahead))
                        else:
                            f.reserved = model.reserve(ahead, self.length_models.model_error) + f.future
                            progress.append(int(ahead))
                    reserved = sum(f.reserved for f in rc.flights.values())
                else:
                    priced = now  # none of this chunk's prices stands
                    if now - last_lease < LEASE_MS / 4000:
                        continue
                ok = await self.batcher.call(self.ledger.refresh_chunk_call(
                    rc.dataset, rc.id, reserved=reserved, progress=progress, turn_progress=turn_progress))
                if reserved is not None:  # how long the prices before these stood (LengthModels.lag)
                    self.length_models.restated(time.monotonic() - priced)
                    priced = now
                last_lease = now
            except redis.RedisError as exc:  # Redis hiccup: keep trying; the lease has slack for three misses
                log.warning("lease refresh for %s failed: %s", rc.id, exc)
                continue
            if not ok:
                log.warning("chunk %s was reclaimed or discarded: starting nothing more of it", rc.id)
                rc.lost.set()
                return
            if now - rc.meta_at >= META_INTERVAL_S:
                self._write_meta(rc, "running")

    def _lease_ended(self, rc: RunningChunk, lease: "asyncio.Task[None]") -> None:
        """The lease task ends when the chunk finishes (cancelled) or is lost; any other end is a bug of this code,
        said at once: the lease lapses, so the chunk starts nothing more (as when lost) and is left to the
        producer, which reclaims it and re-enqueues what is unfinished (``_finish``: interrupted)."""
        if lease.cancelled() or lease.exception() is None:
            return
        log.error("chunk %s: its lease refresh ended in an unexpected error; starting nothing more of it, its lease "
                  "will lapse and the producer re-enqueues what is unfinished", rc.id, exc_info=lease.exception())
        rc.lost.set()

    async def _keep_heartbeat(self) -> None:
        """One task per worker: renew its RQ registration (rq-dashboard, ``rq info``) while chunks run, since a
        SimpleWorker's main thread does not while it waits in a chunk job. The call runs on a thread of its own,
        never the loop's, so a heartbeat waiting on a silent connection delays nothing else; it is best effort
        (the lease, not RQ's registration, says whether the worker lives: budget/ledger.py)."""
        assert self.heartbeat is not None
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            if not self.running:
                continue  # between chunks RQ's own work loop heartbeats
            try:
                await asyncio.to_thread(self.heartbeat)
            except Exception as exc:  # noqa: BLE001 - best effort; the next one catches up
                log.debug("RQ heartbeat failed: %s", exc)

    # -- shutdown ---------------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Wait until every started request is committed (a warm shutdown keeps all GPU work)."""
        while self.finishers:
            await asyncio.gather(*list(self.finishers), return_exceptions=True)
        self.length_models.close()
        if self.window is not None:
            await asyncio.to_thread(self.window.close)
        if self._beat is not None:
            self._beat.cancel()
