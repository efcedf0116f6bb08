"""What every chaos scenario runs on: its scale, a stack it may break (Redis restartable, workers replaceable,
an optional recording proxy before SGLang), a produce it may kill, and a watch on the commits. The audit of
the outcome is tests/chaos/audit.py."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import redis

from budget.keys import DatasetKeys
from demo.appending import read_jsonl
from demo.stack import Service, Stack, free_port, http_ok, produce_cmd, wait_until
from demo.synthetic import write_prompts
from tests.chaos.audit import DATASET, Result
from tests.chaos.blackhole import BlackHole

KEYS = DatasetKeys(DATASET)  # the scenarios' dataset's keys
QUEUE = "budgetq"


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
    outage_s: float  # sglang-faults: the full outage (0: none; tests/e2e/test_reliability.py has a short one)
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


class ChaosStack(Stack):
    """A Stack whose redis-server can be killed and started again (same port, same directory), and whose
    workers can be killed and replaced by name. Optionally the workers talk to SGLang through
    tests/chaos/recorder.py."""

    def __init__(self, workdir: Path, *, recorder: bool = False, blackhole: bool = False, **kwargs: Any) -> None:
        super().__init__(workdir, **kwargs)
        self.use_recorder = recorder
        self.use_blackhole = blackhole
        self.blackhole: BlackHole | None = None
        self.direct_url = ""  # Redis itself, for the audit; redis_url (workers, produce) may go through the proxy
        self.recorder_url = ""
        self.by_name: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> "ChaosStack":
        # Start workers ourselves, after the optional recorder: the base class starts them at once.
        n, self.n_workers = self.n_workers, 0
        super().start()
        self.n_workers = n
        self.direct_url = self.redis_url
        if self.use_blackhole:  # every client of the run reaches Redis through it; the audit does not
            port = int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
            self.blackhole = BlackHole(port).start()
            self.redis_url = f"redis://127.0.0.1:{self.blackhole.port}/0"
        if self.use_recorder:
            port = free_port()
            recorder = self.spawn("recorder", [sys.executable, "-m", "tests.chaos.recorder", "--upstream",
                                               self.sim_urls[0], "--port", str(port)])
            self.recorder_url = f"http://127.0.0.1:{port}"
            wait_until(lambda: http_ok(self.recorder_url + "/health"), 30, "recorder",
                       watch=[Service("recorder", recorder, self.workdir / "recorder.log")])
        for i in range(n):
            self.add_worker(f"w{i}")
        return self

    def __enter__(self) -> "ChaosStack":
        super().__enter__()
        return self

    def stop(self) -> None:
        super().stop()
        if self.blackhole is not None:
            self.blackhole.stop()

    def client(self) -> "redis.Redis":
        return redis.Redis.from_url(self.direct_url or self.redis_url)

    def add_worker(self, name: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        extra = {"SGLANG_URL": self.recorder_url} if self.recorder_url else {}
        proc = self.start_worker(name, env={**extra, **(env or {})})
        self.by_name[name] = proc
        return proc

    @property
    def redis_dir(self) -> Path:
        return self.redis.data_dir

    def freeze_redis(self, frozen: bool) -> None:
        """SIGSTOP (or SIGCONT) redis-server: a Redis that accepts connections and never answers."""
        self.redis.send_signal(signal.SIGSTOP if frozen else signal.SIGCONT)

    def kill_redis(self) -> None:
        self.redis.kill()

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
        self.key = DatasetKeys(dataset).done
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
        done_key = DatasetKeys(dataset).done
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
                seq = stack.client().get(DatasetKeys(dataset).seq)
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


@dataclass
class Ctx:
    """Where a scenario runs: its scale, a scratch directory, the tokenizer and the prompts file."""

    scale: Scale
    workdir: Path
    tokenizer: Path
    data: Path

    def stack(self, name: str, *, sim_extra: Sequence[str] = (), env: dict[str, str] | None = None,
              recorder: bool = False, workers: int | None = None, blackhole: bool = False) -> ChaosStack:
        s = self.scale
        shutil.rmtree(self.workdir / name, ignore_errors=True)  # a kept directory from an earlier run
        return ChaosStack(self.workdir / name, sim_args=[*s.sim, *sim_extra], recorder=recorder, blackhole=blackhole,
                          workers=s.workers if workers is None else workers,
                          worker_env={"BUDGETQ_CONCURRENCY": str(s.concurrency), **(env or {})})

    def produce(self, stack: ChaosStack, tag: str, *extra: str, data: Path | None = None) -> Produce:
        return Produce(stack.workdir, tag, produce_argv(self.scale, data or self.data, self.tokenizer,
                                                        stack.workdir / "out", stack.redis_url, *extra))

    def prompts(self, n: int) -> Path:
        """A prompts file of n prompts (the scale's own, or another size written once)."""
        path = self.workdir / f"prompts-{n}.jsonl"
        return path if path.exists() else write_prompts(path, n)


