"""The speed model: a GPU-like continuous batch, driven by events instead of ticks.

Terminology
- running: requests holding one of `max_running` slots (prefilling or decoding); the rest wait in a
  FIFO queue, which is unbounded as in SGLang, so overload shows up as latency, never as errors.
- decoding: running requests past their prefill. With n of them, the batch emits
  `tps * min(n, saturation_batch)` tokens per second in total, shared equally: each gets
  `tps * min(n, sat) / n` tokens per second.
- progress P: the tokens one decoding request has received since the engine started. Since all
  decoding requests advance at the same rate, a request that starts at P0 and needs L tokens ends
  exactly when P reaches P0 + L, whatever happens to the batch size meanwhile.

Why: ticking every request every few milliseconds would eat the CPU the system under test needs
(the simulator shares two cores with it). Here P is advanced only when something happens (a request
arrives, ends, is aborted, or finishes prefill), finish thresholds sit in a heap, and one timer is
armed for the earliest of them. Each event costs O(log n).

Prefill (when `prefill_tokens_per_second > 0`) is a serial resource: uncached prompt tokens of
admitted requests are processed one request after another, while the request holds its slot but
does not decode yet. It does not slow decoding down (SGLang's chunked prefill does, a little).

All rates are simulated; on the wall clock they are multiplied by `time_scale`.
"""
from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Literal, Sequence

from sglang_sim.config import SimConfig
from sglang_sim.prefix_cache import PrefixCache

JobState = Literal["queued", "prefill", "decoding", "done"]

# A finish due within this many wall seconds is taken now: it batches near-simultaneous finishes and
# absorbs timer jitter, at the price of answering up to half a millisecond early.
_EPS_SECONDS = 0.0005


@dataclass(frozen=True)
class Outcome:
    """How a job ended. `started` is False when it never left the queue (SGLang: "Abort before prefill")."""

    aborted: bool
    generated: int
    cached_tokens: int
    started: bool


@dataclass(eq=False)
class Job:
    """One request inside the engine; the HTTP layer awaits `future`."""

    seq: int
    prompt: Sequence[Hashable]
    target_tokens: int
    future: "asyncio.Future[Outcome]"
    state: JobState = "queued"
    cached_tokens: int = 0
    progress_at_start: float = 0.0
    ends_aborted: bool = False  # an injected abort: reaching target_tokens ends it as aborted


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /sim/stats, /metrics and /get_server_info. Integrals are in wall seconds:
    mean occupancy over a window = delta(running_integral) / delta(uptime)."""

    running: int
    decoding: int
    queued: int
    submitted: int
    completed: int
    aborted: int
    prompt_tokens_total: int
    cached_tokens_total: int
    completion_tokens_total: int
    running_integral: float
    decoding_integral: float
    queued_integral: float
    uptime: float
    last_gen_throughput: float
    #: seconds with a request running or queued: the server's busy time, what budgetq's server time shares out
    busy_integral: float = 0.0


@dataclass
class _Counters:
    submitted: int = 0
    completed: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    running_integral: float = 0.0
    decoding_integral: float = 0.0
    queued_integral: float = 0.0
    busy_integral: float = 0.0
    last_gen_throughput: float = 0.0


@dataclass
class _Heaps:
    # (wall time prefill ends, seq, job) and (progress threshold, seq, job); seq breaks ties so jobs
    # are never compared. Aborted jobs stay in the heaps and are skipped when they surface.
    prefill: list[tuple[float, int, Job]] = field(default_factory=list)
    decode: list[tuple[float, int, Job]] = field(default_factory=list)


class Engine:
    """The batch scheduler. Use from one event loop; every public method is synchronous and cheap.

    ``clock`` must tell the time that loop's timers run on (the finish timer is the loop's ``call_later``): the
    default, time.monotonic, is what asyncio's loops use; tests pass a virtual-time loop's ``loop.time``
    (tests/virtual_time.py), so the model's times come out exact."""

    def __init__(self, cfg: SimConfig, cache: PrefixCache, clock: Callable[[], float] = time.monotonic) -> None:
        self._cfg = cfg
        self._cache = cache
        self._clock = clock
        self._tps = cfg.tokens_per_second_per_request * cfg.time_scale
        self._prefill_tps = cfg.prefill_tokens_per_second * cfg.time_scale
        self._queue: deque[Job] = deque()
        self._heaps = _Heaps()
        self._n_queued = 0
        self._n_running = 0
        self._n_decoding = 0
        self._progress = 0.0
        self._prefill_free_at = 0.0
        self._started_at = clock()
        self._t_last = self._started_at
        self._seq = 0
        self._c = _Counters()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- public API ---------------------------------------------------------------------------

    def next_seq(self) -> int:
        """A fresh arrival number (used to seed per-request RNGs in arrival order)."""
        self._seq += 1
        return self._seq

    def submit(self, seq: int, prompt: Sequence[Hashable], target_tokens: int, ends_aborted: bool = False) -> Job:
        """Queue a request that will decode `target_tokens` tokens; await `job.future` for the end.

        With `ends_aborted` the job ends as an abort once it has its tokens (fault injection)."""
        if self._closed:
            raise RuntimeError("engine is closed")
        self._loop = asyncio.get_running_loop()
        self._advance(self._clock())  # integrals up to now before the counts change
        job = Job(seq=seq, prompt=prompt, target_tokens=target_tokens, future=self._loop.create_future(),
                  ends_aborted=ends_aborted)
        self._c.submitted += 1
        self._c.prompt_tokens += len(prompt)
        if self._cfg.zero_latency:
            job.cached_tokens = self._cache.match_and_insert(prompt)
            self._c.cached_tokens += job.cached_tokens
            job.state = "decoding"  # so _end books it as a normal finish
            self._n_running += 1
            self._n_decoding += 1
            self._end(job, aborted=ends_aborted, generated=target_tokens)
            return job
        self._queue.append(job)
        self._n_queued += 1
        self._step()
        return job

    def abort(self, job: Job) -> bool:
        """End `job` now with whatever it has generated; False if it had already ended (or just did)."""
        return self.abort_many([job]) == 1

    def abort_many(self, jobs: Iterable[Job]) -> int:
        """Abort several jobs at once, as one scheduler step: none of the slots they free is refilled
        until all are gone (SGLang clears the waiting queue before the running batch). Returns how
        many were aborted."""
        self._advance(self._clock())
        aborted = 0
        for job in jobs:
            if job.state == "done":
                continue
            generated = 0
            if job.state == "decoding":
                done = math.floor(self._progress - job.progress_at_start + 1e-6)
                if done >= job.target_tokens:
                    # It finished before its timer fired: report the finish, not an abort.
                    self._end(job, aborted=job.ends_aborted, generated=job.target_tokens)
                    continue
                generated = max(0, done)
            self._end(job, aborted=True, generated=generated)
            aborted += 1
        if not self._closed:
            self._step()
        return aborted

    def close(self) -> None:
        """Abort everything still queued or running and stop the timer (server shutdown)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.abort_many(list(self._queue) + [j for _, _, j in self._heaps.prefill + self._heaps.decode])

    def flush_cache(self) -> bool:
        """Drop the prefix cache if idle, as SGLang's /flush_cache does; True if flushed."""
        if self._n_running or self._n_queued:
            return False
        self._cache.clear()
        return True

    def stats(self) -> EngineStats:
        """Counters and occupancy integrals up to now."""
        now = self._clock()
        self._advance(now)
        c = self._c
        return EngineStats(
            running=self._n_running,
            decoding=self._n_decoding,
            queued=self._n_queued,
            submitted=c.submitted,
            completed=c.completed,
            aborted=c.aborted,
            prompt_tokens_total=c.prompt_tokens,
            cached_tokens_total=c.cached_tokens,
            completion_tokens_total=c.completion_tokens,
            running_integral=c.running_integral,
            decoding_integral=c.decoding_integral,
            queued_integral=c.queued_integral,
            uptime=now - self._started_at,
            last_gen_throughput=c.last_gen_throughput,
            busy_integral=c.busy_integral,
        )

    # -- the event step -----------------------------------------------------------------------

    def _step(self) -> None:
        """Bring the model up to now, end what is due, admit from the queue, re-arm the timer."""
        now = self._clock()
        self._advance(now)
        self._finish_due(now)
        self._admit(now)
        self._arm(now)

    def _rate(self) -> float:
        """Wall-clock tokens per second each decoding request receives now."""
        n = self._n_decoding
        return self._tps * min(n, self._cfg.saturation_batch) / n if n else 0.0

    def _advance(self, now: float) -> None:
        dt = now - self._t_last
        if dt <= 0:
            return
        self._progress += self._rate() * dt
        c = self._c
        if self._n_decoding:
            # Simulated tokens/s of the whole batch, kept when idle like SGLang's last measurement.
            c.last_gen_throughput = self._cfg.tokens_per_second_per_request * min(
                self._n_decoding, self._cfg.saturation_batch
            )
        c.running_integral += self._n_running * dt
        c.decoding_integral += self._n_decoding * dt
        c.queued_integral += self._n_queued * dt
        if self._n_running or self._n_queued:
            c.busy_integral += dt
        self._t_last = now

    def _finish_due(self, now: float) -> None:
        prefill = self._heaps.prefill
        while prefill and (prefill[0][2].state != "prefill" or prefill[0][0] <= now + _EPS_SECONDS):
            _, _, job = heapq.heappop(prefill)
            if job.state == "prefill":
                self._start_decoding(job)
        decode = self._heaps.decode
        slack = self._rate() * _EPS_SECONDS + 1e-9
        while decode and (decode[0][2].state != "decoding" or decode[0][0] <= self._progress + slack):
            _, _, job = heapq.heappop(decode)
            if job.state == "decoding":
                self._end(job, aborted=job.ends_aborted, generated=job.target_tokens)

    def _admit(self, now: float) -> None:
        cfg = self._cfg
        while self._n_running < cfg.max_running and self._queue:
            job = self._queue.popleft()
            if job.state != "queued":
                continue  # aborted while waiting
            self._n_queued -= 1
            self._n_running += 1
            job.cached_tokens = self._cache.match_and_insert(job.prompt)
            self._c.cached_tokens += job.cached_tokens
            uncached = len(job.prompt) - job.cached_tokens
            if self._prefill_tps > 0 and uncached > 0:
                start = max(now, self._prefill_free_at)
                self._prefill_free_at = start + uncached / self._prefill_tps
                job.state = "prefill"
                heapq.heappush(self._heaps.prefill, (self._prefill_free_at, job.seq, job))
            else:
                self._start_decoding(job)

    def _start_decoding(self, job: Job) -> None:
        job.state = "decoding"
        self._n_decoding += 1
        if job.target_tokens <= 0:
            self._end(job, aborted=job.ends_aborted, generated=0)
            return
        job.progress_at_start = self._progress
        heapq.heappush(self._heaps.decode, (self._progress + job.target_tokens, job.seq, job))

    def _end(self, job: Job, aborted: bool, generated: int) -> None:
        started = job.state != "queued"
        if job.state == "queued":
            self._n_queued -= 1
        else:
            self._n_running -= 1
        if job.state == "decoding":
            self._n_decoding -= 1
        job.state = "done"
        c = self._c
        c.completion_tokens += generated
        if aborted:
            c.aborted += 1
        else:
            c.completed += 1
        if not job.future.done():
            job.future.set_result(Outcome(aborted, generated, job.cached_tokens, started))

    def _arm(self, now: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        heaps = self._heaps
        while heaps.prefill and heaps.prefill[0][2].state != "prefill":
            heapq.heappop(heaps.prefill)
        while heaps.decode and heaps.decode[0][2].state != "decoding":
            heapq.heappop(heaps.decode)
        when = math.inf
        if heaps.prefill:
            when = heaps.prefill[0][0]
        if heaps.decode and self._n_decoding:
            when = min(when, now + (heaps.decode[0][0] - self._progress) / self._rate())
        if when < math.inf and self._loop is not None:
            self._timer = self._loop.call_later(max(0.0, when - now), self._step)
