"""Fault injection, the HTTP part: each fault on the wire, outage windows, and /sim/faults.

Why each shape is what it is
- Errors carry the body of SGLang's HTTPException handler (http_server.py), which is how its
  503 "The request queue is full." reaches clients: `{"object": "error", "message": ..., "type":
  str(status), "param": null, "code": status}`.
- A reset closes the transport before the first byte of an answer, so the client sees the
  connection end with no response (aiohttp: ServerDisconnectedError). The handler then returns a
  response that can no longer be written, which aiohttp drops without logging.
- A hang awaits a future that only the client leaving (handler cancellation, or the disconnect
  sweep), an outage or shutdown ends. It never reaches the engine, so it holds no batch slot.
- `truncated` announces the whole body's Content-Length, writes half of it, then closes the
  transport: the client sees a short body (aiohttp: ClientPayloadError).

Outages are events, not clock checks: a timer starts a window (from `--outage`, or `outage_for`
through POST /sim/faults) and another ends it. At the start, requests in flight are ended (the
server's hook aborts their jobs) and hanging ones are released. In `refuse` mode the listening
socket closes for the window, through the `listener` hook that start_server installs. Connections
already open stay up, and /generate or /health requests arriving on them are reset.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, Awaitable, Callable, Literal

from aiohttp import web

from sglang_sim.faults import Fault, FaultCounters, FaultSettings, OutageMode, RequestRate, draw
from sglang_sim.validation import type_error

log = logging.getLogger("sglang_sim.faults")

# How a hanging request ends: the client left, an outage answers 503, or the connection is closed.
HangEnd = Literal["gone", "503", "reset"]
Listener = Callable[[bool], Awaitable[None]]

ERROR_MESSAGES = {
    429: "Too many requests.",
    500: "Internal server error.",
    503: "The request queue is full.",  # SGLang's own 503 (--max-queued-requests)
}
OUTAGE_MESSAGE = "sglang-sim outage: the server is unavailable."
# What nginx answers when its upstream is gone.
NGINX_502 = (
    "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
    "<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx/1.24.0</center>\r\n</body>\r\n</html>\r\n"
)
# Injected aborts end like an abort from the scheduler, told apart by the message.
ABORT_INJECTED_MESSAGE = "Aborted by the scheduler (sglang-sim injected fault)."


def error_reply(status: int, message: str, retry_after: float | None) -> web.Response:
    """SGLang's HTTPException body; Retry-After on 429 and 503 when configured."""
    headers = {"Retry-After": f"{retry_after:g}"} if retry_after is not None and status in (429, 503) else None
    body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return web.json_response(body, status=status, headers=headers)


def reset(request: web.BaseRequest) -> web.Response:
    """Close the connection with no answer. The returned response is never sent."""
    transport = request.transport
    if transport is not None:
        transport.close()
    return web.Response(status=500)


def html_502() -> web.Response:
    """A reverse proxy's 502 page: not SGLang's shape, not JSON."""
    return web.Response(status=502, text=NGINX_502, content_type="text/html")


async def truncated_reply(request: web.BaseRequest, body: dict[str, Any]) -> web.StreamResponse:
    """Headers for the whole JSON body, then half of it, then the connection closes."""
    raw = json.dumps(body).encode()
    resp = web.StreamResponse(status=200)
    resp.content_type = "application/json"
    resp.content_length = len(raw)
    await resp.prepare(request)
    await resp.write(raw[: len(raw) // 2])
    reset(request)  # close() flushes what was written, then ends the connection
    return resp


async def mangled_reply(request: web.BaseRequest, body: dict[str, Any], kind: str, max_new_tokens: int) -> web.StreamResponse:
    """The reply of a finished generation, broken the `kind` way (see faults.MALFORMED_KINDS)."""
    meta = body["meta_info"]
    n = meta["completion_tokens"]
    if kind == "not-json":
        return web.Response(text=repr(body), content_type="application/json")  # a Python repr, not JSON
    if kind == "truncated":
        return await truncated_reply(request, body)
    if kind == "html-502":
        return html_502()
    if kind == "no-meta":
        del body["meta_info"]
    elif kind == "tokens-negative":
        meta["completion_tokens"] = -n - 1
    elif kind == "tokens-string":
        meta["completion_tokens"] = str(n)
    elif kind == "tokens-huge":
        meta["completion_tokens"] = max(max_new_tokens, 1) * 1000
    elif kind == "tokens-missing":
        del meta["completion_tokens"]
    return web.json_response(body)


class FaultState:
    """The live fault settings, counters, outage window and hanging requests of one server."""

    def __init__(
        self, settings: FaultSettings, outages: tuple[tuple[float, float], ...], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.outages = outages
        self.counters = FaultCounters()
        self.hanging: dict[asyncio.Future[HangEnd], web.BaseRequest] = {}
        # Called with the window's mode when an outage starts (the server ends its in-flight requests).
        self.on_outage_start: list[Callable[[OutageMode], None]] = []
        # Closes (False) or reopens (True) the listening socket; None when the app runs under a runner
        # we do not own, and `refuse` then only resets requests.
        self.listener: Listener | None = None
        self.listening = True
        self._clock = clock
        self._started_at = clock()
        self._rate = RequestRate()
        self._in_outage = False
        self._outage_mode: OutageMode = settings.outage_mode
        self._outage_until = 0.0
        self._want_listening = True
        self._timers: list[asyncio.TimerHandle] = []
        self._end_timer: asyncio.TimerHandle | None = None
        self._reconciler: asyncio.Task[None] | None = None

    # -- per request -------------------------------------------------------------------------

    def arrive(self) -> int:
        """Count one /generate arrival; returns its 1-based number, which keys its fault draw."""
        c = self.counters
        c.requests_total += 1
        self._rate.add(int(self._clock() - self._started_at))
        return c.requests_total

    def draw(self, arrival: int) -> Fault | None:
        """The fault of this arrival under the current settings."""
        return draw(self.settings, arrival)

    @property
    def in_outage(self) -> bool:
        """True between an outage's start and end events."""
        return self._in_outage

    def outage_reply(self, request: web.BaseRequest, generate: bool) -> web.Response:
        """A /generate (or /health when not `generate`) request during an outage."""
        if generate:
            self.counters.outage_rejected += 1
        if self._outage_mode == "refuse":
            return reset(request)
        if not generate:
            return web.Response(status=503)  # SGLang's /health fails with an empty body
        return error_reply(503, OUTAGE_MESSAGE, self.settings.retry_after)

    def cut_reply(self, request: web.BaseRequest, mode: OutageMode) -> web.Response:
        """The answer of a request that was in flight when an outage began."""
        return reset(request) if mode == "refuse" else error_reply(503, OUTAGE_MESSAGE, self.settings.retry_after)

    async def immediate_reply(self, request: web.BaseRequest, fault: Fault) -> web.StreamResponse:
        """Answer an error, reset, hang or html-502 fault without running a generation."""
        c = self.counters
        if fault.kind == "error":
            c.injected_errors[fault.status] = c.injected_errors.get(fault.status, 0) + 1
            message = ERROR_MESSAGES.get(fault.status, "Injected error.") + " (sglang-sim injected fault)"
            return error_reply(fault.status, message, self.settings.retry_after)
        if fault.kind == "reset":
            c.resets += 1
            return reset(request)
        if fault.kind == "hang":
            return await self.hang(request)
        c.malformed[fault.malformed] = c.malformed.get(fault.malformed, 0) + 1
        return html_502()

    async def hang(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer nothing until the client leaves, an outage begins or the server stops."""
        self.counters.hangs += 1
        fut: asyncio.Future[HangEnd] = asyncio.get_running_loop().create_future()
        self.hanging[fut] = request
        try:
            end = await fut  # cancelled when the client disconnects (handler cancellation)
        finally:
            del self.hanging[fut]
        if end == "503":
            return error_reply(503, OUTAGE_MESSAGE, self.settings.retry_after)
        return reset(request)

    def release_hangs(self, end: HangEnd, requests: list[web.BaseRequest] | None = None) -> int:
        """End hanging requests (all, or those of `requests`); returns how many."""
        released = 0
        for fut, req in list(self.hanging.items()):
            if not fut.done() and (requests is None or req in requests):
                fut.set_result(end)
                released += 1
        return released

    def sweep_disconnected(self) -> None:
        """Release hangs whose client is gone (when aiohttp does not cancel handlers)."""
        gone = [r for r in self.hanging.values() if r.transport is None or r.transport.is_closing()]
        if gone:
            self.release_hangs("gone", gone)

    # -- outages -------------------------------------------------------------------------------

    def start(self) -> None:
        """Arm the configured outage windows; call once, in the loop, as the server starts."""
        loop = asyncio.get_running_loop()
        elapsed = self._clock() - self._started_at
        for start, duration in self.outages:
            self._timers.append(loop.call_later(max(0.0, start - elapsed), self.begin_outage, duration, False))

    def begin_outage(self, duration: float, exact: bool = True) -> None:
        """An outage from now for `duration` seconds (<= 0 ends one now).

        `exact` (live control) sets the end; otherwise the window only extends a running one, so
        overlapping --outage windows merge.
        """
        now = self._clock()
        if duration <= 0:
            if exact:
                self.end_outage()
            return
        until = now + duration
        self._outage_until = until if exact or not self._in_outage else max(until, self._outage_until)
        if not self._in_outage:
            self._in_outage = True
            mode = self._outage_mode = self.settings.outage_mode
            self.counters.outages_started += 1
            for hook in self.on_outage_start:
                hook(mode)
            self.counters.outage_cut += self.release_hangs("503" if mode == "503" else "reset")
            if mode == "refuse":
                self._set_listening(False)
        self._arm_end(now)

    def end_outage(self) -> None:
        """End the outage now (no-op outside one)."""
        if self._end_timer is not None:
            self._end_timer.cancel()
            self._end_timer = None
        if not self._in_outage:
            return
        self._in_outage = False
        self._set_listening(True)

    def outage_remaining(self) -> float:
        """Seconds left in the current outage (0 outside one)."""
        return max(0.0, self._outage_until - self._clock()) if self._in_outage else 0.0

    def _arm_end(self, now: float) -> None:
        if self._end_timer is not None:
            self._end_timer.cancel()
        self._end_timer = asyncio.get_running_loop().call_later(self._outage_until - now, self._end_due)

    def _end_due(self) -> None:
        self._end_timer = None
        now = self._clock()
        if now + 0.0005 < self._outage_until:  # timers may fire a hair early
            self._arm_end(now)
        else:
            self.end_outage()

    def _set_listening(self, want: bool) -> None:
        self._want_listening = want
        if self.listener is not None and (self._reconciler is None or self._reconciler.done()):
            self._reconciler = asyncio.get_running_loop().create_task(self._reconcile())

    async def _reconcile(self) -> None:
        # One task applies open/close in order, so a short outage cannot reopen before it closed.
        assert self.listener is not None
        while self.listening != self._want_listening:
            want = self._want_listening
            try:
                await self.listener(want)
            except OSError as e:  # the port was taken meanwhile: keep trying, as a restarting server would
                log.warning("sglang-sim could not %s its listening socket: %s", "reopen" if want else "close", e)
                await asyncio.sleep(0.1)
                continue
            self.listening = want

    def attach_listener(self, listener: Listener) -> None:
        """Let `refuse` outages close and reopen the socket (applied at once if one is running)."""
        self.listener = listener
        self._set_listening(self._want_listening)

    async def detach_listener(self) -> None:
        """Stop touching the socket (before the server closes it for good)."""
        self.listener = None
        if self._reconciler is not None:
            self._reconciler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconciler
            self._reconciler = None

    async def close(self) -> None:
        """Shutdown: stop the timers and reopening, close hanging connections. Idempotent."""
        for timer in self._timers:
            timer.cancel()
        if self._end_timer is not None:
            self._end_timer.cancel()
        await self.detach_listener()
        self.release_hangs("reset")

    # -- reports -------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """GET /sim/faults: the settings plus the outage state."""
        return {
            **self.settings.as_json(),
            "outages": [list(w) for w in self.outages],
            "in_outage": self._in_outage,
            "outage_remaining": self.outage_remaining(),
            "listening": self.listening,
        }

    def stats(self) -> dict[str, Any]:
        """The fault part of /sim/stats."""
        return {
            **self.counters.as_json(),
            "hanging": len(self.hanging),
            "in_outage": self._in_outage,
            "requests_by_second": self._rate.snapshot(int(self._clock() - self._started_at)),
        }


FAULTS: web.AppKey[FaultState] = web.AppKey("sglang_sim_faults", FaultState)


async def get_faults(request: web.Request) -> web.Response:
    """GET /sim/faults: the fault settings in force and the outage state."""
    return web.json_response(request.app[FAULTS].describe())


async def post_faults(request: web.Request) -> web.Response:
    """POST /sim/faults: change any settings live; `outage_for` starts (or, 0, ends) an outage now,
    `clear` turns every fault off first. Answers like GET; 400 `{"error": ...}` if a value is bad."""
    faults = request.app[FAULTS]
    try:
        body = await request.json()
    except ValueError as e:
        err = type_error(f"JSON decode error: {e}")
        return web.json_response(dict(err.body), status=err.status)
    if not isinstance(body, dict):
        return web.json_response({"error": "expected a JSON object"}, status=400)
    changes = dict(body)
    outage_for = changes.pop("outage_for", None)
    clear = changes.pop("clear", False)
    if outage_for is not None and (isinstance(outage_for, bool) or not isinstance(outage_for, (int, float)) or outage_for < 0):
        return web.json_response({"error": f"outage_for must be a number >= 0, got {outage_for!r}"}, status=400)
    if not isinstance(clear, bool):
        return web.json_response({"error": f"clear must be a boolean, got {clear!r}"}, status=400)
    try:
        settings = (faults.settings.cleared() if clear else faults.settings).updated(changes)
    except ValueError as e:
        return web.json_response({"error": str(e)}, status=400)
    faults.settings = settings
    if clear:
        faults.end_outage()
    if outage_for is not None:
        faults.begin_outage(float(outage_for))
    return web.json_response(faults.describe())


def install(app: web.Application, faults: FaultState) -> None:
    """Register `faults` and the /sim/faults routes on `app`."""
    app[FAULTS] = faults
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", post_faults)
