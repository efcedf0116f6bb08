"""The cheap figures behind docs/multiturn.md's choice of where later turns are rendered.

    PYTHONPATH=$PWD python3 -m bench.multiturn_costs

Demo tokenizer (no hub here): tokenizer file bytes, the import cost of transformers against tokenizers + jinja2,
loading a tokenizer, rendering the 3rd turn of a 3-turn conversation, the JSON bytes of a committed turn, and what
committed turns hold in a private redis-server (MEMORY USAGE of the commit_turn keys).
Times are noisy on a loaded machine: only their order of magnitude is used. Byte counts are exact.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from demo.tokenizer import build_tokenizer

tmp = Path(tempfile.mkdtemp())
d = build_tokenizer(tmp / "tok", thinking="open", vocab_size=int(os.environ.get("VOCAB", "2000")))
files = {p.name: p.stat().st_size for p in d.iterdir()}
print("tokenizer files bytes", files, "total", sum(files.values()),
      "zlib1", sum(len(zlib.compress(p.read_bytes(), 1)) for p in d.iterdir()))

# import cost in a fresh interpreter
for mod in ("tokenizers, jinja2", "transformers"):
    out = subprocess.run([sys.executable, "-c", f"import time,resource; t=time.perf_counter(); import {mod}; "
                          "print(round(time.perf_counter()-t,3), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss//1024)"],
                         capture_output=True, text=True, env={**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
    print(f"import {mod}: seconds, maxrss MiB", out.stdout.strip())

t = time.perf_counter()
from render.chat import Renderer, load_tokenizer

tok = load_tokenizer(d)
r = Renderer(tok)
print("load_tokenizer+Renderer s", round(time.perf_counter() - t, 3))
para = "Explain how a budget counter stays exact when workers are killed. " * 12
ans = "A turn is committed once by a Lua script keyed by sample and turn. " * 40
conv = [{"role": "system", "content": "You are helpful."},
        {"role": "user", "content": para}, {"role": "assistant", "content": "<think>x</think>" + ans},
        {"role": "user", "content": para}, {"role": "assistant", "content": ans},
        {"role": "user", "content": para}]
r.render(conv)
n = 200
t = time.perf_counter()
for _ in range(n):
    ids = r.render(conv).input_ids
dt = (time.perf_counter() - t) / n
print(f"render 3rd turn of a 3-turn conversation: {dt*1000:.2f} ms, {len(ids)} prompt tokens")
t = time.perf_counter()
for _ in range(n):
    text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
print(f"  of which template text only: {(time.perf_counter()-t)/n*1000:.2f} ms, {len(text)} chars")
# state of a conversation in Redis: messages + 2 committed turns (text + output_ids) as JSON
turn = {"response": ans, "content": ans, "reasoning": "", "output_ids": tok.encode(ans, add_special_tokens=False),
        "prompt_tokens": len(ids), "completion_tokens": 0, "finish_reason": "stop", "cached_tokens": 0,
        "tool_calls": [], "reasoning_truncated": False, "reasoning_unclosed": False}
turn["completion_tokens"] = len(turn["output_ids"])
msgs = [m for m in conv if m["role"] != "assistant"]
print("bytes: messages", len(json.dumps(msgs)), "one turn record", len(json.dumps(turn)),
      "turn tokens", turn["completion_tokens"], "bytes/token", round(len(json.dumps(turn)) / turn["completion_tokens"], 1),
      "input_ids of turn 3", len(json.dumps(ids)))

# What committed-but-unwritten turns hold in Redis: 200 conversations x 2 turns through Ledger.commit_turn, on a
# private redis-server (demo/stack.py RedisServer: started here, stopped here).
import redis

from budget import keys
from budget.ledger import Ledger
from demo.stack import RedisServer

srv = RedisServer(Path(tempfile.mkdtemp())); srv.start()
try:
    rds = redis.Redis.from_url(srv.url); L = Ledger(rds); L.set_budget("m", None)
    ans = "A turn is committed once by a Lua script keyed by sample and turn. " * 40
    n_tok = 1361
    rec = {"response": ans, "content": ans, "reasoning": "", "output_ids": list(range(1000, 1000 + n_tok)),
           "prompt_tokens": 3927, "cached_tokens": 0, "completion_tokens": n_tok, "finish_reason": "stop",
           "tool_calls": [], "reasoning_truncated": False, "reasoning_unclosed": False}
    N = 200
    for c in range(N):
        for t in range(2):
            assert L.commit_turn("m", f"conversation-{c:06d}", t, n_tok, rec).committed
    k = keys.DatasetKeys("m")
    mem = {name: rds.memory_usage(getattr(k, name), samples=0) or 0 for name in ("turns", "turnrec", "convs")}
    print("record JSON bytes", len(json.dumps(rec, separators=(",", ":"))), "per conversation of 2 committed turns:",
          {a: round(b / N) for a, b in mem.items()}, "total", round(sum(mem.values()) / N))
finally:
    srv.stop()
