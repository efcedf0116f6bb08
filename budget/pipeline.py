"""A budget script call as a value, and many of them sent to Redis in one round trip.

The ledger's ``*_call`` methods (budget/ledger.py) build a ``Call``: the script, its KEYS and ARGV, and how to read
its reply. Building it and reading the reply are the ledger's; when it is sent is the caller's: ``run`` sends one
(what the ledger's plain methods do), ``run_many`` sends many in one pipeline. The worker's ``Batcher``
(worker/batch.py) is what calls ``run_many``: the ledger calls its event loop makes in one iteration go to Redis
together, from a helper thread. The producer sends each call alone, through the ledger's plain methods.

In budget/ and not in worker/: a ``Call`` is part of the ledger's API (every ``*_call`` returns one), and how calls
of one script merge (``Call.merge``) follows from the script's ARGV layout, which is budget/scripts.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One budget script call as a value: sent alone (``run``) or many in one round trip (``run_many``)."""

    script: Script
    keys: list[str]
    args: list[Any]
    parse: Callable[[Any], T]
    #: Width of one reply in a script that takes repeated groups of ARGV (COMMIT). Calls of such a script
    #: with the same KEYS go to Redis as one EVALSHA with their ARGV joined (``run_many``); each gets back
    #: its own ``merge`` values. 0: never merged.
    merge: int = 0


def run(call: Call[T]) -> T:
    """Send one call on the client its script was registered on; its parsed reply."""
    return call.parse(call.script(keys=call.keys, args=call.args))


def run_many(client: "redis.Redis", calls: Sequence[Call[Any]]) -> list[Any]:
    """Send ``calls`` in one non-transactional pipeline on ``client`` (the one their scripts were registered on):
    one round trip instead of len(calls).

    Returns each call's parsed reply, or the exception a call raised (a refused script does not stop the
    others; each script is atomic on its own, which is all the budget needs). A connection error raises for
    the whole batch: a caller may resend any of them, because every budget script is idempotent.

    Calls that can merge (``Call.merge``: COMMIT) and share a script and KEYS go as one EVALSHA with their
    ARGV joined: packing, sending and running one script instead of many is most of what a batch saves. The
    script still decides each group as if it ran alone, in order; the calls of a batch are concurrent, so
    no caller relied on an order between them. A refused merged script is refused for each of its calls.

    The pipeline sends plain EVALSHAs, not redis-py's pipeline scripts, which ask SCRIPT EXISTS before every
    execute (a second round trip); a NOSCRIPT reply (Redis restarted, or SCRIPT FLUSH) means that script did
    not run, so it is loaded and those sends alone go again."""
    sends: list[tuple[Call[Any], list[Any], list[int]]] = []  # (call, joined ARGV, indices of its calls)
    merged: dict[tuple[int, tuple[str, ...]], int] = {}
    for i, call in enumerate(calls):
        if call.merge:
            at = merged.setdefault((id(call.script), tuple(call.keys)), len(sends))
            if at < len(sends):
                sends[at][1].extend(call.args)
                sends[at][2].append(i)
                continue
        sends.append((call, list(call.args), [i]))
    replies: list[Any] = [None] * len(calls)
    todo = sends
    for attempt in (1, 2):
        with client.pipeline(transaction=False) as p:
            for call, args, _ in todo:
                p.evalsha(call.script.sha, len(call.keys), *call.keys, *args)
            raw = p.execute(raise_on_error=False)
        missing = []
        for send, reply in zip(todo, raw, strict=True):
            call, _, members = send
            if isinstance(reply, NoScriptError) and attempt == 1:
                missing.append(send)
            elif isinstance(reply, Exception):
                for i in members:
                    replies[i] = reply
            elif call.merge:
                w = call.merge
                for j, i in enumerate(members):
                    replies[i] = calls[i].parse(reply[j * w:(j + 1) * w])
            else:
                replies[members[0]] = call.parse(reply)
        if not missing:
            break
        for script in {id(send[0].script): send[0].script for send in missing}.values():
            script.sha = client.script_load(script.script)
        todo = missing
    return replies
