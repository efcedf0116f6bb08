"""A recording pass-through proxy in front of an SGLang server, for fault-injection benchmarks.

    python -m tests.chaos.recorder --upstream http://127.0.0.1:30000 --port 0    # prints "recorder listening on URL"

Workers point ``SGLANG_URL`` at it. Every ``POST /generate`` is forwarded as is and logged with its rid, the
wall times it arrived and was answered, the status and the ``Retry-After`` header; ``GET /recorder/log`` returns
the log. That is what the server side cannot tell: whether a sample was retried before the server's Retry-After,
or after a 400. An upstream reset or truncated body resets the client's connection too; a client that gives up
(timeout) cancels the upstream request, as it would cancel SGLang's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp
from aiohttp import web

FORWARDED_HEADERS = ("Content-Type", "Authorization")


def make_app(upstream: str) -> web.Application:
    log: list[dict[str, Any]] = []
    app = web.Application()

    async def on_startup(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                               timeout=aiohttp.ClientTimeout(total=None))

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def generate(request: web.Request) -> web.StreamResponse:
        entry: dict[str, Any] = {"t0": time.time(), "rid": None, "status": None, "retry_after": None}
        log.append(entry)
        body = await request.read()
        try:
            entry["rid"] = json.loads(body).get("rid")
        except (ValueError, AttributeError):
            pass
        headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
        try:
            async with app["session"].post(upstream + "/generate", data=body, headers=headers) as resp:
                raw = await resp.read()
                entry["status"] = resp.status
                if resp.status != 200:
                    entry["message"] = raw[:200].decode("utf-8", "replace")
                if "Retry-After" in resp.headers:
                    entry["retry_after"] = float(resp.headers["Retry-After"])
                out_headers = {"Content-Type": resp.headers.get("Content-Type", "application/json")}
                if "Retry-After" in resp.headers:
                    out_headers["Retry-After"] = resp.headers["Retry-After"]
        except asyncio.CancelledError:
            entry["outcome"] = "client gave up"
            raise
        except aiohttp.ClientError as exc:
            entry["outcome"] = f"upstream {type(exc).__name__}"
            if request.transport is not None:
                request.transport.abort()  # the client sees a reset, as it would from the server
            raise web.HTTPBadGateway() from None
        finally:
            entry["t1"] = time.time()
        return web.Response(body=raw, status=entry["status"], headers=out_headers)

    async def passthrough(request: web.Request) -> web.Response:
        async with app["session"].request(request.method, upstream + request.path_qs, data=await request.read(),
                                          headers={h: request.headers[h] for h in FORWARDED_HEADERS
                                                   if h in request.headers}) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                headers={"Content-Type": resp.headers.get("Content-Type", "text/plain")})

    async def get_log(request: web.Request) -> web.Response:
        return web.json_response(log)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/generate", generate)
    app.router.add_get("/recorder/log", get_log)
    app.router.add_route("*", "/{tail:.*}", passthrough)
    return app


async def serve(upstream: str, host: str, port: int) -> None:
    runner = web.AppRunner(make_app(upstream.rstrip("/")), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"recorder listening on http://{host}:{bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    try:
        asyncio.run(serve(args.upstream, args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
