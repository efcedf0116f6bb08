"""What benchmarks measure with: CPU and memory meters, the simulator's counters, a Redis
MONITOR, and where results go. The processes (redis-server, sglang-sim, rq workers) come from the dev stack,
demo/stack.py, the same the tests and the demo start; benchmarks measure the real system (the same commands
users type) and never reach into budgetq's internals.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from demo.stack import wait_until


@contextmanager
def scratch(name: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"budgetq-bench-{name}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _stat_cpu(stat_path: str) -> float:
    """User + system CPU seconds from a /proc stat file (a process's or one of its threads')."""
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (from /proc), for the CPU share beside each figure."""
    try:
        return _stat_cpu(f"/proc/{pid}/stat")
    except (OSError, IndexError, ValueError):
        return 0.0


def admits_start(command: str, inflight_key: str) -> bool:
    """Is this MONITOR line the ``admit`` script granting starts? It runs ``HINCRBY <inflight> CHUNK n`` with the
    number of samples it started (commit and fail give back with -1)."""
    if not command.startswith("HINCRBY " + inflight_key):
        return False
    n = command.rsplit(" ", 1)[-1].strip('"')
    return n.isdigit() and int(n) > 0


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of a live process, by thread id (from /proc/PID/task)."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out[int(tid)] = _stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        except (OSError, IndexError, ValueError):
            continue
    return out


def rss_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a live process in KiB: resident now, and the peak so far."""
    now = peak = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                now = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1])
    except OSError:
        pass
    return now, peak


class CpuMeter:
    """CPU share of named processes over a window: CPU seconds used / wall seconds (1.0 = one core busy).
    ``machine_busy`` is the whole machine's (other work included): the machine has 2 cores and is shared."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.t0 = time.monotonic()
        self.c0 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        self.self0 = _self_cpu()
        self.m0 = _machine_cpu()
        self.shares: dict[str, float] = {}

    def stop(self) -> dict[str, float]:
        dt = max(1e-9, time.monotonic() - self.t0)
        self.shares = {n: round((cpu_seconds(p) - self.c0[n]) / dt, 3) for n, p in self.pids.items()}
        self.shares["bench"] = round((_self_cpu() - self.self0) / dt, 3)
        busy, total = _machine_cpu()
        self.shares["machine_busy"] = round((busy - self.m0[0]) / max(1.0, total - self.m0[1])
                                            * (os.cpu_count() or 1), 3)
        return self.shares


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return float(sum(fields) - idle), float(sum(fields))


def fmt_cpu(shares: dict[str, float]) -> str:
    """'worker0 0.41, sim0 0.08, ...' (cores), for the table cell beside a figure."""
    return ", ".join(f"{k} {v:.2f}" for k, v in shares.items())


def sim_stats_url(url: str) -> dict[str, Any]:
    # 30 s: a simulator that tokenizes (--tokenizer) answers a burst of 256 arrivals for seconds on a loaded machine.
    with urllib.request.urlopen(url + "/sim/stats", timeout=30) as resp:
        return dict(json.loads(resp.read()))


def wait_first_request(url: str, timeout: float = 120.0) -> float:
    """Wall time when the simulator at ``url`` first saw a request (polled: it is another process)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sim_stats_url(url)["submitted"] > 0:
            return time.time()
        time.sleep(0.05)
    raise RuntimeError("no request reached the simulator")


class SimProbe(threading.Thread):
    """Polls /sim/stats of each server every ``interval`` s, keeping (wall time, stats) samples."""

    def __init__(self, urls: Sequence[str], interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.urls = list(urls)
        self.interval = interval
        self.samples: list[tuple[float, list[dict[str, Any] | None]]] = []
        self.stop_flag = threading.Event()

    def snap(self) -> tuple[float, list[dict[str, Any] | None]]:
        out: list[dict[str, Any] | None] = []
        for u in self.urls:
            try:
                out.append(sim_stats_url(u))
            except Exception:
                out.append(None)  # a killed server
        return time.time(), out

    def run(self) -> None:
        while not self.stop_flag.is_set():
            self.samples.append(self.snap())
            self.stop_flag.wait(self.interval)

    def stop(self) -> None:
        self.stop_flag.set()
        self.join()


def window_rate(a: dict[str, Any], b: dict[str, Any], per_request_tps_wall: float, saturation: int
                ) -> dict[str, float]:
    """Over the window between two /sim/stats snapshots: mean running and decoding requests, their share of
    the saturation batch, and the tokens/s the engine generated (rate x min(decoding, saturation))."""
    dt = b["uptime"] - a["uptime"]
    running = (b["running_integral"] - a["running_integral"]) / dt
    decoding = (b["decoding_integral"] - a["decoding_integral"]) / dt
    return {"seconds": dt, "mean_running": running, "mean_decoding": decoding,
            "occupancy": running / saturation,
            "generated_tok_s": per_request_tps_wall * min(decoding, saturation),
            "completed_tok_s": (b["completion_tokens_total"] - a["completion_tokens_total"]) / dt,
            "completed": b["completed"] - a["completed"]}


class RedisMonitor:
    """Redis MONITOR, kept for commands matching ``keep``: (server time, client type, command) events.

    Commands run inside Lua scripts show with client type 'lua', so a script's writes are timed exactly on
    Redis' own clock (the clock of ``TIME``, which the budget scripts use). MONITOR mirrors every command,
    big XADD bodies included, so the stream is read by ``redis-cli monitor | grep -F GREP`` (C processes),
    not parsed in this process, where it would hold the GIL and delay the benchmark's own timers."""

    def __init__(self, redis_url: str, grep: str, keep: Any = None, workdir: Path | None = None) -> None:
        self.redis_url, self.grep, self.keep = redis_url, grep, keep or (lambda c: True)
        self.dir = Path(tempfile.mkdtemp(prefix="budgetq-monitor-", dir=workdir))
        self.path = self.dir / "monitor.txt"
        self.events: list[tuple[float, str, str]] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> "RedisMonitor":
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed")
        out = open(self.path, "wb")
        mon = subprocess.Popen([cli, "-u", self.redis_url, "monitor"], stdout=subprocess.PIPE)
        grep = subprocess.Popen(["grep", "--line-buffered", "-F", "-e", "OK", "-e", self.grep], stdin=mon.stdout,
                                stdout=out)
        out.close()
        self.procs = [mon, grep]
        wait_until(lambda: self.path.exists() and self.path.read_bytes().startswith(b"OK"), 10, "redis-cli monitor")
        return self

    def stop(self) -> list[tuple[float, str, str]]:
        time.sleep(0.05)
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(5)
        for line in self.path.read_text(errors="replace").splitlines():
            head, _, rest = line.partition("] ")
            if not rest or " [" not in head:
                continue
            t, _, client = head.partition(" [")
            kind = "lua" if client.endswith(" lua") else "tcp"
            command = " ".join(x for x in rest[1:-1].split('" "'))
            if self.keep(command):
                self.events.append((float(t), kind, command))
        shutil.rmtree(self.dir, ignore_errors=True)
        return self.events


def sim_args(*, mean: float = 3800, sigma: float = 0.8, per_request_tps: float = 30.0, saturation: int = 256,
             time_scale: float = 20.0, seed: int = 1, extra: Sequence[str] = ()) -> list[str]:
    """The reference workload (docs/performance.md): lognormal lengths (mean 3.8K), ~30 tok/s per request, a 256-request batch."""
    return ["--length-dist", "lognormal", "--mean-tokens", str(mean), "--sigma", str(sigma),
            "--tokens-per-second-per-request", str(per_request_tps), "--saturation-batch", str(saturation),
            "--max-running", str(saturation), "--time-scale", str(time_scale), "--seed", str(seed), *extra]


def save_results(name: str, payload: dict[str, Any]) -> Path:
    """bench/results/NAME.json, stamped with the commit measured (and whether the tree had changes)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"commit": _commit(), **payload}, indent=2, default=str) + "\n")
    return path


def _commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "budget", "producer",
                                "worker", "sglang_sim"], cwd=root, capture_output=True, text=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


RESULTS = Path(__file__).resolve().parent / "results"


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[i]
