"""A sample's trip to SGLang: one ``POST /generate`` attempt and what its answer means (`SGLangClient`); then
generate with retries and the record that gets committed (`generate_sample`, `RequestContext`, below).

Everything SGLang can answer is sorted into four outcomes: a valid generation; a final error (a 400: the
request itself is wrong and will be wrong again); a refused key (401, 403: not the sample's fault but the
worker's own configuration, ``SGLANG_API_KEY``; worker/dispatch.py stops the worker); a retryable error (5xx,
429, resets, timeouts, an aborted generation, a body that breaks the contract).
Only the fields the contract guarantees are relied on: ``meta_info.id``, ``finish_reason``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, and the top-level ``output_ids`` (checked against
``completion_tokens`` when present, and kept in the record).

The retry policy (`generate_sample`): 5xx, 429, resets, timeouts, aborted generations and malformed bodies are retried
with full-jitter backoff (never before Retry-After) up to ``BUDGETQ_MAX_ATTEMPTS``; a 400 is final, except
"Duplicate request ID" (a previous run of the sample still holds the rid), retried at once under the next rid.
A 401/403 (the server refused ``SGLANG_API_KEY``) is given up at once too, but it is not the sample's failure:
the sample is given back and the worker stops (``RequestContext.generate``). Nothing is retried while the worker
holds its requests (a warm stop, or every server down: worker/health.py): the sample is given back unfailed, so
neither a SIGTERM nor a dead server waits out ``BUDGETQ_RETRY_FOR``.

``RequestContext`` is what a request needs from its worker, on both paths: a one-turn sample
(worker/dispatch.py ``Dispatcher._run_one``) and each turn of a conversation (worker/turns.py). It holds the
steps the two share (generate or give back, fail, discard on close, wait for room) so that they are written once.

``RunningChunk`` (at the end) is a chunk while it runs, from its ``start_chunk`` until its last request is
committed: its requests in flight (``Flight``) and what each reserves, their tasks, whether its lease was lost,
and its ``ChunkReport``, which the RQ job returns once the chunk is dispatched and whose counts go on growing
until the chunk finishes (rq-dashboard shows them through the job's meta).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import aiohttp
import orjson

from budget.ledger import Ledger
from budget.record import ChunkPayload, SamplePayload, make_record, make_turn, request_id, sampling_params_of
from budget.serverinfo import ROUTER_DEFAULT_TIMEOUT_S, public_url
from worker.batch import Batcher, in_thread_until_answered
from worker.config import WorkerConfig
from worker.estimate import LengthModels
from worker.reasoning import parse_turn

log = logging.getLogger("budgetq.worker")

DUPLICATE_RID = "Duplicate request ID"


class GenerateError(Exception):
    """An attempt that produced no usable generation."""

    def __init__(self, reason: str, *, retryable: bool, status: int | None = None,
                 retry_after: float | None = None, new_rid: bool = False, unavailable: bool = False,
                 auth: bool = False, server: str | None = None, held: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        # The server could not answer (down, overloaded, unreachable, too slow): worth waiting out, for minutes.
        # Otherwise it answered with something unusable (an abort, a broken body): worth a few more tries only.
        self.unavailable = unavailable
        self.status = status
        self.retry_after = retry_after
        self.new_rid = new_rid  # SGLang still runs a request with this rid: retry under the next one
        # 401/403: the server refused this worker's credentials. Every other sample would be refused alike, so
        # this is a configuration fault of the worker, never a failure of the sample (worker/dispatch.py).
        self.auth = auth
        self.server = server
        # Not sent, or not retried: the worker holds its requests (a warm stop, or every server down:
        # SGLangClient.hold). Not the sample's failure: the sample is given back (worker/sglang.py).
        self.held = held
        self.attempts = 1  # requests sent for the sample, set when the last attempt gave up


@dataclass(frozen=True)
class Generation:
    text: str
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str  # 'stop' or 'length'
    server: str
    # The server's token ids of the completion, EOS included on a stop (None: a server that sent none). Kept in
    # the record: they are what the model produced, which re-tokenizing ``text`` need not give back.
    output_ids: list[int] | None = None
    #: This attempt's share of its server's busy time, in seconds (ServerTime, below): the GPU time it cost.
    server_s: float = 0.0


_INT = frozenset({int})  # the one type an output id may have (not bool): checked in C, not per id in Python


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_generation(body: Any, max_new_tokens: int, server: str, server_s: float = 0.0) -> Generation:
    """Validate a 200 body; anything that breaks the contract is a retryable error, never a result."""
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    if not isinstance(body, dict):
        raise GenerateError("malformed response: not a JSON object", retryable=True)
    meta = body.get("meta_info")
    text = body.get("text")
    if not isinstance(meta, dict):
        raise GenerateError("malformed response: no meta_info", retryable=True)
    if not isinstance(text, str):
        raise GenerateError("malformed response: text is not a string", retryable=True)
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        raise GenerateError(f"generation aborted: {message}", retryable=True)
    if kind not in ("stop", "length"):
        raise GenerateError(f"malformed response: finish_reason {finish!r}", retryable=True)
    tokens: Any = meta.get("completion_tokens")
    if not _is_int(tokens) or not 0 <= tokens <= max_new_tokens:
        raise GenerateError(f"malformed response: completion_tokens {tokens!r} "
                            f"(expected 0..{max_new_tokens})", retryable=True)
    output_ids = body.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list) or len(output_ids) != tokens
                                   or not _INT.issuperset(map(type, output_ids))):
        raise GenerateError("malformed response: output_ids do not match completion_tokens", retryable=True)
    prompt_tokens: Any = meta.get("prompt_tokens")
    if not _is_int(prompt_tokens) or prompt_tokens < 0:
        raise GenerateError(f"malformed response: prompt_tokens {prompt_tokens!r}", retryable=True)
    cached = meta.get("cached_tokens", 0)
    return Generation(text=text, completion_tokens=tokens, prompt_tokens=prompt_tokens,
                      cached_tokens=cached if _is_int(cached) else 0, finish_reason=kind, server=server,
                      output_ids=output_ids, server_s=server_s)


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error", body.get("message"))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:500]
    return str(body)[:500]


def _retry_after(headers: Any) -> float | None:
    raw = headers.get("Retry-After")
    try:
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:
        return None


def deadline(config: WorkerConfig, max_new_tokens: int) -> float:
    """A request's deadline in seconds: BUDGETQ_REQUEST_TIMEOUT, else sized for the answer at the slowest decode
    waited for. aiohttp's default 300 s total would cut a 16K-token answer short."""
    if config.request_timeout is not None:
        return config.request_timeout
    return 120.0 + max_new_tokens / config.min_tokens_per_second


class SGLangClient:
    """Sends attempts to the least-busy healthy server of the configured ones over one persistent session.

    A server that failed to answer three times in a row is left alone for a while (1 s, doubling after each
    failed probe up to 15 s: a circuit breaker), so with several servers the retries of a dead one's requests go to the others at once.
    When every server is down, one request at a time probes the one due back first while the others wait for
    it (half-open): an outage sees a trickle of probes, not every retry of every request in flight.
    """

    FAILURES_TO_OPEN = 3
    MAX_COOLDOWN_S = 15.0  # so a recovered server is found again well within 30 s

    def __init__(self, session: aiohttp.ClientSession, config: WorkerConfig) -> None:
        self.session = session
        self.config = config
        self.in_flight = {url: 0 for url in config.servers}
        self.failures = {url: 0 for url in config.servers}
        self.down_until = {url: 0.0 for url in config.servers}
        self.cooldown = {url: 0.0 for url in config.servers}
        self.probing = {url: False for url in config.servers}
        #: For worker/loadreport.py: completion tokens each server answered, and its last failed request (why, and
        #: the monotonic time), and when it last timed out, answered 5xx/429 or lost the connection.
        self.tokens = {url: 0 for url in config.servers}
        self.last_error: dict[str, tuple[str, float]] = {}
        self.unavailable_at: dict[str, float] = {}
        self.changed = asyncio.Event()  # set whenever a server's health changes
        self._turn = 0
        # None without a key: aiohttp then merges no headers per request (the body's payload carries Content-Type).
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
        self._timeouts: dict[int, aiohttp.ClientTimeout] = {}
        self.routers: set[str] = set()  # SGLANG_URLs found to be SGLang's router (worker/serverinfo.py says so)
        self._router_warned = False
        #: Set while no attempt may be sent: a warm stop, or every server down (worker/health.py). An attempt asked
        #: for meanwhile, and a retry whose backoff it cuts short, raise a ``held`` GenerateError: the sample is
        #: given back instead of waiting out an outage for BUDGETQ_RETRY_FOR seconds.
        self.hold = asyncio.Event()
        #: Told (on the loop) of a server that could not be connected to: worker/health.py then asks its /health.
        self.on_unreachable: Callable[[str], None] | None = None
        #: Each request's share of its server's busy time (ServerTime, below): the GPU time it cost.
        self.server_time = ServerTime(list(config.servers))

    def set_hold(self, held: bool) -> None:
        """Hold (or release) every attempt; wakes whatever waits in ``pause`` or ``_gate``."""
        if held:
            self.hold.set()
        else:
            self.hold.clear()
        self.changed.set()

    async def pause(self, seconds: float) -> None:
        """A retry's backoff: ``seconds``, or less if the client is held meanwhile."""
        if self.hold.is_set():
            return
        try:
            await asyncio.wait_for(self.hold.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    def note_router(self, url: str) -> None:
        """``url`` is SGLang's router (called on the request loop). It times a request out after its
        --request-timeout-secs, which it reports nowhere: warn once if its default is shorter than our deadline."""
        self.routers.add(url)
        self._check_router_timeout()

    def _check_router_timeout(self) -> None:
        if self._router_warned or not self.routers or not self._timeouts:
            return
        max_new, worst = max(((n, t.total or 0.0) for n, t in self._timeouts.items()), key=lambda x: x[1])
        if worst <= ROUTER_DEFAULT_TIMEOUT_S:
            return
        self._router_warned = True
        log.warning("%s is SGLang's router; it does not report its --request-timeout-secs, whose default of %.0f s "
                    "is shorter than this worker's deadline of %.0f s for max_new_tokens=%d: start it with "
                    "--request-timeout-secs %.0f or more (and --retry-max-retries 1, since budgetq retries itself), "
                    "or a slow long answer is cut and generated again (docs/deployment.md)",
                    ", ".join(sorted(self.routers)), ROUTER_DEFAULT_TIMEOUT_S, worst, max_new, worst + 60,
                    extra={"routers": sorted(self.routers), "deadline_s": worst})

    #: A conversation stays on its previous turn's server while that one has at most this many times the least
    #: busy server's requests in flight, plus AFFINITY_SLACK (docs/multiturn.md, "Prefix-cache affinity").
    AFFINITY_RATIO = 1.25
    AFFINITY_SLACK = 4

    def pick_server(self, prefer: str | None = None) -> str:
        """Least in flight among healthy servers; ties round-robin. All down: the one that comes back first.
        ``prefer`` (a conversation's previous server) wins while it is healthy and not much busier."""
        servers = self.config.servers
        if len(servers) == 1:
            return servers[0]
        if prefer is not None and self.down_until.get(prefer) == 0.0:
            least = min(self.in_flight[url] for url in servers if self.down_until[url] == 0.0)
            if self.in_flight[prefer] <= self.AFFINITY_RATIO * least + self.AFFINITY_SLACK:
                return prefer
        self._turn += 1
        order = servers[self._turn % len(servers):] + servers[:self._turn % len(servers)]
        healthy = [url for url in order if self.down_until[url] == 0.0]
        if not healthy:
            return min(order, key=lambda url: self.down_until[url])
        return min(healthy, key=lambda url: self.in_flight[url])

    def _mark(self, server: str, ok: bool, probe: bool = False) -> None:
        if ok:
            was_down = self.down_until[server] > 0
            self.failures[server] = 0
            self.cooldown[server] = 0.0
            self.down_until[server] = 0.0
            if was_down:
                self.changed.set()
            return
        self.failures[server] += 1
        if probe:  # still down: wait twice as long before the next probe
            self.cooldown[server] = min(self.MAX_COOLDOWN_S, max(1.0, self.cooldown[server] * 2))
            self.down_until[server] = time.monotonic() + self.cooldown[server]
        elif self.down_until[server] == 0.0 and self.failures[server] >= self.FAILURES_TO_OPEN:
            # Open. Failures of requests sent before it opened (a burst when a server dies with many in
            # flight) do not stretch the cooldown: only failed probes do.
            self.cooldown[server] = 1.0
            self.down_until[server] = time.monotonic() + 1.0

    async def _gate(self) -> tuple[str, bool]:
        """Pick a server to send to now; returns (server, is_probe). Waits while every server is down."""
        while True:
            self._raise_if_held()
            now = time.monotonic()
            for url in self.config.servers:  # a down server whose cooldown is over gets one probe, even while
                if 0.0 < self.down_until[url] <= now and not self.probing[url]:  # others are healthy
                    self.probing[url] = True
                    return url, True
            server = self.pick_server()
            if self.down_until[server] == 0.0:  # closed: healthy
                return server, False
            if not self.probing[server]:
                self.probing[server] = True  # the others wait for its verdict, below
                await self.pause(max(0.0, self.down_until[server] - time.monotonic()))
                if self.hold.is_set():  # held while it waited: no probe after all
                    self.probing[server] = False
                    self.changed.set()
                    continue
                return server, True
            self.changed.clear()  # a probe is pending: wait for its verdict
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=self.MAX_COOLDOWN_S + 5)
            except asyncio.TimeoutError:
                pass

    def _raise_if_held(self) -> None:
        if self.hold.is_set():
            raise GenerateError("not sent: this worker holds its requests (stopping, or every server down)",
                                retryable=False, unavailable=True, held=True)

    async def generate(self, payload: dict[str, Any], max_new_tokens: int, prefer: str | None = None) -> Generation:
        self._raise_if_held()
        if any(self.down_until.values()):
            server, probe = await self._gate()
        else:  # every server healthy: what _gate would pick, without a coroutine per request
            server, probe = self.pick_server(prefer), False
        try:
            return await self._send(server, payload, max_new_tokens, probe)
        finally:
            if probe:
                self.probing[server] = False
                self.changed.set()

    def _note_error(self, server: str, why: str, unavailable: bool) -> None:
        now = time.monotonic()
        self.last_error[server] = (why, now)
        if unavailable:
            self.unavailable_at[server] = now

    async def _send(self, server: str, payload: dict[str, Any], max_new_tokens: int, probe: bool) -> Generation:
        timeout = self._timeouts.get(max_new_tokens)
        if timeout is None:
            timeout = self._timeouts[max_new_tokens] = aiohttp.ClientTimeout(
                total=deadline(self.config, max_new_tokens), sock_connect=self.config.connect_timeout)
            self._check_router_timeout()
        began = self.server_time.start(server)
        self.in_flight[server] += 1
        try:
            # orjson: the body is mostly the prompt's token ids, which json.dumps writes ~10x slower. A payload
            # object, not bytes: aiohttp would look up a payload class for the bytes on every request.
            body = aiohttp.BytesPayload(orjson.dumps(payload), content_type="application/json")
            async with self.session.post(server + "/generate", data=body, timeout=timeout,
                                         headers=self._headers) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = _retry_after(resp.headers)
        except asyncio.TimeoutError as exc:
            self._mark(server, False, probe)
            self._note_error(server, "timeout", True)
            if isinstance(exc, aiohttp.ConnectionTimeoutError) and self.on_unreachable is not None:
                self.on_unreachable(server)  # no connection within BUDGETQ_CONNECT_TIMEOUT: maybe gone
            raise GenerateError(f"timeout from {server}", retryable=True, unavailable=True) from None
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
            # Not connected, or closed before any answer: maybe the server is gone. worker/health.py asks its
            # /health and decides; a slow server (the timeout above) or an error answer is not this.
            self._mark(server, False, probe)
            self._note_error(server, f"{type(exc).__name__}: {exc}", True)
            if self.on_unreachable is not None:
                self.on_unreachable(server)
            raise GenerateError(f"{type(exc).__name__} from {server}: {exc}", retryable=True,
                                unavailable=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            self._mark(server, False, probe)
            self._note_error(server, f"{type(exc).__name__}: {exc}", True)
            raise GenerateError(f"{type(exc).__name__} from {server}: {exc}", retryable=True,
                                unavailable=True) from None
        finally:
            share = self.server_time.end(server, began)
            self.in_flight[server] -= 1
        self._mark(server, status < 500 and status != 429, probe)
        if status == 200:
            try:
                body = orjson.loads(raw)
            except ValueError:
                self._note_error(server, "malformed response: body is not JSON", False)
                raise GenerateError("malformed response: body is not JSON", retryable=True) from None
            gen = parse_generation(body, max_new_tokens, server, share)
            self.tokens[server] = self.tokens.get(server, 0) + gen.completion_tokens
            return gen
        message = _error_message(raw)
        self._note_error(server, f"HTTP {status}: {message}", status >= 500 or status in (408, 429))
        if status in (401, 403):
            raise GenerateError(f"{status}: {message}", retryable=False, status=status, auth=True, server=server)
        if status == 400:
            if DUPLICATE_RID in message:
                raise GenerateError(message, retryable=True, status=400, new_rid=True)
            raise GenerateError(f"400: {message}", retryable=False, status=400)
        unavailable = status >= 500 or status in (408, 429)
        raise GenerateError(f"{status}: {message}", retryable=True, status=status, retry_after=retry_after,
                            unavailable=unavailable)


class ServerTime:
    """The servers' busy time, shared out among the requests that kept them busy: what a dataset's GPU time is.

    A request's latency is not what it cost: a server running N requests at once spends a second of its GPUs on N
    requests. So while N requests run at a server, each is charged dt / N. Every server has a clock that advances by
    dt / N (the virtual time of fair queueing); a request's charge is the clock at its end minus the clock at its
    start, and the charges of every request a server ran sum to exactly the time it was busy (N > 0). A server's
    busy time times its GPUs (its tensor-parallel size) is GPU time; docs/mix.md "Cost in view" says how to price it.

    N is this worker's own requests at the server, counted here, plus the other workers' ones: none while the
    window's registration says this worker is the server's only one (exact), else the server's last load
    (worker/window.py reads ``/v1/loads`` every POLL_S and calls ``note_load``) minus this worker's own at that
    moment (as exact as that load, a second old at most). A
    worker with a fixed BUDGETQ_CONCURRENCY runs no window and reads no load: it charges as if it ran alone, which
    overstates each worker's charge by the number of workers sharing its server. Behind a router (several servers
    behind one URL) a second of the URL is a second of each of them, so the clock advances by dt x servers / N.

    One per SGLangClient, on its loop: ``start`` before a request is sent, ``end`` with what ``start`` gave
    when it is over (answered or not), which returns the seconds of the server's busy time it took."""

    def __init__(self, servers: list[str], clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self._at = {url: now for url in servers}  # when each server's clock was last advanced
        self._time = {url: 0.0 for url in servers}  # its sum of dt x servers / N
        self._own = {url: 0 for url in servers}  # this worker's requests there now
        self._others = {url: 0 for url in servers}  # the other workers' ones, as its last load said
        self._servers = {url: 1 for url in servers}  # SGLang servers behind the URL

    def _advance(self, url: str) -> float:
        now = self._clock()
        n = self._own[url] + self._others[url]
        if n > 0:
            self._time[url] += (now - self._at[url]) * self._servers[url] / n
        self._at[url] = now
        return self._time[url]

    def start(self, url: str) -> float:
        began = self._advance(url)
        self._own[url] += 1
        return began

    def end(self, url: str, began: float) -> float:
        taken = self._advance(url) - began
        self._own[url] -= 1
        return taken

    def note_load(self, url: str, total: int | None, *, peers: int = 1, servers: int = 1) -> None:
        """The server's own count of what it runs and queues (``total``: every worker's requests), or None when it
        gives none (each of the ``peers`` workers sharing the server is then taken to run as many as this one);
        ``servers``: the SGLang servers behind the URL. A worker alone at its server (``peers`` 1) counts its own
        requests only: a load read a moment ago would count requests that have ended since."""
        if url not in self._time:
            return
        self._advance(url)
        own = self._own[url]
        if peers <= 1:
            self._others[url] = 0
        else:
            self._others[url] = max(0, total - own) if total is not None else own * (peers - 1)
        self._servers[url] = max(1, servers)


# -- one sample's trip: generate with retries, then the record that gets committed ------------------------------


#: Why a commit that closed its dataset discards the dataset's queued chunks: the reason their canceled RQ jobs
#: carry in their description (rq-dashboard).
CLOSE_REASON = "budget reached"


def backoff(attempt: int, cap: float, retry_after: float | None) -> float:
    """Full-jitter exponential backoff, never sooner than the server's Retry-After."""
    delay = random.uniform(0, min(cap, 0.5 * 2 ** attempt))
    return max(delay, retry_after or 0.0)


async def generate_sample(client: SGLangClient, config: WorkerConfig, dataset: str, sample: SamplePayload,
                          sampling_params: dict[str, Any], report: ChunkReport, *, rid_key: str | None = None,
                          prefer: str | None = None) -> Generation:
    """Generate one sample; raises the last GenerateError when it is given up.

    Given up: at once on a final error (a 400); after ``max_attempts`` unusable answers (aborts, broken bodies);
    and for an unavailable server (5xx, 429, resets, timeouts) only after ``retry_for`` seconds of trying, so
    an outage of SGLang is waited out instead of failing every sample in flight.

    ``rid_key`` names the request in its rid (default the sample id; a conversation's later turns add the turn);
    ``prefer`` is the server a conversation's previous turn ran on (SGLangClient.pick_server).
    """
    key = sample["id"] if rid_key is None else rid_key
    max_new = int(sampling_params["max_new_tokens"])
    first = time.monotonic()
    unusable = 0  # aborts and broken answers
    tries = 0  # requests that were not a duplicate-rid refusal
    rid_no = 0
    while True:
        payload = {"input_ids": sample["input_ids"], "sampling_params": sampling_params,
                   "rid": request_id(dataset, key, rid_no)}
        report.attempts += 1
        try:
            return await client.generate(payload, max_new, prefer)
        except GenerateError as err:
            rid_no += 1
            if err.new_rid and rid_no < 100:
                continue  # a previous run of this sample still holds the rid: not a failure
            tries += 1
            if client.hold.is_set() and not err.held:  # stopping, or every server down: give it back, not retry
                err.held = True
            if not err.unavailable:
                unusable += 1
            waited = time.monotonic() - first
            if (not err.retryable or err.held or unusable >= config.max_attempts
                    or (err.unavailable and waited >= config.retry_for and tries >= config.max_attempts)):
                err.attempts = rid_no
                raise
            log.info("%s/%s attempt %d failed (%s), retrying", dataset, sample["id"], tries, err.reason)
            await client.pause(backoff(tries, config.backoff_cap, err.retry_after))  # cut short by a hold


def parse_response(dataset: str, chunk: ChunkPayload, sample: SamplePayload, gen: Generation) -> dict[str, Any]:
    """The turn's parse by the run's reasoning parser (the chunk's ``reasoning_parser``). With
    ``skip_special_tokens`` false the text holds special tokens, and the family's end-of-turn ones are left out of
    the parsed fields (worker/reasoning.py END_OF_TURN_TOKENS); ``response`` and ``output_ids`` stay verbatim."""
    kept = sampling_params_of(chunk, sample).get("skip_special_tokens", True) is False
    turn = parse_turn(chunk["reasoning_parser"], gen.text, opens_think=sample["opens_think"],
                      finish_reason=gen.finish_reason, call_id_seed=f"{dataset}\0{sample['id']}",
                      special_tokens=kept)
    return {"reasoning": turn.reasoning, "content": turn.content,
            "reasoning_truncated": turn.reasoning_truncated, "reasoning_unclosed": turn.reasoning_unclosed,
            "tool_calls": list(turn.tool_calls), "tool_call_errors": turn.tool_call_errors}


def result_record(dataset: str, sample: SamplePayload, gen: Generation, chunk: ChunkPayload) -> dict[str, Any]:
    """The version 2 record (budget/record.py) of a one-turn sample, without ``messages``: the producer holds the
    prompt messages and adds them when it writes the line. The prompt ids are hashed, not sent back."""
    parsed = parse_response(dataset, chunk, sample, gen)
    turn = make_turn(response=gen.text, prompt_tokens=gen.prompt_tokens, cached_tokens=gen.cached_tokens,
                     completion_tokens=gen.completion_tokens, finish_reason=gen.finish_reason,
                     prompt_ids=sample["input_ids"], output_ids=gen.output_ids, **parsed)
    rec = make_record(sample_id=sample["id"], dataset=dataset, turns=[turn],
                      reasoning_parser=chunk.get("reasoning_parser"),
                      sampling_params=sampling_params_of(chunk, sample),
                      chat_template_kwargs=sample.get("chat_template_kwargs"), tools=sample.get("tools"))
    del rec["messages"]
    return rec


#: The tail of every fault message: what the worker does about it.
_GIVING_BACK = "starting no more requests, giving the chunk back"


@dataclass(frozen=True)
class RequestContext:
    """What a request needs from its worker; one per Dispatcher, shared by all its requests."""

    ledger: Ledger
    batcher: Batcher
    client: SGLangClient
    config: WorkerConfig
    length_models: LengthModels
    ended: asyncio.Event  # set whenever a request of the worker ends
    stop_requested: asyncio.Event  # the dispatcher's warm stop
    #: Stops the worker for a fault of its own (worker/dispatch.py), once however often it is called.
    fault: Callable[[str, Mapping[str, Any]], None]

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    async def generate(self, rc: RunningChunk, flight: Flight, sample: SamplePayload,
                       sampling_params: dict[str, Any], *, label: str, rid_key: str | None = None,
                       prefer: str | None = None) -> Generation | GenerateError | None:
        """``generate_sample``, its answer observed by the rate tracker. A GenerateError given up is noted in the
        chunk's report (``label`` names the request) and returned: the caller decides what it fails. None when the
        server refused this worker's credentials: not the sample's failure but the worker's, so the sample is
        given back unfailed (its reservation and in-flight count stay with the chunk until the chunk ends:
        finish_chunk drops both) and the worker stops. None too when the worker holds its requests (a warm stop,
        or every server down: SGLangClient.hold): the sample is given back the same way, and the worker goes on."""
        try:
            gen = await generate_sample(self.client, self.config, rc.dataset, sample, sampling_params, rc.report,
                                        rid_key=rid_key, prefer=prefer)
        except GenerateError as err:
            rc.report.errors.append(f"{label}: {err.reason}")
            if err.held:  # the worker is stopping or every server is down: given back, uncounted and unfailed
                rc.report.not_started += 1
                if rc.report.status == "ok":
                    rc.report.status = "stopped" if self.stopping else "server down"
                return None
            if not err.auth:
                return err
            url = public_url(err.server) if err.server else "SGLang"
            self.give_back(rc, f"SGLang server {url} refused this worker's credentials ({err.reason}): "
                               f"SGLANG_API_KEY is {'wrong' if self.config.api_key else 'not set'}; {_GIVING_BACK}",
                           {"server": url, "status": err.status})
            return None
        ran = time.monotonic() - flight.started
        self.length_models.rates.observe(gen.completion_tokens, ran)
        rc.request_s += ran
        rc.server_s += gen.server_s
        return gen

    def give_back(self, rc: RunningChunk, fault: str, log_extra: Mapping[str, Any] | None = None) -> None:
        """Give a sample back unfailed for a fault of this worker (``fault`` says which), and stop the worker."""
        rc.report.not_started += 1
        rc.report.status = "unauthorized"
        self.fault(fault, log_extra or {})

    def tokenizer_fault(self, rc: RunningChunk, message: str) -> None:
        """The run's tokenizer files cannot be had or do not give the run's fingerprint (worker/turns.py):
        every later turn this worker renders would be wrong alike, so it is the worker's fault, handled as a
        refused key."""
        self.give_back(rc, f"cannot render later turns of conversations: {message}; {_GIVING_BACK}")

    async def fail(self, rc: RunningChunk, flight: Flight, sid: str, err: GenerateError) -> None:
        """Record sample ``sid`` failed (failed.jsonl), releasing what its flight reserved; counted once."""
        if await self.batcher.call_until_answered("fail", self.ledger.fail_call(
                rc.dataset, sid, rc.id, {"id": sid, "reason": err.reason, "status": err.status,
                                         "attempts": err.attempts}, reserved=flight.reserved)):
            rc.report.failed += 1

    async def after_commit(self, dataset: str, closed_now: bool, used: int) -> None:
        """A commit that closed its dataset discards the dataset's queued chunks at once (discard is idempotent)."""
        if closed_now:
            n = await in_thread_until_answered("discard", self.ledger.discard, dataset, CLOSE_REASON)
            log.info("%s reached its budget (%d tokens): closed, %d queued chunks discarded", dataset, used, n)

    async def wait_for_room(self) -> None:
        """After a FULL admission: the budget is reserved by requests in flight, and one of them ending may free
        room. Wait until a request of this worker ends, or a second (another worker's may end)."""
        self.ended.clear()
        try:
            await asyncio.wait_for(self.ended.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass


@dataclass
class ChunkReport:
    """What happened to a chunk. The RQ job returns it when the chunk is dispatched (every sample started or
    given back); the counts of its requests still running keep growing until the chunk finishes."""

    chunk: str
    status: str = "ok"  # ok / stopped / revoked / closed / full / unauthorized / server down
    committed: int = 0
    duplicates: int = 0
    failed: int = 0
    skipped: int = 0
    not_started: int = 0
    tokens: int = 0
    late: int = 0  # committed after this chunk had lost its lease (its reservation had expired)
    attempts: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["errors"] = self.errors[:5]
        return d


@dataclass
class Flight:
    """A request in flight and what it reserves (budget/scripts.py ADMIT, COMMIT)."""

    started: float
    reserved: int
    #: predict: what a conversation's later turns are expected to add, reserved with this turn (worker/turns.py)
    future: int = 0
    #: a conversation's flight, and the turn it is on: predict prices it with that turn's model (TurnModels)
    conversation: bool = False
    turn: int = 0


class RunningChunk:
    """A chunk from its start until its last request is committed."""

    def __init__(self, chunk: ChunkPayload) -> None:
        self.chunk = chunk
        self.dataset, self.id = chunk["dataset"], chunk["chunk"]
        self.report = ChunkReport(self.id)
        self.flights: dict[str, Flight] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.lost = asyncio.Event()
        self.lease: asyncio.Task[None] | None = None
        self.started = 0  # requests started (admitted and sent)
        self.resume: dict[str, int] = {}  # conversations of this chunk started before (sample -> turns committed)
        self.meta_at = 0.0  # monotonic time of the last progress write to the RQ job's meta
        self.request_s = 0.0  # seconds its answered requests ran, start to answer: the dataset's request time
        self.server_s = 0.0  # their share of the servers' busy time (Generation.server_s): the dataset's GPU time

    def meta(self, state: str) -> dict[str, Any]:
        """The RQ job's meta: what the producer wrote at enqueue (dataset, samples, first, last) plus progress.
        ``state``: running (requests may still start or run), done (last request committed), interrupted (the
        worker's code or shutdown cut it short: the lease lapses and the producer re-enqueues the rest), or
        revoked/closed (given back at its start: reclaimed, discarded, or its dataset closed)."""
        samples, r = self.chunk["samples"], self.report
        return {"dataset": self.dataset, "samples": len(samples),
                "first": samples[0]["id"] if samples else None, "last": samples[-1]["id"] if samples else None,
                "state": state, "started": self.started, "in_flight": len(self.flights), "committed": r.committed,
                "failed": r.failed, "skipped": r.skipped, "not_started": r.not_started, "tokens": r.tokens,
                "stop_reason": None if r.status == "ok" else r.status,
                "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
