"""The multi-turn baseline: a plain asyncio client regenerating conversations turn by turn, what budgetq is
compared with in the multi-turn efficiency figure (bench/multiturn.py).

    python -m bench.multiturn_client --url http://127.0.0.1:PORT --data convs.jsonl --tokenizer DIR \
        --in-flight 256 --duration 90 --out done.json

One process, one aiohttp session, ``--in-flight`` coroutines each carrying one conversation at a time from its
first turn to its last, then taking the next: so at most that many requests are in flight, and a started
conversation never waits behind unstarted ones (as a budgetq worker's window keeps a conversation's slot,
worker/turns.py). Turn i's prompt is rendered with the chat template (render/chat.py ``Renderer``, generation
prompt added) over (system, u1, a1', ..., ui), where a1'.. are the model's own answers parsed with the run's
reasoning parser (worker/reasoning.py ``parse_turn``) and put in the history as budget/record.py
``history_message`` says: the same rule as budgetq's workers (budget/record.py ``walk``: a turn cut by
``length`` before the last ends the conversation; a prompt that no longer fits ``--max-context`` with
``max_new_tokens`` ends it). Renders run in a thread, off the event loop. Turn 0 is rendered for every
conversation before the first request, as ``produce`` renders it before it enqueues.

No Redis, no retries, no bookkeeping: the ceiling a client can reach on this machine. Writes each answer's wall
time, completion tokens and turn to ``--out``. Rids name turns as worker/turns.py does (dataset ``baseline``), so
tests/sim_log.py finds a conversation's turns in a simulator's ``--request-log``.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from budget.keys import turn_field
from budget.record import plan, request_id, walk
from render.chat import Renderer, load_tokenizer
from worker.reasoning import parse_turn


def load_conversations(path: Path) -> list[tuple[str, list[dict[str, Any]]]]:
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out.append((str(row["id"]), row["messages"]))
    return out


async def run(url: str, conversations: list[tuple[str, list[dict[str, Any]]]], renderer: Renderer, parser: str,
              sampling_params: dict[str, Any], in_flight: int, max_context: int,
              duration: float | None) -> dict[str, Any]:
    max_new = int(sampling_params["max_new_tokens"])
    steps = [plan(messages) for _, messages in conversations]
    first: list[Any] = []
    for i in range(0, len(conversations), 256):  # turn 0 of every conversation, before the first request
        first += renderer.render_many([walk(s, []).prompt or [] for s in steps[i:i + 256]])
    done: list[tuple[float, int, int]] = []  # (wall time, completion tokens, turn)
    ended: collections.Counter[str] = collections.Counter()
    errors = 0
    next_conv = 0
    t0 = time.time()
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=3600)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def conversation(c: int) -> None:
            nonlocal errors
            sid = conversations[c][0]
            turns: list[dict[str, Any]] = []
            while True:
                state = walk(steps[c], turns)
                if state.prompt is None:
                    ended[state.stopped_by or "end"] += 1
                    return
                i = len(turns)
                rendered = first[c] if i == 0 else await asyncio.to_thread(renderer.render, state.prompt)
                if len(rendered.input_ids) + max_new > max_context:
                    ended["context"] += 1
                    return
                body = {"input_ids": rendered.input_ids, "sampling_params": sampling_params,
                        "rid": request_id("baseline", sid if i == 0 else turn_field(sid, i), 0)}
                try:
                    async with session.post(url + "/generate", json=body) as resp:
                        raw = await resp.read()
                        if resp.status != 200:
                            errors += 1
                            return
                    answer = json.loads(raw)
                    meta = answer["meta_info"]
                    finish = str(meta["finish_reason"]["type"])
                except (aiohttp.ClientError, OSError, ValueError, KeyError):
                    errors += 1
                    return
                done.append((time.time(), int(meta["completion_tokens"]), i))
                parsed = parse_turn(parser, answer["text"], opens_think=rendered.opens_think, finish_reason=finish,
                                    call_id_seed=f"baseline\0{sid}")
                turns.append({"content": parsed.content, "reasoning": parsed.reasoning,
                              "tool_calls": list(parsed.tool_calls), "finish_reason": finish})

        async def carrier() -> None:
            nonlocal next_conv
            while next_conv < len(conversations):
                c, next_conv = next_conv, next_conv + 1
                await conversation(c)

        tasks = [asyncio.create_task(carrier()) for _ in range(in_flight)]
        if duration is None:
            await asyncio.gather(*tasks)
        else:
            _, pending = await asyncio.wait(tasks, timeout=duration)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return {"started_at": t0, "conversations_started": next_conv, "done": done, "errors": errors,
            "ended": dict(ended), "ended_at": time.time()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--data", type=Path, required=True, help="JSON lines {id, messages}")
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--reasoning-parser", default="none")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--max-context", type=int, default=65536)
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    renderer = Renderer(load_tokenizer(args.tokenizer))
    result = asyncio.run(run(args.url, load_conversations(args.data), renderer, args.reasoning_parser,
                             {"max_new_tokens": args.max_tokens}, args.in_flight, args.max_context, args.duration))
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
