"""``worker.Worker``: the RQ worker class budgetq's workers run (``rq worker -w worker.Worker``).

Why a worker class and not flags: rq resolves ``-w`` before it reads the settings module, and a class is the
one place that can *enforce* what a deployment must never get wrong:
- JSON only. Whatever ``-S`` says, jobs are read with RQ's JSON serializer: a pickle payload written into
  Redis by anyone is never unpickled (unpickling is code execution).
- An allowlist. Even with JSON, RQ imports and calls any dotted name a job names; this worker fails every
  job whose function is not in ``worker.rqworker.ALLOWED``, without importing it.
- No fork per job. A forked work horse would re-open the HTTP session and event loop per job, and its requests
  would die with it. This is a SimpleWorker with one Runtime (an event-loop thread, one aiohttp session, the
  dispatcher) for its life: a chunk job returns once its samples have started, and their requests run on
  while the worker takes the next chunk (worker/dispatch.py). Liveness comes from the chunk lease
  (budget/ledger.py), not from RQ's abandoned-job detection (worker TTL plus a 600 s maintenance interval).
- A dead server holds the worker. While every SGLang server of the worker is down (worker/health.py), it gives
  its chunks back and takes none from RQ (``_wait_for_a_server``), so the healthy workers take them; a SIGTERM
  ends it within seconds in that state too.
- A refused API key ends the worker. SGLang answering 401/403 means this worker's ``SGLANG_API_KEY`` is wrong
  or missing: the dispatcher gives its chunk back (worker/dispatch.py), the worker stops as after a SIGTERM
  (requests already running are committed, rq unregisters it) and exits with EXIT_CONFIG, so a supervisor
  shows it failing instead of it sitting registered and idle (docs/operations.md says why).

The RQ job function (``run_chunk``; ``worker.Worker`` runs only the names in ALLOWED), and the Runtime it hands
chunks to: what a worker process keeps between jobs, one event loop thread, one HTTP session, one dispatcher.

RQ calls a job function per chunk on the worker's main thread. The requests themselves run on an event loop
in a background thread that lives as long as the worker, so they keep going while the main thread returns
to RQ and dequeues the next chunk (see worker/dispatch.py for why that matters), and one aiohttp session
serves every job (a session per job halves a fast server's request rate). A job run by any other RQ worker
gets a Runtime built on first use, so ``rq worker -S json`` still works.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import signal
import socket
import threading
import time
from typing import Any, Callable

import aiohttp
import redis
from rq.exceptions import StopRequested
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.worker import BaseWorker, SimpleWorker

from budget import runtime
from budget import runtime as budget_connection
from budget.ledger import REDIS_DOWN, Ledger
from budget.record import JOB_FUNCTION, OTHER_VERSION, REASONING_PARSERS, VERSION, ChunkPayload
from worker.config import WorkerConfig
from worker.dispatch import Dispatcher
from worker.health import HealthMonitor
from worker.loadreport import LoadReporter
from worker.serverinfo import ServerInfoReporter
from worker.sglang import ChunkReport, SGLangClient

log = logging.getLogger("budgetq.worker")

#: The exit status of a worker whose SGLang server refused its API key (sysexits.h EX_CONFIG).
EXIT_CONFIG = 78
#: Seconds a blocking dequeue waits before it looks whether a configuration fault has stopped the worker.
FAULT_POLL_S = 2
#: Seconds teardown waits for the pubsub thread once its connection is closed under it (``Worker.unsubscribe``).
UNSUBSCRIBE_WAIT_S = 5


def _setup_logging() -> None:
    """rq configures its own logger only; give budgetq's messages a handler of their own, once.

    BUDGETQ_LOG_FORMAT=json makes every line of the worker one JSON object (budget/runtime.py): budgetq's, rq's own
    (its handlers are given the same formatter) and anything else that reaches the root logger (other libraries'
    warnings, Python warnings). An invalid value stops the worker at start, naming the variable."""
    fmt = runtime.parse_format(os.environ.get("BUDGETQ_LOG_FORMAT"))
    level = os.environ.get("BUDGETQ_LOG_LEVEL", "INFO").strip().upper() or "INFO"
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"BUDGETQ_LOG_LEVEL={level!r}: expected DEBUG, INFO, WARNING or ERROR")
    root = logging.getLogger("budgetq")
    if root.handlers:
        return
    runtime.configure_logs("budgetq", fmt=fmt, level=level,
                   text=runtime.TextFormatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S"))
    if fmt == "json":
        for handler in logging.getLogger("rq.worker").handlers:
            handler.setFormatter(runtime.JsonFormatter())
        if not logging.getLogger().handlers:
            runtime.configure_logs("", fmt="json", level=logging.WARNING)
            logging.captureWarnings(True)


#: How long one blocking dequeue (BLPOP) waits for a chunk before RQ heartbeats and waits again. RQ waits
#: worker_ttl - 15 = 405 s and sets its pool's socket_timeout 10 s above that (``_set_connection``): a
#: connection that went silent (no reset ever arrives) then held the work loop, and every chunk behind it, for
#: 7 minutes. With 10 s RQ sets 20 s: a silent dequeue connection is dropped and replaced within that, at the
#: cost of one empty BLPOP and a heartbeat every 10 s while the queues are empty.
DEQUEUE_TIMEOUT_S = 10

#: The cyclic garbage collector's thresholds in a worker process (Python's default: 700, 10, 10). A young
#: collection runs whenever 700 more container objects are alive than at the last one, and a worker's live set
#: swings by more than that all the time: each request in flight holds its task, aiohttp request and response and
#: their futures, each chunk brings its samples' dicts and lists. With the default, a worker at 64 in flight
#: against a zero-latency server ran ~90 young, ~8 middle and ~0.6 full collections a second, which found nearly
#: everything alive and freed almost nothing, and spent ~70 µs of CPU a sample on them (gc.callbacks;
#: python -m bench.overhead, docs/performance.md figure 3). Reference cycles are still collected, less often.
GC_THRESHOLDS = (50_000, 20, 10)


def _tune_gc() -> None:
    """Once the worker is built: what was allocated so far (modules, RQ, aiohttp, the runtime) lives as long as
    the process, so ``gc.freeze`` takes it out of every later collection, and the thresholds above make young
    collections rare."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class Worker(SimpleWorker):
    @property
    def dequeue_timeout(self) -> int:
        return min(DEQUEUE_TIMEOUT_S, max(1, self.worker_ttl - 15))

    def __init__(self, queues: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["serializer"] = JSONSerializer
        _setup_logging()
        super().__init__(queues, *args, **kwargs)
        # The CLI built the Queue objects with its own serializer: rebuild them with ours.
        self.queues = [Queue(q.name, connection=self.connection, serializer=JSONSerializer) for q in self.queues]
        self._ordered_queues = self.queues[:]
        self.config = WorkerConfig.from_env()
        self.runtime = Runtime(self.connection, self.config, heartbeat=self._job_heartbeat,
                               on_fault=self._config_fault, name=self.name)
        install(self.runtime)
        _tune_gc()
        # rq installs its SIGTERM/SIGINT handlers only once the worker has registered itself: a signal in
        # between (a deploy that starts and stops workers at once) ended the process by the signal's default
        # action, its registration left behind. Until rq's handlers take over, a signal asks for a stop that
        # the work loop honours before it takes any job.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._stop_before_work)
            signal.signal(signal.SIGINT, self._stop_before_work)
        log.info("budgetq worker: %d server(s), %s requests in flight per worker, pid %d",
                 len(self.config.servers), self.config.concurrency or "an automatic number of", os.getpid())

    def _stop_before_work(self, signum: Any, frame: Any) -> None:
        self._stop_requested = True
        self._stop_dispatching()

    def _stop_dispatching(self) -> None:
        self.runtime.loop.call_soon_threadsafe(self.runtime.dispatcher.stop)

    def _config_fault(self, reason: str) -> None:
        """From the request thread, once: the dispatcher has stopped for a configuration fault. rq's work loop
        stops before its next dequeue, and a dequeue under way gives up within FAULT_POLL_S (below).

        Not a SIGTERM to ourselves: the fault usually arrives just after a chunk job returned, while rq waits
        in BLPOP, and a signal landing after BLPOP popped a job but before rq ran it would lose that job (its
        chunk stays queued in budgetq's books, and no worker ever sees it again)."""
        self._stop_requested = True

    def _job_heartbeat(self) -> None:
        # A SimpleWorker does not heartbeat while a job runs; the dispatcher's heartbeat task calls this (on a
        # thread of its own) so the worker stays visible (rq-dashboard, `rq info`) through long chunks. Sent on
        # the runtime's short-timeout pool, not RQ's, and not flagged as a lost work loop.
        with self.runtime.redis.pipeline(transaction=False) as p:
            super().heartbeat(self.worker_ttl, pipeline=p)
            p.execute()

    def request_stop(self, signum: Any, frame: Any) -> None:
        # Warm shutdown: the chunk being dispatched gives its unstarted samples back at once (the producer
        # re-enqueues them); requests already running finish and are committed before the worker exits.
        # Marked here too: rq marks a stop only while a job runs and otherwise raises StopRequested, so a Redis
        # error in the teardown that follows read as a lost Redis to work() below, which started the loop again.
        self._stop_requested = True
        self._stop_dispatching()
        super().request_stop(signum, frame)

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            func_name = job.func_name
        except Exception as exc:  # not JSON, or not an RQ job at all
            self._refuse(job, queue, f"unreadable job payload ({type(exc).__name__}); budgetq accepts JSON only")
            return
        if func_name not in ALLOWED:
            self._refuse(job, queue, f"job function {func_name!r} is not allowed by worker.Worker")
            return
        # Redis lost while RQ finishes the job (its heartbeat, result, registries) reaches rq's work loop as an
        # "unhandled exception, quitting": flagged, work() below waits for Redis and starts the loop again.
        self._guard(super().execute_job, job, queue)

    def _refuse(self, job: Job, queue: Queue, reason: str) -> None:
        log.error("refused job %s: %s", job.id, reason)
        try:
            self.handle_job_failure(job, queue, exc_string=reason)
        except Exception:  # the job hash may be garbage too; never let it take the worker down
            log.exception("could not mark job %s failed", job.id)

    # -- surviving a Redis restart ----------------------------------------------------------------------
    # rq's work loop quits on a Redis error outside dequeue (a heartbeat, maintenance, the teardown itself).
    # A GPU host's workers should not need a human after a Redis restart: work() waits for Redis to come back
    # and starts the loop again. Meanwhile requests already running go on and their commits wait for Redis
    # (worker/dispatch.py), so nothing SGLang produced is lost.
    def work(self, burst: bool = False, *args: Any, **kwargs: Any) -> bool:  # type: ignore[override]
        worked = False
        try:
            while True:
                self._redis_lost = False
                try:
                    worked = super().work(burst, *args, **kwargs) or worked
                except REDIS_DOWN as exc:
                    self._redis_lost = True
                    log.warning("Redis error in the work loop: %s", exc)
                if not self._redis_lost or self._stop_requested or burst:
                    return worked
                if not self._wait_for_redis():
                    return worked  # stopped while Redis was away
        finally:
            try:
                self.runtime.close()
            except Exception:
                log.exception("closing the worker runtime")
            if self.runtime.dispatcher.fault is not None:
                # A warning: the one error line is the dispatcher's, naming the server and the variable.
                log.warning("budgetq worker: exiting with status %d: fix SGLANG_API_KEY (or the server's "
                            "--api-key) and start the worker again", EXIT_CONFIG)
                raise SystemExit(EXIT_CONFIG)  # the configuration fault outranks whatever work() was returning

    def _wait_for_redis(self) -> bool:
        """Until Redis answers (True) or a stop is asked (False). rq's signal handlers, once its loop has run,
        raise StopRequested out of the sleep; budgetq's, before that, only mark the stop: both end the wait, and
        nothing more is sent to a Redis that is still away."""
        delay = 0.5
        log.warning("waiting for Redis to come back")
        try:
            while not self._stop_requested:
                try:
                    self.connection.ping()
                    break
                except REDIS_DOWN:
                    time.sleep(delay)
                    delay = min(5.0, delay * 2)
        except StopRequested:  # rq's handler: Worker.request_stop has marked the stop
            return False
        if self._stop_requested:
            return False
        # Our registration may have outlived the outage without a death mark: it is ours, clear it.
        self.connection.delete(self.key)
        log.warning("Redis is back: working again")
        return True

    def _guard(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except REDIS_DOWN:
            self._redis_lost = True
            raise

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        """rq's blocking dequeue, in slices of FAULT_POLL_S: a worker whose server refused its key stops
        waiting for work (None ends rq's loop) instead of sitting registered and idle until a job comes."""
        if timeout is None:  # burst: one non-blocking pop
            result = self._guard(super().dequeue_job_and_maintain_ttl, timeout, max_idle_time)
        else:
            since = time.monotonic()
            while True:
                if self.runtime.dispatcher.fault is not None:
                    return None
                if not self.runtime.health.checked.wait(FAULT_POLL_S):
                    continue  # the servers are being asked at start (worker/health.py)
                if self.runtime.health.all_down.is_set():
                    self._wait_for_a_server()
                    continue
                idle_left = None if max_idle_time is None else max_idle_time - (time.monotonic() - since)
                if idle_left is not None and idle_left <= 0:
                    return None
                wait = FAULT_POLL_S if idle_left is None else max(1, min(FAULT_POLL_S, math.ceil(idle_left)))
                # Guarded too: rq retries a lost connection inside its pop, but its set_state before the pop is
                # outside that retry, and a TimeoutError there ends rq's loop ("Redis connection timeout, quitting").
                result = self._guard(super().dequeue_job_and_maintain_ttl, min(timeout, wait), max_idle_time=wait)
                if result is not None:
                    break
        self._redis_lost = False  # rq's dequeue waits out connection errors by itself
        return result

    def _wait_for_a_server(self) -> None:
        """Every SGLang server of this worker is down (worker/health.py): take no chunk, so that the healthy workers
        take them, until one answers /health again. In slices of FAULT_POLL_S, heartbeating so that the worker stays
        registered; a SIGTERM ends the wait at once (rq's handler raises StopRequested here, the loop exits)."""
        while self.runtime.health.all_down.is_set() and not self._stop_requested \
                and self.runtime.dispatcher.fault is None:
            self.heartbeat()
            self.runtime.health.up.wait(FAULT_POLL_S)

    def _pubsub_exception_handler(self, exc: Exception, pubsub: Any, pubsub_thread: Any) -> None:
        """rq's teardown stops its pubsub thread, waits 1 s for it, then closes the thread's connection. On a
        silent connection the thread is still polling then, and meets the closed socket (a TypeError inside
        redis-py): that is the stop it was asked for, not a fault, so it ends without a traceback. While the
        thread is meant to run, rq's handler decides (retry a lost connection, end on anything else)."""
        if not pubsub_thread._running.is_set():  # redis-py's PubSubWorkerThread: cleared by stop()
            return
        BaseWorker._pubsub_exception_handler(self, exc, pubsub, pubsub_thread)

    def unsubscribe(self) -> None:
        """rq's unsubscribe, with one thread only ever closing the pubsub. rq's sends UNSUBSCRIBE, stops the
        thread, waits 1 s for it and closes the pubsub from this thread. On a silent connection the thread is
        still blocked in its read then (the reply never comes), and the close's disconnect wakes it: the thread
        ends and closes the same pubsub itself, and when that lands between the disconnect and the rest of this
        thread's close, redis-py's reset meets ``connection = None`` (an AttributeError out of teardown: the
        worker exited 1; the chaos suite's redis-blackhole scenario met it). Here the blocked thread is woken by
        a disconnect alone and left to close the pubsub; this thread closes it only once that thread has ended
        (then the close has nothing left to race). A Redis error sending UNSUBSCRIBE still stops the thread."""
        pubsub, thread = self.pubsub, self.pubsub_thread
        if not thread or pubsub is None:
            return
        self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
        try:
            pubsub.unsubscribe()
        except REDIS_DOWN as exc:
            log.warning("unsubscribing from the worker channel: %s", exc)
        finally:
            thread.stop()
        thread.join(timeout=1)
        if thread.is_alive():
            conn = pubsub.connection
            if conn is not None:
                conn.disconnect()  # wakes the blocked read; the thread then ends and closes the pubsub
            thread.join(timeout=UNSUBSCRIBE_WAIT_S)
        if not thread.is_alive():
            pubsub.close()  # a no-op where the thread closed it; the thread never runs again
        else:
            log.warning("the worker channel's thread did not end in %d s; leaving it to close its connection",
                        1 + UNSUBSCRIBE_WAIT_S)

    def heartbeat(self, *args: Any, **kwargs: Any) -> None:
        self._guard(super().heartbeat, *args, **kwargs)

    def run_maintenance_tasks(self) -> None:
        self._guard(super().run_maintenance_tasks)

    def check_for_suspension(self, burst: bool) -> None:
        self._guard(super().check_for_suspension, burst)

    def teardown(self) -> None:
        self._guard(super().teardown)


_current: "Runtime | None" = None


class Runtime:
    def __init__(self, connection: "redis.Redis", config: WorkerConfig,
                 heartbeat: Callable[[], None] | None = None,
                 on_fault: Callable[[str], None] | None = None, name: str | None = None) -> None:
        self.config = config
        # A pool of its own, with short timeouts (budget/runtime.py), not RQ's: RQ sets 415 s on its pool for
        # its blocking dequeue, and a ledger call stuck that long on a silent connection outlives every lease.
        # The loop's ledger calls, the RQ heartbeat and the server-info thread use it; RQ's main thread does not.
        self.redis = budget_connection.like(connection)
        self.ledger = Ledger(self.redis)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="budgetq-requests", daemon=True)
        self.thread.start()
        self.dispatcher: Dispatcher = self._call(self._make(heartbeat, on_fault))
        self._closed = False
        # Best effort, on a thread of its own: the servers' version and model for the manifests (bq:server_info).
        client = self.dispatcher.client

        def on_router(url: str) -> None:  # from the reporter's thread to the request loop
            self.loop.call_soon_threadsafe(client.note_router, url)

        self.server_info = ServerInfoReporter(self.redis, config, on_router=on_router).start()
        dispatcher = self.dispatcher

        def on_health(down: bool) -> None:  # from the health thread to the request loop
            self.loop.call_soon_threadsafe(dispatcher.set_servers_down, down)

        worker = name or f"{socket.gethostname()}.{os.getpid()}"
        self.health = HealthMonitor(self.redis, config, worker=worker, on_change=on_health)
        client.on_unreachable = self.health.suspect
        self.health.start()
        # What it does with each server, for `produce servers` (bq:server_load), on a thread of its own too.
        self.load = LoadReporter(self.redis, config, self.dispatcher, worker=worker).start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _make(self, heartbeat: Callable[[], None] | None,
                    on_fault: Callable[[str], None] | None) -> Dispatcher:
        # limit=0: aiohttp's default cap of 100 connections would silently cap our concurrency.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, raise_for_status=False)
        return Dispatcher(self.ledger, SGLangClient(self.session, self.config), self.config, heartbeat, on_fault)

    def run_chunk(self, chunk: ChunkPayload) -> ChunkReport:
        """Dispatch a chunk: returns when every sample has started (or was given back)."""
        future = asyncio.run_coroutine_threadsafe(self.dispatcher.dispatch(chunk), self.loop)
        try:
            return future.result()
        except BaseException:
            # A job timeout or a shutdown signal interrupted the wait: stop starting samples of this chunk.
            # Its started requests run on; its lease lapses and the producer re-enqueues what is left.
            future.cancel()
            raise

    def close(self) -> None:
        """Finish every request already started (warm shutdown keeps GPU work), then stop the loop."""
        if self._closed:
            return
        self._closed = True
        self.server_info.stop()
        self.health.stop()
        try:
            self.health.thread.join(2)  # it deletes this worker's entry in bq:server_health as it ends
            self._call(self.dispatcher.drain())
            self.load.stop()  # after the drain: the view shows the requests a stopping worker finishes
            self._call(self.session.close())
            self._call(self.dispatcher.batcher.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def install(runtime: Runtime) -> None:
    global _current
    _current = runtime


def current() -> Runtime:
    """The process's Runtime; built from the environment when no worker.Worker installed one."""
    global _current
    if _current is None:
        from rq import get_current_job
        job = get_current_job()
        if job is None:
            raise RuntimeError("worker.rqworker functions run inside an RQ job")
        _current = Runtime(job.connection, WorkerConfig.from_env())
    return _current


def run_chunk(chunk: ChunkPayload) -> dict[str, Any]:
    """Generate and commit one chunk of samples. Returns a small report (RQ keeps it as the job result).

    Refused before anything is generated: a payload of another run format (budget/record.py VERSION), a
    reasoning parser this worker does not know, a multi-turn sample without the chunk's conversation block."""
    if not isinstance(chunk, dict) or chunk.get("v") != VERSION:
        version = chunk.get("v") if isinstance(chunk, dict) else None
        raise ValueError(f"unsupported chunk payload: version {version!r}, this worker runs {VERSION}: {OTHER_VERSION}")
    parser = chunk.get("reasoning_parser")
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unsupported chunk payload: reasoning_parser {parser!r} is not one this worker knows "
                         f"({', '.join(REASONING_PARSERS)}); upgrade the worker")
    if "conversation" not in chunk and any(s.get("turns", 1) > 1 for s in chunk.get("samples", [])):
        raise ValueError("unsupported chunk payload: multi-turn samples without a conversation block")
    return current().run_chunk(chunk).as_dict()


ALLOWED = frozenset({JOB_FUNCTION})
