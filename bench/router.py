"""A least-connections HTTP router in front of several servers, standing in for sglang-router in benchmarks.

    python -m bench.router --port 0 --backend http://127.0.0.1:A --backend http://127.0.0.1:B

budgetq sees one SGLANG_URL; the router forwards each ``POST /generate`` to the backend with the fewest
requests in flight and relays the answer as is. ``/health`` answers 200 while any backend does. Prints
"router listening on http://127.0.0.1:PORT" once ready.
"""
from __future__ import annotations

import argparse
import asyncio
import socket

import aiohttp
from aiohttp import web


def make_app(backends: list[str]) -> web.Application:
    in_flight = {b: 0 for b in backends}
    state: dict[str, aiohttp.ClientSession] = {}

    async def on_startup(app: web.Application) -> None:
        state["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None))

    async def on_cleanup(app: web.Application) -> None:
        await state["session"].close()

    async def generate(request: web.Request) -> web.Response:
        body = await request.read()
        backend = min(backends, key=lambda b: in_flight[b])
        in_flight[backend] += 1
        try:
            async with state["session"].post(backend + "/generate", data=body,
                                              headers={"Content-Type": "application/json"}) as resp:
                raw = await resp.read()
                return web.Response(body=raw, status=resp.status, content_type="application/json")
        except (aiohttp.ClientError, OSError) as exc:
            return web.json_response({"error": {"message": f"router: {backend}: {exc}"}}, status=502)
        finally:
            in_flight[backend] -= 1

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application(client_max_size=1 << 30)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def serve(port: int, backends: list[str]) -> None:
    runner = web.AppRunner(make_app(backends), handler_cancellation=True)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    site = web.SockSite(runner, sock)
    await site.start()
    print(f"router listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--backend", action="append", required=True)
    args = ap.parse_args()
    asyncio.run(serve(args.port, [b.rstrip("/") for b in args.backend]))


if __name__ == "__main__":
    main()
