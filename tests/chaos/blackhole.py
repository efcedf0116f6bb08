"""A TCP proxy that can black-hole every open connection: what a crashed Redis host or a replaced pod looks like.

When a host dies, nothing tells its clients: no FIN, no RST, their requests are simply never answered (and
here, since the proxy's own kernel still ACKs, not even TCP keepalive notices). ``silence()`` makes every
connection open at that moment stop forwarding in both directions without closing either side; connections
made afterwards are forwarded normally, as a client that reconnects to a replaced server would be. Only a
client's own read timeout can get it out.

It runs on a thread of its own with its own event loop, in the process of the benchmark or test using it:

    with BlackHole(upstream_port=6379) as hole:   # clients use hole.port
        ...
        n = hole.silence()                         # the connections open now go silent
"""
from __future__ import annotations

import asyncio
import threading
from types import TracebackType

from demo.stack import free_port


class _Pair:
    """One client connection and its upstream: two pumps, stopped (not closed) when silenced."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.writers = (client, upstream)
        self.pumps: list[asyncio.Task[None]] = []

    def silence(self) -> None:
        for pump in self.pumps:
            pump.cancel()  # the sockets stay open: what the peers sent is never read, nothing more is sent

    def close(self) -> None:
        self.silence()
        for w in self.writers:
            w.close()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()  # a real close by one side is forwarded (only silence() keeps sockets open)


class BlackHole:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1", port: int | None = None) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = port or free_port()
        self.pairs: list[_Pair] = []
        self.silenced: list[_Pair] = []  # kept referenced, so their sockets are never garbage-collected shut
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blackhole", daemon=True)

    def start(self) -> "BlackHole":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("black-hole proxy did not start")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        self._ready.set()
        self.loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()  # upstream down: refuse, as the server itself would
            return
        pair = _Pair(writer, up_writer)
        pair.pumps = [asyncio.create_task(_pump(reader, up_writer)), asyncio.create_task(_pump(up_reader, writer))]
        self.pairs.append(pair)
        done = asyncio.gather(*pair.pumps, return_exceptions=True)
        done.add_done_callback(lambda _: self.pairs.remove(pair) if pair in self.pairs else None)

    def silence(self) -> int:
        """Black-hole every connection open now; returns how many."""
        async def go() -> int:
            pairs, self.pairs = self.pairs, []
            for pair in pairs:
                pair.silence()
            self.silenced.extend(pairs)
            return len(pairs)
        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)

    def stop(self) -> None:
        async def go() -> None:
            self.server.close()
            for pair in self.pairs + self.silenced:
                pair.close()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(go(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)

    def __enter__(self) -> "BlackHole":
        return self.start()

    def __exit__(self, *exc: "type[BaseException] | BaseException | TracebackType | None") -> None:
        self.stop()
