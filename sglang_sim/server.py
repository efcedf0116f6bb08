"""The HTTP face of the simulator: SGLang's native routes on aiohttp.

`make_app(cfg)` builds the application; `start_server(cfg)` runs it in the current event loop on a
loopback port and returns a handle (what tests and the demo use in-process).

Client disconnects abort the request, as SGLang does: with `handler_cancellation=True` (set by
`start_server` and by the console script) aiohttp cancels the handler at once; a sweep every
`disconnect_check_interval` seconds catches the same thing when the app runs under a runner
without it.

Fault injection (fault_http.py) hooks in at three points of /generate: on arrival (outage, and the
faults answered at once), on submit (an injected abort's cut) and on the reply (a mangled body).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from sglang_sim import fault_http
from sglang_sim.config import SimConfig
from sglang_sim.engine import Engine, Job, Outcome
from sglang_sim.fault_http import ABORT_INJECTED_MESSAGE, FaultState, mangled_reply
from sglang_sim.faults import Fault, FaultSettings, OutageMode
from sglang_sim.prefix_cache import PrefixCache
from sglang_sim.request_log import RequestLog
from sglang_sim.responses import (
    generate_body,
    get_load_body,
    loads_body,
    metrics_text,
    model_info,
    server_info,
    stats_body,
)
from sglang_sim.textgen import (
    Lexicon,
    OutputPlan,
    input_digest,
    lexicon_for,
    plan_output,
    plan_with_tokenizer,
    request_rng,
)
from sglang_sim.validation import ApiError, GenerateSpec, parse_generate, type_error, value_error


@dataclass(eq=False)
class InFlight:
    """A /generate request the server is working on, keyed by rid."""

    job: Job
    request: web.Request
    cut: OutageMode | None = None  # set when an outage began while it ran


@dataclass(eq=False)
class SimState:
    """Everything one simulated server owns; stored on the app, never global."""

    cfg: SimConfig
    engine: Engine
    lexicon: Lexicon
    faults: FaultState
    inflight: dict[str, InFlight] = field(default_factory=dict)
    ready_at: float = 0.0  # time.monotonic() from which /health answers 200 (cfg.warmup_seconds after start)
    unauthorized: int = 0  # requests refused with 401 (--api-key): a worker's wrong key, counted for tests
    tokenizer: Any = None  # sglang_sim.families.SimTokenizer with --tokenizer: real output_ids
    request_log: RequestLog | None = None  # --request-log: one line per answered /generate
    crashed: asyncio.Event = field(default_factory=asyncio.Event)  # --oov-crash fired: the server is dead

    def crash(self, token: int, request: web.Request) -> None:
        """--oov-crash: what SGLang 0.5.23 does on an id past the vocabulary (the scheduler's IndexError, then
        SIGQUIT and kill_process_tree): every connection dropped without an answer, the socket closed; a process
        (sglang_sim/__main__.py) exits 1."""
        import sys
        print(f"sglang-sim: input id {token} >= vocab_size {self.cfg.vocab_size}: IndexError: index out of range in "
              "self (embedding); SIGQUIT received, kill_process_tree (as SGLang)", file=sys.stderr, flush=True)
        self.crashed.set()
        for f in list(self.inflight.values()):
            if f.request.transport is not None:
                f.request.transport.close()
        self.engine.abort_many([f.job for f in self.inflight.values()])
        fault_http.reset(request)
        if self.faults.listener is not None:
            asyncio.ensure_future(self.faults.listener(False))

    def cut_inflight(self, mode: OutageMode) -> None:
        """An outage began: end every in-flight request now (each handler answers per `mode`)."""
        flights = list(self.inflight.values())
        for f in flights:
            f.cut = mode
        self.faults.counters.outage_cut += len(flights)
        self.engine.abort_many([f.job for f in flights])


STATE: web.AppKey[SimState] = web.AppKey("sglang_sim_state", SimState)


def _error(e: ApiError) -> web.Response:
    return web.json_response(dict(e.body), status=e.status)


async def _read_json(request: web.Request) -> object:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise type_error(f"JSON decode error: {e}") from None


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate: validate, plan the output, wait for the engine, answer per the contract."""
    st = request.app[STATE]
    if st.crashed.is_set():  # a keep-alive connection that outlived the crash
        return fault_http.reset(request)
    t0 = time.monotonic()
    faults = st.faults
    arrival = faults.arrive()
    if faults.in_outage:
        return faults.outage_reply(request, generate=True)
    fault = faults.draw(arrival)
    if fault is not None and fault.immediate:
        return await faults.immediate_reply(request, fault)
    parsed = await _parse(request, st)
    if isinstance(parsed, web.Response):
        return parsed
    spec = parsed
    rid = spec.rid if spec.rid is not None else uuid.uuid4().hex
    if st.cfg.hang_rid_prefixes and rid.startswith(st.cfg.hang_rid_prefixes):
        return await faults.hang(request)  # a poison sample: no answer, whichever attempt
    if rid in st.inflight:
        return _error(value_error(f"Duplicate request ID detected: {rid}"))
    engine = st.engine
    seq = engine.next_seq()
    plan, stops, target, aborts = _plan(st, spec, seq, fault)
    job = engine.submit(seq, spec.prompt, target, ends_aborted=aborts)
    flight = st.inflight[rid] = InFlight(job, request)
    try:
        outcome = await job.future
    except asyncio.CancelledError:
        engine.abort(job)  # the client went away: free the slot, as SGLang does
        raise
    finally:
        if st.inflight.get(rid) is not None and st.inflight[rid].job is job:
            del st.inflight[rid]
    if flight.cut is not None:
        return faults.cut_reply(request, flight.cut)
    # Not an /abort_request that came first: that one keeps SGLang's message.
    injected_abort = aborts and outcome.aborted and outcome.started and outcome.generated == target
    return await _answer(request, st, spec, rid, fault, plan, stops, outcome, injected_abort, t0)


async def _parse(request: web.Request, st: SimState) -> GenerateSpec | web.Response:
    """/generate's body checked as SGLang does: the spec, or the error answer (--oov-crash: the server dies)."""
    try:
        if request.content_type != "application/json":  # FastAPI then validates the raw bytes, and refuses them
            raise type_error("Input should be a dictionary or an instance of GenerateReqInput")
        spec = parse_generate(await _read_json(request), st.cfg)
    except ApiError as e:
        return _error(e)
    if st.cfg.oov_crash and st.cfg.vocab_size is not None and spec.prompt and isinstance(spec.prompt[0], int):
        # SGLang pads its embedding to a multiple of 64 rows: ids in the padding are served (meaninglessly), past it
        # the embedding fails (recorded: tests/fixtures/sglang_real/id_at_vocab_size.json, out_of_vocab.json).
        ids, rows = spec.prompt, -(-st.cfg.vocab_size // 64) * 64
        if min(ids) < 0 or max(ids) >= rows:  # type: ignore[type-var]
            st.crash(next(t for t in ids if t < 0 or t >= rows), request)  # type: ignore[operator]
            return web.Response(status=500)  # never sent: the connection is closed
    return spec


def _plan(st: SimState, spec: GenerateSpec, seq: int, fault: Fault | None) -> tuple[OutputPlan, bool, int, bool]:
    """The output of request `seq`: (plan, stops at EOS?, tokens to generate, ends aborted by a fault?)."""
    keyed = spec.sampling_seed is not None or spec.greedy
    rng = request_rng(st.cfg, seq, input_digest(spec.raw_prompt) if keyed else "", spec.sampling_seed, spec.greedy)
    plan = plan_output(st.cfg, rng, spec.min_new_tokens)
    if st.tokenizer is not None:  # real ids of the family's text (sglang_sim/families.py)
        plan = plan_with_tokenizer(st.cfg, st.lexicon, plan, rng, st.tokenizer, spec.prompt)
    # SGLang (schedule_batch.update_finish_state) checks EOS before the length limit, so an EOS drawn on the
    # last allowed token is a stop.
    stops = not spec.ignore_eos and plan.natural_len <= spec.max_new_tokens
    target = plan.natural_len if stops else spec.max_new_tokens
    aborts = fault is not None and fault.kind == "abort"
    if fault is not None and aborts:
        target = int(fault.cut * target)  # the share it generates before the scheduler drops it
    return plan, stops, target, aborts


async def _answer(request: web.Request, st: SimState, spec: GenerateSpec, rid: str, fault: Fault | None,
                  plan: OutputPlan, stops: bool, outcome: Outcome, injected_abort: bool,
                  t0: float) -> web.StreamResponse:
    """The finished request's reply: the contract's body, or a --malformed-rate mangling of it."""
    faults = st.faults
    body = generate_body(
        st.lexicon, st.cfg, rid, plan, stops, spec.max_new_tokens, len(spec.prompt), outcome, time.monotonic() - t0,
        abort_message=ABORT_INJECTED_MESSAGE if injected_abort else None,
        skip_special_tokens=spec.skip_special_tokens,
    )
    if fault is not None and fault.kind == "malformed":
        faults.counters.malformed[fault.malformed] = faults.counters.malformed.get(fault.malformed, 0) + 1
        return await mangled_reply(request, body, fault.malformed, spec.max_new_tokens)
    if injected_abort:
        faults.counters.aborts_injected += 1
    if st.request_log is not None:  # answered as the contract says (a mangled reply above is not an answer)
        st.request_log.write(rid=rid, prompt=spec.raw_prompt, body=body, port=st.cfg.port,
                             sampling_params=spec.sampling_params)
    return web.json_response(body)


async def abort_request(request: web.Request) -> web.Response:
    """POST /abort_request {"rid", "abort_all"}: SGLang semantics, 200 whatever happened.

    As in SGLang's tokenizer manager, nothing happens unless `rid` is itself in flight (or
    abort_all); then every in-flight rid starting with it is aborted (the scheduler's prefix match).
    """
    st = request.app[STATE]
    try:
        body = await _read_json(request)
    except ApiError as e:
        return _error(e)
    if not isinstance(body, dict) or not isinstance(body.get("rid", ""), str):
        return _error(type_error("rid: Input should be a valid string"))
    rid: str = body.get("rid", "")
    abort_all = bool(body.get("abort_all", False))
    if abort_all or rid in st.inflight:
        st.engine.abort_many([f.job for other, f in st.inflight.items() if abort_all or other.startswith(rid)])
    return web.Response(status=200)


async def health(request: web.Request) -> web.Response:
    """GET /health and /health_generate: 503 while warming up (SGLang's ServerStatus.Starting, until its warm-up
    request has run) and during an outage, else 200."""
    st = request.app[STATE]
    if st.crashed.is_set():
        return fault_http.reset(request)
    if time.monotonic() < st.ready_at:
        return web.Response(status=503)
    faults = st.faults
    return faults.outage_reply(request, generate=False) if faults.in_outage else web.Response(status=200)


async def get_model_info(request: web.Request) -> web.Response:
    """GET /model_info and its deprecated alias /get_model_info (SGLang serves both; the router asks the first)."""
    return web.json_response(model_info(request.app[STATE].cfg))


async def get_server_info(request: web.Request) -> web.Response:
    """GET /server_info and its deprecated alias /get_server_info."""
    st = request.app[STATE]
    return web.json_response(server_info(st.cfg, st.engine.stats()))


async def v1_loads(request: web.Request) -> web.Response:
    """GET /v1/loads: running and waiting requests, and the limits (SGLang 0.5.23's load endpoint)."""
    st = request.app[STATE]
    return web.json_response(loads_body(st.cfg, st.engine.stats()))


async def get_load(request: web.Request) -> web.Response:
    """GET /get_load: the same counts in the legacy shape (older SGLang; the router's power_of_two asks it)."""
    return web.json_response(get_load_body(request.app[STATE].engine.stats()))


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics (Prometheus text)."""
    return web.Response(text=metrics_text(request.app[STATE].engine.stats()), content_type="text/plain")


async def flush_cache(request: web.Request) -> web.Response:
    """GET|POST /flush_cache: drops the prefix cache when idle (400 otherwise), like SGLang."""
    ok = request.app[STATE].engine.flush_cache()
    return web.Response(text="Cache flushed.\n" if ok else "Cache not flushed: requests pending.\n", status=200 if ok else 400)


async def sim_stats(request: web.Request) -> web.Response:
    """GET /sim/stats: simulator-only counters for benchmarks."""
    st = request.app[STATE]
    return web.json_response({**stats_body(st.cfg, st.engine.stats(), st.faults.stats()),
                              "unauthorized": st.unauthorized})


def _auth_middleware(api_key: str) -> Middleware:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        # SGLang leaves OPTIONS, /health* and /metrics* open. /sim/* is the simulator's own (counters and fault
        # control for tests and benchmarks, no SGLang endpoint): open too, so a bench reads its counters keyless.
        if request.method == "OPTIONS" or request.path.startswith(("/health", "/metrics", "/sim/")):
            return await handler(request)
        if request.headers.get("Authorization") != f"Bearer {api_key}":
            request.app[STATE].unauthorized += 1
            return web.json_response({"error": "Unauthorized"}, status=401)  # SGLang's exact answer
        return await handler(request)

    return auth


async def _disconnect_sweeper(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]

    async def sweep() -> None:
        while True:
            await asyncio.sleep(st.cfg.disconnect_check_interval)
            gone = []
            for f in st.inflight.values():
                transport = f.request.transport
                if transport is None or transport.is_closing():
                    gone.append(f.job)
            if gone:
                st.engine.abort_many(gone)
            st.faults.sweep_disconnected()

    if st.cfg.request_log is not None:
        st.request_log = RequestLog(st.cfg.request_log)
    task = asyncio.create_task(sweep())
    st.ready_at = time.monotonic() + st.cfg.warmup_seconds
    st.faults.start()
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    if st.request_log is not None:
        st.request_log.close()


async def _on_shutdown(app: web.Application) -> None:
    st = app[STATE]
    st.engine.close()  # ends every in-flight handler so shutdown does not wait for them
    await st.faults.close()  # and every hanging one


def make_app(cfg: SimConfig) -> web.Application:
    """A ready aiohttp application simulating one SGLang server. Run it with handler_cancellation=True."""
    middlewares = [_auth_middleware(cfg.api_key)] if cfg.api_key else []
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    cache = PrefixCache(cfg.prefix_cache_page, cfg.prefix_cache_pages)
    faults = FaultState(FaultSettings.from_config(cfg), cfg.outages)
    st = app[STATE] = SimState(cfg=cfg, engine=Engine(cfg, cache), lexicon=lexicon_for(cfg.seed), faults=faults)
    if cfg.tokenizer is not None:
        from sglang_sim.families import SimTokenizer
        st.tokenizer = SimTokenizer(cfg.tokenizer)
    faults.on_outage_start.append(st.cut_inflight)
    fault_http.install(app, faults)
    app.router.add_route("POST", "/generate", generate)
    app.router.add_route("PUT", "/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, health)
    for prefix in ("/", "/get_"):
        app.router.add_get(prefix + "model_info", get_model_info)
        app.router.add_get(prefix + "server_info", get_server_info)
    app.router.add_get("/v1/loads", v1_loads)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_get("/sim/stats", sim_stats)
    app.cleanup_ctx.append(_disconnect_sweeper)
    app.on_shutdown.append(_on_shutdown)
    return app


@dataclass
class SimServer:
    """A simulator running in this process's event loop (see start_server)."""

    app: web.Application
    runner: web.AppRunner
    host: str
    port: int
    site: web.TCPSite | None = None  # None while a `refuse` outage has the socket closed

    @property
    def url(self) -> str:
        """Base URL, e.g. http://127.0.0.1:30000."""
        return f"http://{self.host}:{self.port}"

    @property
    def engine(self) -> Engine:
        """The engine, for stats in tests."""
        return self.app[STATE].engine

    @property
    def faults(self) -> FaultState:
        """The fault state (settings, counters, outage), for tests."""
        return self.app[STATE].faults

    async def set_listening(self, listening: bool) -> None:
        """Close or reopen the listening socket on the same port (`refuse` outages)."""
        if not listening and self.site is not None:
            site, self.site = self.site, None
            await site.stop()
        elif listening and self.site is None:
            site = web.TCPSite(self.runner, self.host, self.port)
            await site.start()
            self.site = site

    async def stop(self) -> None:
        """Abort what is in flight and close the listening socket."""
        await self.faults.detach_listener()  # so an outage's end cannot reopen a socket mid-cleanup
        await self.runner.cleanup()


async def start_server(cfg: SimConfig, host: str | None = None, port: int | None = None) -> SimServer:
    """Serve `cfg` in the running loop on host/port (defaults from cfg; port 0 = a free one)."""
    app = make_app(cfg)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    bind_host = cfg.host if host is None else host
    site = web.TCPSite(runner, bind_host, cfg.port if port is None else port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = int(runner.addresses[0][1])
    app[STATE].cfg = cfg.replace(host=bind_host, port=bound)  # so /get_server_info tells the truth
    server = SimServer(app=app, runner=runner, host=bind_host, port=bound, site=site)
    app[STATE].faults.attach_listener(server.set_listening)
    return server


@contextlib.asynccontextmanager
async def serve(cfg: SimConfig, host: str | None = None, port: int | None = None) -> AsyncIterator[SimServer]:
    """`async with serve(cfg, port=0) as sim:` ... sim.url ...; stops the server on exit."""
    server = await start_server(cfg, host, port)
    try:
        yield server
    finally:
        await server.stop()
