"""What every chaos scenario shares: a stack it may break, a produce it may kill, a watch on the commits, and
the audit that turns the run's files, counters and logs into figures and checks.

The audit is the promise, measured from the outside: every sample ends in ``raw_responses.jsonl`` (or in
``failed.jsonl`` where a scenario expects failures) exactly once, Redis' counter equals the sum of
``completion_tokens`` in the file, and the simulator did no more requests than the samples need, beyond what
the injected faults justify.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import redis

from bench.harness import Stack, _wait, free_port, produce_cmd, write_prompts

DATASET = "prompts"
KEYS = f"bq:ds:{{{DATASET}}}"  # the dataset's key prefix (budget/keys.py DatasetKeys)
QUEUE = "budgetq"


def wait_until(pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll state owned by other processes (Redis keys, files): there is no event to await across them."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


@dataclass(frozen=True)
class Scale:
    """One size of the scenarios. ``request_s`` bounds one request's wall time at full load."""

    name: str
    prompts: int
    workers: int
    concurrency: int
    chunk: int
    max_tokens: int
    sim: tuple[str, ...]
    request_s: float
    kill_every: float  # worker-kill: seconds between kills
    outage_s: float  # sglang-faults: the full outage (0: none; tests/test_reliability.py has a short one)
    fault_s: float  # sglang-faults: seconds of mixed faults
    faults_prompts: int  # sglang-faults: enough prompts to outlast every phase
    redis_down_s: float  # redis-kill: seconds Redis stays dead each time

    @property
    def in_flight(self) -> int:
        return self.workers * self.concurrency


def _sim(mean: int, per_request_tps: int, time_scale: float) -> tuple[str, ...]:
    return ("--mean-tokens", str(mean), "--tokens-per-second-per-request", str(per_request_tps),
            "--time-scale", str(time_scale), "--saturation-batch", "64", "--max-running", "256",
            "--prefix-cache-pages", "0")


# Wall decode speed per request = tokens-per-second-per-request x time-scale x min(1, 64 / running).
SCALES = {
    # 20,000 prompts, 4 workers x 64: 256 running, 125 tok/s each: a 200-token mean takes 1.6 s, 512 at most 4.1 s.
    "full": Scale("full", 20_000, 4, 64, 50, 512, _sim(200, 500, 1), 4.1 + 2, 5.0, 30.0, 60.0, 20_000, 4.0),
    # 2,000 prompts, 2 workers x 32: 200 tok/s each, 1 s mean, 2.6 s at most.
    "short": Scale("short", 2_000, 2, 32, 25, 512, _sim(200, 100, 2), 2.6 + 2, 5.0, 6.0, 15.0, 3_000, 3.0),
    # What the tests run: 400 prompts, 2 workers x 16, 1 s mean, 2.6 s at most.
    "ci": Scale("ci", 400, 2, 16, 10, 256, _sim(100, 50, 2), 2.6 + 2, 3.0, 0.0, 6.0, 400, 2.0),
}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Result:
    scenario: str
    scale: str
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    wall_s: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append(Check(name, bool(ok), str(detail)))
        return bool(ok)

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "scale": self.scale, "ok": self.ok, "wall_s": round(self.wall_s, 1),
                "figures": self.figures, "checks": [c.__dict__ for c in self.checks], "note": self.note}


class ChaosStack(Stack):
    """A Stack whose redis-server can be killed and started again (same port, same directory), and whose
    workers can be killed and replaced by name. Optionally the workers talk to SGLang through bench.recorder."""

    def __init__(self, workdir: Path, *, recorder: bool = False, **kwargs: Any) -> None:
        super().__init__(workdir, **kwargs)
        self.use_recorder = recorder
        self.recorder_url = ""
        self.by_name: dict[str, subprocess.Popen[bytes]] = {}
        self._redis_argv: list[str] = []

    def start(self) -> "ChaosStack":
        # Start workers ourselves, after the optional recorder: the base class starts them at once.
        n, self.n_workers = self.n_workers, 0
        super().start()
        self.n_workers = n
        self._redis_argv = [str(a) for a in self.redis_proc().args]  # type: ignore[union-attr]
        if self.use_recorder:
            port = free_port()
            self._spawn("recorder", [sys.executable, "-m", "bench.recorder", "--upstream", self.sim_urls[0],
                                     "--port", str(port)])
            self.recorder_url = f"http://127.0.0.1:{port}"
            _wait(lambda: urllib.request.urlopen(self.recorder_url + "/health", timeout=1).status == 200,
                  "recorder")
        for i in range(n):
            self.add_worker(f"w{i}")
        return self

    def __enter__(self) -> "ChaosStack":
        super().__enter__()
        return self

    def add_worker(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        extra = {"SGLANG_URL": self.recorder_url} if self.recorder_url else {}
        proc = self.start_worker(name, env={**extra, **(env or {})})
        self.by_name[name] = proc
        return proc

    def redis_proc(self) -> subprocess.Popen[bytes] | None:
        found = [p for p in self.procs if "redis-server" in str(p.args[0])]  # type: ignore[index]
        return found[-1] if found else None

    @property
    def redis_dir(self) -> Path:
        return self.workdir / "redis"

    def kill_redis(self) -> None:
        proc = self.redis_proc()
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def start_redis(self) -> None:
        self._spawn("redis", self._redis_argv)
        _wait(self.client().ping, "redis-server", timeout=60)

    def recorder_log(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(self.recorder_url + "/recorder/log", timeout=30) as resp:
            return list(json.loads(resp.read()))

    def set_faults(self, body: dict[str, Any]) -> None:
        req = urllib.request.Request(self.sim_urls[0] + "/sim/faults", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200


class Watch(threading.Thread):
    """Samples the dataset's committed count every 0.1 s: when commits stopped and started again."""

    def __init__(self, redis_url: str, output: Path | None = None, dataset: str = DATASET) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(redis_url, socket_timeout=1, socket_connect_timeout=1)
        self.key = f"bq:ds:{{{dataset}}}:done"
        self.output = output
        self.samples: list[tuple[float, int | None]] = []  # (monotonic time, committed or None: Redis down)
        self.written: list[tuple[float, int]] = []  # (monotonic time, bytes in raw_responses.jsonl)
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                n: int | None = int(self.r.hlen(self.key))
            except redis.RedisError:
                n = None
            now = time.monotonic()
            self.samples.append((now, n))
            if self.output is not None:
                self.written.append((now, self.output.stat().st_size if self.output.exists() else 0))
            self.stop_flag.wait(0.1)

    def first_write_after(self, t: float) -> float | None:
        """When the output file first grew after time t: produce collecting again."""
        base = next((size for ts, size in self.written if ts >= t), None)
        return next((ts for ts, size in self.written if ts >= t and base is not None and size > base), None)

    def stop(self) -> None:
        self.stop_flag.set()
        self.join(5)

    def first_commit_after(self, t: float) -> float | None:
        """When the committed count first grew after time t (None: it never did)."""
        base: int | None = None
        for ts, n in self.samples:
            if ts < t or n is None:
                continue
            if base is None:
                base = n
            elif n > base:
                return ts
        return None

    def reached(self, count: int) -> float | None:
        return next((ts for ts, n in self.samples if n is not None and n >= count), None)


class Produce:
    """``produce`` as a user runs it, its stdout and stderr kept in files of the work directory."""

    def __init__(self, run_dir: Path, tag: str, argv: Sequence[str]) -> None:
        self.out_path, self.err_path = run_dir / f"produce-{tag}.out", run_dir / f"produce-{tag}.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(list(argv), stdout=out, stderr=err)
        self.started = time.monotonic()
        self.ended: float | None = None

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = -999
        self.ended = self.ended or time.monotonic()
        return rc

    def finish(self, stack: "ChaosStack", timeout: float, res: Result | None = None, stall_s: float = 60.0,
               dataset: str = DATASET) -> int:
        """Wait for produce to exit. A produce still running while nothing was committed or written for
        ``stall_s`` seconds is stalled: it is killed, the stall recorded in ``res``, and -998 returned."""
        done_key = f"bq:ds:{{{dataset}}}:done"
        output = stack.workdir / "out" / dataset / "raw_responses.jsonl"
        deadline = time.monotonic() + timeout
        last: tuple[int, int] | None = None
        since = time.monotonic()
        while self.proc.poll() is None:
            now = time.monotonic()
            try:
                state = (int(stack.client().hlen(done_key)), output.stat().st_size if output.exists() else 0)
            except (redis.RedisError, OSError):
                state = last or (0, 0)
            if state != last:
                last, since = state, now
            elif now - since > stall_s or now > deadline:
                seq = stack.client().get(f"bq:ds:{{{dataset}}}:seq")
                if res is not None:
                    res.check("produce finished (no stall)", False,
                              f"still running after {now - since:.0f} s without a commit or a write: "
                              f"{state[0]} committed, {len(read_jsonl(output))} on disk, "
                              f"{int(seq or 0)} chunk jobs enqueued so far")
                self.kill()
                return -998
            time.sleep(0.5)
        self.ended = self.ended or time.monotonic()
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.ended = time.monotonic()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")


def produce_argv(scale: Scale, data: Path, tokenizer: Path, out: Path, redis_url: str, *extra: str) -> list[str]:
    return [*produce_cmd(), f"{DATASET}={data}", "--tokenizer", str(tokenizer), "--max-tokens",
            str(scale.max_tokens), "--chunk-size", str(scale.chunk), "--out", str(out), "--redis-url", redis_url,
            *extra]


# -- the audit ------------------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


TRACEBACK = "Traceback (most recent call last):"


def tracebacks(paths: Iterable[Path]) -> list[tuple[str, str]]:
    """(file name, final exception line) of every Python traceback in the logs."""
    found = []
    for path in paths:
        if not path.exists():
            continue
        lines = path.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.strip() != TRACEBACK:
                continue
            j = i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                j += 1
            found.append((path.name, lines[j].strip() if j < len(lines) else "(log ends)"))
    return found


def audit(res: Result, stack: ChaosStack, out: Path, ids: Sequence[str], logs: Iterable[Path], *,
          allowed_tracebacks: str | None = None, failures_allowed: str | None = None,
          dataset: str = DATASET) -> dict[str, Any]:
    """The common checks: lost, duplicates, counter drift, unexpected failures and tracebacks. Adds the checks
    to ``res`` and returns the figures (also merged into ``res.figures``)."""
    recs = read_jsonl(out / dataset / "raw_responses.jsonl")
    failed = {str(f["id"]): f for f in read_jsonl(out / dataset / "failed.jsonl")}
    written = [str(x["id"]) for x in recs]
    unique = set(written)
    r = stack.client()
    used = int(r.get(f"bq:ds:{{{dataset}}}:used") or 0)
    done = int(r.hlen(f"bq:ds:{{{dataset}}}:done"))
    tokens = sum(int(x["completion_tokens"]) for x in recs)
    lost = [sid for sid in ids if sid not in unique and sid not in failed]
    stats = stack.sim_stats()
    figures = {
        "samples": len(ids), "written": len(written), "failed": len(failed), "lost": len(lost),
        "duplicates": len(written) - len(unique), "drift": used - tokens, "redis_used": used, "file_tokens": tokens,
        "sim_completed": stats["completed"], "sim_aborted": stats["aborted"],
        "wasted": stats["completed"] + stats["aborted"] - len(unique),
        "chunk_jobs": int(r.get(f"bq:ds:{{{dataset}}}:seq") or 0),
    }
    res.figures.update(figures)
    res.check("lost = 0", not lost, f"{len(lost)} lost, e.g. {lost[:5]}")
    res.check("duplicates = 0", figures["duplicates"] == 0, figures["duplicates"])
    res.check("drift = 0", used == tokens and done == len(unique),
              f"Redis used {used} vs file {tokens}; done {done} vs {len(unique)} ids")
    unexpected_failed = {sid: f.get("reason") for sid, f in failed.items()
                         if failures_allowed is None or not re.search(failures_allowed, str(f.get("reason")))}
    res.check("failed only where expected", not unexpected_failed,
              f"{len(unexpected_failed)} unexpected, e.g. {list(unexpected_failed.items())[:3]}")
    tbs = tracebacks(logs)
    unexpected_tb = [t for t in tbs if allowed_tracebacks is None or not re.search(allowed_tracebacks, t[1])]
    res.figures["tracebacks"] = len(tbs)
    res.check("no unexpected traceback", not unexpected_tb, unexpected_tb[:5])
    return figures


@dataclass
class Ctx:
    """Where a scenario runs: its scale, a scratch directory, the tokenizer and the prompts file."""

    scale: Scale
    workdir: Path
    tokenizer: Path
    data: Path

    def stack(self, name: str, *, sim_extra: Sequence[str] = (), env: dict[str, str] | None = None,
              recorder: bool = False, workers: int | None = None) -> ChaosStack:
        s = self.scale
        shutil.rmtree(self.workdir / name, ignore_errors=True)  # a kept directory from an earlier run
        return ChaosStack(self.workdir / name, sim_args=[*s.sim, *sim_extra], recorder=recorder,
                          workers=s.workers if workers is None else workers,
                          worker_env={"BUDGETQ_CONCURRENCY": str(s.concurrency), **(env or {})})

    def produce(self, stack: ChaosStack, tag: str, *extra: str, data: Path | None = None) -> Produce:
        return Produce(stack.workdir, tag, produce_argv(self.scale, data or self.data, self.tokenizer,
                                                        stack.workdir / "out", stack.redis_url, *extra))

    def prompts(self, n: int) -> Path:
        """A prompts file of n prompts (the scale's own, or another size written once)."""
        path = self.workdir / f"prompts-{n}.jsonl"
        return path if path.exists() else write_prompts(path, n)


def sample_ids(n: int) -> list[str]:
    """The ids bench.harness.write_prompts gives its n prompts."""
    return [str(i) for i in range(n)]


def log_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("*") if p.suffix in (".log", ".err", ".out") and p.name != "redis.log")
