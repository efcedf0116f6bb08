"""An asyncio event loop on virtual time, for code whose timing is what a test checks (the simulator's engine, its
outage windows): ``loop.time()`` starts at 0 and moves only when the loop has nothing ready to run, straight to the
next timer, instead of sleeping until it. So a test asserts the exact times the model defines (40 ms, not
"between 39 and 55 ms"), however loaded the machine is, and takes no wall time waiting for them.

Only for code that waits on timers and futures of this loop, with ``loop.time`` as its clock (``Engine(...,
clock=loop.time)``). No sockets or subprocesses: the loop cannot know whether data is on its way, so it would
jump time while a peer is still answering. A thread handing work back (``call_soon_threadsafe``, the default
executor's shutdown in ``asyncio.run``) is fine: with no timer pending the loop waits for it as any loop does.
"""
from __future__ import annotations

import asyncio
import selectors
from typing import Any, Coroutine, Mapping, TypeVar

T = TypeVar("T")


class _AdvancingSelector(selectors.BaseSelector):
    """A real selector that never waits while a timer is pending: it polls, and when nothing is ready it moves the
    virtual clock on by the timeout the loop asked for, which is the time to its earliest timer."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.now = 0.0

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer at all: only another thread can wake the loop, so wait for it for real
            return self._real.select(None)
        ready = self._real.select(0)
        if not ready:
            self.now += timeout
        return ready

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose ``time()`` is virtual (see the module doc)."""

    def __init__(self) -> None:
        self._virtual = _AdvancingSelector()
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.now


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a fresh VirtualTimeLoop."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro)
