"""`sglang-sim` / `python -m sglang_sim`: parse the command line, serve until SIGINT or SIGTERM."""
from __future__ import annotations

import asyncio
import signal
from typing import Sequence

from sglang_sim.config import SimConfig, from_argv
from sglang_sim.responses import VERSION
from sglang_sim.server import STATE, start_server


async def serve_until_signalled(cfg: SimConfig) -> None:
    """Run the simulator in this loop; on SIGINT/SIGTERM abort in-flight requests and exit cleanly."""
    server = await start_server(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # One line on stdout, so a parent that asked for port 0 can learn the real one.
    print(f"sglang-sim {VERSION} listening on {server.url}", flush=True)
    crashed = server.app[STATE].crashed
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(crashed.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await server.stop()
    if crashed.is_set():
        raise SystemExit(1)  # --oov-crash: dead, as SGLang's server is after an id past its vocabulary


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    asyncio.run(serve_until_signalled(from_argv(argv)))


if __name__ == "__main__":
    main()
