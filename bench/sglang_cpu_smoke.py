"""`make sglang-cpu-smoke`: budgetq end to end against the real SGLang engine, on this machine's CPU.

Opt-in, never CI (cold: ~15 min on an idle machine, ~70 min measured on a busy shared one; ~7 GB of cache;
warm: 11 min measured on the busy machine). Every figure budgetq has elsewhere was
measured against sglang_sim/; here PyPI's unmodified sglang 0.5.23 answers, serving a tiny random Qwen3 made
locally (/work/shared/reference/sglang-cpu.md has what worked and why). In order, each step timed:

1. environment (bench/sglang_cpu_env.py, cached under --cache): a venv with torch + sglang, SGLang's CPU kernels
   built from the sources given with --kernel-src (how to bring them in with `fetch`: that module's docstring);
2. model (cached): the demo's tokenizer (demo/tokenizer.py: ByteLevel BPE, ChatML with an open-thinking
   template, tool calls), context 2048, and a random Qwen3 (hidden 128, 2 layers) with its vocab_size;
3. the server: `python -m sglang.launch_server --device cpu --attention-backend torch_native` on 127.0.0.1,
   /health and /health_generate watched from the first second, until 200;
4. with --record-fixtures DIR: the contract as the engine speaks it, recorded to DIR (tests/fixtures/sglang_real/:
   tests/unit/test_sim_contract_real.py holds the simulator to it);
5. budgetq: a private redis-server, a recording proxy in front of the server (so the check below is from the
   server's side), 2 real `rq worker`s; `produce` on a budgeted single-turn dataset and a multi-turn one with
   tool calls, --generations 2; one worker killed with kill -9 mid-run and replaced;
6. checks: exactly-once (no id twice, Redis' counter == the completion tokens on disk), the budget, and that every
   turn's output_ids and completion_tokens are what the server answered to that very prompt (prompt digest);
   `produce export` in every format;
7. wall time, disk used and the server's tok/s; every process started is stopped (also on failure or Ctrl-C).

    python -m bench.sglang_cpu_smoke --kernel-src /work/cache/sglang-cpu/src/python/sglang/kernels/aot
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from bench.sglang_cpu_env import DEFAULT_CACHE, NICE, Env, EnvError, log

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
CONTEXT = 2048
MAX_TOKENS = 96
BUDGET = 8000  # tokens, for the single-turn dataset (~ a third of what it would take unbudgeted)
WORKERS = 2
CONCURRENCY = 8
SERVER_READY_S = 300.0
PRODUCE_TIMEOUT_S = 1200.0

# The model, written by the venv's python (torch, transformers 5.19). Random weights, seeded.
MODEL_SCRIPT = r'''
import json, sys, torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM
d = sys.argv[1]
tok = AutoTokenizer.from_pretrained(d)
eos = tok.convert_tokens_to_ids("<|im_end|>")
cfg = Qwen3Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=%d,
                  eos_token_id=eos, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=True, torch_dtype="bfloat16")
torch.manual_seed(0)
model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(d, safe_serialization=True)
json.dump({"eos_token_id": eos, "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id},
          open(d + "/generation_config.json", "w"))
print(len(tok), eos)
''' % CONTEXT


class SmokeError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def http_call(url: str, method: str = "GET", body: bytes | None = None, headers: dict[str, str] | None = None,
              timeout: float = 60.0) -> tuple[int, dict[str, str], bytes]:
    """One request; (status, headers, body). Raises OSError when there is no answer."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or HOST, u.port, timeout=timeout)
    try:
        conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def post_json(url: str, body: Any, timeout: float = 120.0) -> tuple[int, Any]:
    status, _, raw = http_call(url, "POST", json.dumps(body).encode(), {"Content-Type": "application/json"},
                               timeout)
    return status, json.loads(raw) if raw else None


class Procs:
    """Every process this run started, stopped in reverse order (SIGTERM to its group, then SIGKILL)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        fh = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)
        fh.close()
        self.started.append((name, proc))
        return proc

    def stop(self, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
        if proc.poll() is None:
            with _suppress():
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with _suppress():  # the group too: SGLang's scheduler and detokenizer are the launcher's children
            os.killpg(proc.pid, signal.SIGKILL)
        with _suppress():
            proc.wait(5)

    def stop_all(self) -> None:
        for _name, proc in reversed(self.started):
            self.stop(proc)

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], (ProcessLookupError, PermissionError, OSError))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- the model

def make_model(env: Env) -> Path:
    model = env.cache / "model"
    if (model / "model.safetensors").exists() and (model / ".budgetq-model.done").exists():
        return model
    start = time.monotonic()
    shutil.rmtree(model, ignore_errors=True)
    sys.path.insert(0, str(ROOT))
    from demo.tokenizer import build_tokenizer
    build_tokenizer(model, thinking="open", model_max_length=CONTEXT)
    out = subprocess.run(NICE + [str(env.python), "-c", MODEL_SCRIPT, str(model)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SmokeError(f"making the model failed: {out.stderr[-3000:]}")
    (model / ".budgetq-model.done").touch()
    env.timings["model"] = time.monotonic() - start
    log(f"model: vocab/eos {out.stdout.split()}; {env.timings['model']:.1f} s")
    return model


# ---------------------------------------------------------------------------------------------------- the server

def server_env() -> dict[str, str]:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(name, None)
    return env


def start_server(env: Env, procs: Procs, model: Path, port: int) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    """Launch, watch /health and /health_generate until both answer 200; returns the process and what they
    answered while starting (the first answer of each kind, for the fixtures)."""
    argv = NICE + [str(env.python), "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
                   "--host", HOST, "--port", str(port), "--attention-backend", "torch_native",
                   "--disable-overlap-schedule", "--max-total-tokens", "16384"]
    start = time.monotonic()
    proc = procs.spawn("sglang-server", argv, env=server_env(), cwd=env.cache)
    url = f"http://{HOST}:{port}"
    seen: dict[str, Any] = {"/health": [], "/health_generate": []}
    while True:
        statuses = {}
        for path in ("/health", "/health_generate"):
            try:
                status, headers, body = http_call(url + path, timeout=30)
                answer: dict[str, Any] = {"status": status, "content_type": headers.get("content-type"),
                                          "body": body.decode(errors="replace"),
                                          "t": round(time.monotonic() - start, 1)}
            except OSError as exc:
                status, answer = 0, {"status": None, "error": type(exc).__name__,
                                     "t": round(time.monotonic() - start, 1)}
            statuses[path] = status
            kinds = [(a["status"], a.get("body")) for a in seen[path]]
            if (answer["status"], answer.get("body")) not in kinds:
                seen[path].append(answer)
        if all(s == 200 for s in statuses.values()):
            break
        if proc.poll() is not None:
            raise SmokeError(f"the server exited ({proc.returncode}) before /health answered 200:\n"
                             + procs.tail("sglang-server"))
        if time.monotonic() - start > SERVER_READY_S:
            raise SmokeError(f"/health not 200 after {SERVER_READY_S:.0f} s:\n" + procs.tail("sglang-server"))
        time.sleep(0.5)  # a server coming up: no event to await
    env.timings["server ready"] = time.monotonic() - start
    log(f"server ready on {url} after {env.timings['server ready']:.1f} s")
    return proc, seen


def start_sim(procs: Procs, work: Path, port: int) -> tuple[Path, subprocess.Popen[bytes], dict[str, Any]]:
    """--sim: sglang-sim with the demo tokenizer and a config.json naming its vocabulary."""
    sys.path.insert(0, str(ROOT))
    from demo.tokenizer import build_tokenizer
    from render.chat import load_tokenizer
    model = build_tokenizer(work / "model", thinking="open", model_max_length=CONTEXT)
    vocab = len(load_tokenizer(str(model)))
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": vocab,
                                                   "max_position_embeddings": CONTEXT}))
    proc = procs.spawn("sglang-sim", [sys.executable, "-m", "sglang_sim", "--host", HOST, "--port", str(port),
                                      "--tokenizer", str(model), "--reasoning-style", "qwen3-thinking",
                                      "--context-length", str(CONTEXT), "--mean-tokens", "60",
                                      "--tokens-per-second-per-request", "60", "--vocab-size", str(vocab),
                                      "--oov-crash"], cwd=ROOT)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if http_call(url + "/health", timeout=2)[0] == 200:
                return model, proc, {}
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SmokeError("sglang-sim did not come up:\n" + procs.tail("sglang-sim"))
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------- the proxy

class Proxy:
    """A recording reverse proxy in front of the server, on a thread of its own: every /generate answer is
    logged (prompt digest, output_ids, completion_tokens), so the checks see what the server itself said."""

    def __init__(self, upstream: str, log_path: Path) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.log_path = log_path
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, name="proxy", daemon=True)
        self._stop: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.thread.start()
        if not self.ready.wait(10):
            raise SmokeError("the recording proxy did not start")

    def stop(self) -> None:
        if self.loop is not None and self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import aiohttp
        from aiohttp import web

        from budget.record import prompt_digest
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        out = open(self.log_path, "a", buffering=1)

        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
            async with session.request(request.method, self.upstream + request.path_qs, data=body,
                                       headers=headers) as up:
                raw = await up.read()
                if request.path == "/generate" and up.status == 200:
                    try:
                        req, ans = json.loads(body), json.loads(raw)
                        for a in ans if isinstance(ans, list) else [ans]:
                            out.write(json.dumps({
                                "rid": req.get("rid"), "prompt_sha256": prompt_digest(req.get("input_ids") or []),
                                "output_ids": a.get("output_ids"),
                                "completion_tokens": a["meta_info"]["completion_tokens"],
                                "finish_reason": a["meta_info"]["finish_reason"]}) + "\n")
                    except (ValueError, KeyError, TypeError):
                        pass
                return web.Response(status=up.status, body=raw,
                                    headers={"Content-Type": up.headers.get("Content-Type", "application/json")})

        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, HOST, self.port)
        await site.start()
        self.ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await session.close()
        out.close()


# ---------------------------------------------------------------------------------------------------- budgetq

def tool_conversations(path: Path, n: int) -> Path:
    """Multi-turn conversations with a tool call and its result, functions declared in the system prompt."""
    cities = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Dakar"]
    with path.open("w") as f:
        for i in range(n):
            city = cities[i % len(cities)]
            f.write(json.dumps({"id": f"tools-{i:03d}", "messages": [
                {"role": "system", "content": 'You may call this function -\n{\n  "name": "get_weather",\n'
                                              '  "description": "the weather of a city",\n'
                                              '  "parameters": {"city": "string"}\n}'},
                {"role": "user", "content": f"What is the weather in {city}? Answer in one line."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
                {"role": "tool", "content": json.dumps({"city": city, "temp": 10 + i % 20, "sky": "clear"})},
                {"role": "assistant", "content": f"It is {10 + i % 20} degrees and clear in {city}."},
                {"role": "user", "content": "And tomorrow?"},
                {"role": "assistant", "content": "Much the same."}]}) + "\n")
    return path


def start_redis(procs: Procs, work: Path) -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SmokeError("redis-server not found (apt-get install redis-server, or make setup)")
    port = free_port()
    data = work / "redis"
    data.mkdir()
    procs.spawn("redis", [binary, "--bind", HOST, "--port", str(port), "--dir", str(data), "--appendonly", "yes",
                          "--save", "", "--maxmemory-policy", "noeviction"])
    url = f"redis://{HOST}:{port}/0"
    import redis
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            return url
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise SmokeError("redis-server did not answer:\n" + procs.tail("redis")) from None
            time.sleep(0.05)


def worker_env(redis_url: str, sglang_url: str) -> dict[str, str]:
    return dict(os.environ, REDIS_URL=redis_url, SGLANG_URL=sglang_url, BUDGETQ_CONCURRENCY=str(CONCURRENCY),
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def start_worker(procs: Procs, name: str, redis_url: str, sglang_url: str) -> subprocess.Popen[bytes]:
    return procs.spawn(name, [sys.executable, "-m", "rq.cli", "worker", "-w", "worker.Worker", "-c",
                              "worker.settings", "-n", name], env=worker_env(redis_url, sglang_url), cwd=ROOT)


def produce_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "producer.cli", *args]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a torn last line
    return out


def wait_until(pred: Callable[[], bool], timeout: float, what: str, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if any(p.poll() is not None for p in procs):
            raise SmokeError(f"a process ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise SmokeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def run_budgetq(procs: Procs, work: Path, model: Path, proxy: Proxy, timings: dict[str, float]) -> dict[str, Any]:
    import redis

    from budget import keys
    start = time.monotonic()
    redis_url = start_redis(procs, work)
    r = redis.Redis.from_url(redis_url)
    workers = [start_worker(procs, f"smoke-w{i}", redis_url, proxy.url) for i in range(WORKERS)]
    single = ROOT / "demo" / "data" / "code_instruct.jsonl"
    multi = tool_conversations(work / "tool_chats.jsonl", 40)
    out = work / "out"
    argv = produce_argv(str(single), str(multi), "--tokenizer", str(model), "--max-tokens", str(MAX_TOKENS),
                        "--max-context", str(CONTEXT), "--budget", f"code_instruct={BUDGET}", "--generations", "2",
                        "--chunk-size", "8", "--out", str(out), "--redis-url", redis_url)
    log("$ " + " ".join(argv))
    produce = procs.spawn("produce", argv, env=worker_env(redis_url, proxy.url), cwd=ROOT)
    raw = out / "code_instruct" / "raw_responses.jsonl"
    wait_until(lambda: raw.exists() and len(read_jsonl(raw)) >= 8, 300, "the first records", [produce])
    victim = workers[0]
    os.kill(victim.pid, signal.SIGKILL)  # mid-run: its chunk's lease runs out and another worker takes it
    victim.wait()
    log(f"killed worker smoke-w0 (pid {victim.pid}) with SIGKILL after {len(read_jsonl(raw))} records")
    workers.append(start_worker(procs, "smoke-w-replacement", redis_url, proxy.url))
    try:
        rc = produce.wait(PRODUCE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SmokeError("produce did not finish:\n" + procs.tail("produce")) from None
    if rc != 0:
        raise SmokeError(f"produce exited {rc}:\n" + procs.tail("produce"))
    timings["budgetq run"] = time.monotonic() - start
    results: dict[str, Any] = {"datasets": {}}
    for name in ("code_instruct", "tool_chats"):
        recs = read_jsonl(out / name / "raw_responses.jsonl")
        ids = [(x["id"], x.get("generation", 0)) for x in recs]
        if len(ids) != len(set(ids)):
            raise SmokeError(f"{name}: an id is on disk twice")
        on_disk = sum(int(x["completion_tokens"]) for x in recs)
        used = int(r.get(keys.DatasetKeys(name).used) or 0)
        if used != on_disk:
            raise SmokeError(f"{name}: Redis counts {used} tokens, the file holds {on_disk}")
        results["datasets"][name] = {"records": len(recs), "tokens": used,
                                     "generations": sorted({g for _, g in ids}),
                                     "multi_turn": sum(len(x["turns"]) > 1 for x in recs)}
        if name == "code_instruct":
            possible = 150 * 2
            if len(recs) < possible and not (BUDGET <= used < BUDGET + WORKERS * CONCURRENCY * MAX_TOKENS * 2):
                raise SmokeError(f"{name}: {used} tokens for a budget of {BUDGET} with samples left")
        check_server_ids(name, recs, proxy.log_path)
    results["exports"] = export_all(out, model)
    r.close()
    for w in workers:
        procs.stop(w)
    return results


def check_server_ids(name: str, recs: list[dict[str, Any]], log_path: Path) -> None:
    """Every turn's output_ids and completion_tokens are an answer the server gave to that very prompt."""
    answered: dict[str, list[tuple[tuple[int, ...], int]]] = {}
    for line in read_jsonl(log_path):
        answered.setdefault(line["prompt_sha256"], []).append((tuple(line["output_ids"]), line["completion_tokens"]))
    turns = 0
    for rec in recs:
        for i, turn in enumerate(rec["turns"]):
            ids = tuple(turn["output_ids"])
            if (ids, turn["completion_tokens"]) not in answered.get(turn["prompt_ids_sha256"], []):
                raise SmokeError(f"{name} {rec['id']} turn {i}: output_ids/completion_tokens the server never "
                                 "answered to that prompt")
            if turn["completion_tokens"] != len(ids):
                raise SmokeError(f"{name} {rec['id']} turn {i}: completion_tokens != len(output_ids)")
            turns += 1
    log(f"{name}: all {turns} turns' output_ids and completion_tokens are the server's")


def export_all(out: Path, model: Path) -> dict[str, int]:
    """Every format; the conversation formats once per trainer, which decides the rows of multi-turn data, with
    ``--inexact keep``: a random model's answers seldom survive decode and re-encode (the row check's business,
    tests/e2e/test_trainers.py), and this exercises the export path; each export's summary line is logged."""
    from producer.export.writer import CONVERSATION_FORMATS, FORMATS
    rows = {}
    for fmt in FORMATS:
        for trainer in ("specforge", "speculators") if fmt in CONVERSATION_FORMATS else (None,):
            for name in ("code_instruct", "tool_chats"):
                label = " ".join(x for x in (name, fmt, trainer) if x)
                dest = out / "export" / f"{label.replace(' ', '.')}.jsonl"
                dest.parent.mkdir(exist_ok=True)
                argv = ["export", name, "--out", str(out), "--format", fmt, "--dest", str(dest), "--tokenizer",
                        str(model), "--truncated", "keep", *(("--for", trainer, "--inexact", "keep") if trainer else ())]
                done = subprocess.run(produce_argv(*argv), capture_output=True, text=True, cwd=ROOT,
                                      env=worker_env("", ""))
                if done.returncode != 0:
                    raise SmokeError(f"produce {' '.join(argv[:2])} {label} exited {done.returncode}: {done.stderr}")
                log(f"{label}: {done.stdout.strip().splitlines()[0] if done.stdout.strip() else '(no summary)'}")
                rows[label] = len(read_jsonl(dest))
                if rows[label] == 0:
                    raise SmokeError(f"produce export {label} wrote no row")
    return rows


def server_tok_s(url: str) -> dict[str, Any]:
    """The server's own throughput figure and a measured one: 16 concurrent 100+100 ignore_eos requests."""
    import concurrent.futures
    info = json.loads(http_call(url + "/server_info")[2])
    own = [s.get("last_gen_throughput") for s in info.get("internal_states", [])]
    body = {"input_ids": [(7 * i) % 900 + 5 for i in range(100)],
            "sampling_params": {"max_new_tokens": 100, "ignore_eos": True, "temperature": 0.8}}
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: post_json(url + "/generate", body), range(16)))
    wall = time.monotonic() - start
    tokens = sum(a[1]["meta_info"]["completion_tokens"] for a in answers)
    return {"last_gen_throughput": own, "measured_16x100": round(tokens / wall, 1)}


# ---------------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="environment cache (default %(default)s)")
    ap.add_argument("--kernel-src", type=Path, help="SGLang's python/sglang/kernels/aot tree (see bench/sglang_cpu_env.py)")
    ap.add_argument("--kernel-wheel", type=Path, help="a CPU sgl_kernel wheel built before")
    ap.add_argument("--record-fixtures", type=Path, metavar="DIR",
                    help="record the contract to DIR (tests/fixtures/sglang_real to re-record the repository's)")
    ap.add_argument("--port", type=int, default=0, help="the server's port (default: a free one)")
    ap.add_argument("--keep-work", action="store_true", help="keep the run's folder (outputs, logs)")
    ap.add_argument("--sim", action="store_true",
                    help="the simulator in place of the engine (no environment, no model weights): checks this "
                         "script itself, not SGLang")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    env = Env(a.cache)
    work = Path(tempfile.mkdtemp(prefix="smoke-", dir=a.cache if a.cache.exists() else None))
    logs = work / "logs"
    logs.mkdir()
    procs = Procs(logs)
    proxy: Proxy | None = None
    ok = False
    results: dict[str, Any] = {}

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_signal)
    try:
        port = a.port or free_port()
        if a.sim:
            model, server, starting = start_sim(procs, work, port)
        else:
            env.prepare(a.kernel_src, a.kernel_wheel)
            model = make_model(env)
            server, starting = start_server(env, procs, model, port)
        url = f"http://{HOST}:{port}"
        if a.record_fixtures is not None:
            from bench.sglang_cpu_record import record_all
            start = time.monotonic()
            record_all(url, a.record_fixtures, starting, model, CONTEXT)
            env.timings["record fixtures"] = time.monotonic() - start
            if server.poll() is not None:
                raise SmokeError("the server died while the contract was recorded:\n" + procs.tail("sglang-server"))
        proxy = Proxy(url, work / "server_answers.jsonl")
        proxy.start()
        results = run_budgetq(procs, work, model, proxy, env.timings)
        results["server tok/s"] = server_tok_s(url)
        if a.record_fixtures is not None:  # last: it kills the server
            from bench.sglang_cpu_record import record_crash
            vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
            record_crash(url, a.record_fixtures, vocab, server, logs / "sglang-server.log")
        ok = True
    except (SmokeError, EnvError) as exc:
        log(f"FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        if proxy is not None:
            proxy.stop()
        procs.stop_all()
        left = [name for name, p in procs.started if p.poll() is None]
        if left:
            log(f"still running after stop: {left}")
        wall = time.monotonic() - t0
        disk = env.disk_bytes()
        log("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in env.timings.items()))
        log(f"wall time {wall:.1f} s; disk used {disk / 2**30:.2f} GiB under {a.cache}; work folder {work}")
        if not a.keep_work and ok:
            shutil.rmtree(work, ignore_errors=True)
    log("results: " + json.dumps(results, indent=1))
    log("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
