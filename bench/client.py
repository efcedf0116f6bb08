"""The baseline: a plain single-process asyncio client, what budgetq is compared with.

    python -m bench.client --url http://127.0.0.1:PORT --bodies prompts.json --in-flight 256 --duration 60 \
        --out done.json

One aiohttp session, a semaphore of N requests in flight, the same ``POST /generate`` bodies budgetq's workers
send (``input_ids``, ``sampling_params``, a 32-character rid), each answer parsed as JSON and its
``completion_tokens`` counted. No Redis, no retries, no bookkeeping: the ceiling a client can reach on this
machine. It stops after ``--duration`` seconds (in flight requests are cancelled) or after every body was
sent once and answered, and writes each completion's wall time and tokens to ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from budget.record import request_id


async def run(url: str, bodies: list[list[int]], sampling_params: dict[str, Any], in_flight: int,
              duration: float | None, repeat: bool = False) -> dict[str, Any]:
    done: list[tuple[float, int]] = []
    errors = 0
    sem = asyncio.Semaphore(in_flight)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=3600)
    t0 = time.time()
    deadline = None if duration is None else time.monotonic() + duration

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(i: int, ids: list[int]) -> None:
            nonlocal errors
            body = {"input_ids": ids, "sampling_params": sampling_params,
                    "rid": request_id("baseline", str(i), 0)}
            try:
                async with session.post(url + "/generate", json=body) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        errors += 1
                        return
                done.append((time.time(), int(json.loads(raw)["meta_info"]["completion_tokens"])))
            except (aiohttp.ClientError, OSError, ValueError, KeyError):
                errors += 1
            finally:
                sem.release()

        tasks: set[asyncio.Task[None]] = set()
        i = 0
        n = len(bodies)
        while repeat or i < n:
            await sem.acquire()
            if deadline is not None and time.monotonic() >= deadline:
                sem.release()
                break
            task = asyncio.create_task(one(i, bodies[i % n]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        if deadline is None:
            await asyncio.gather(*tasks)
        else:
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"started_at": t0, "sent": i, "done": done, "errors": errors, "ended_at": time.time()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--bodies", type=Path, required=True,
                    help='JSON {"input_ids": [[...], ...], "sampling_params": {...}}')
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--repeat", action="store_true", help="cycle through the bodies until --duration")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    spec = json.loads(args.bodies.read_text())
    result = asyncio.run(run(args.url, spec["input_ids"], spec["sampling_params"], args.in_flight,
                             args.duration, args.repeat))
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
