"""Fault injection ("chaos"): break workers, Redis, SGLang and produce mid-run, then check the promise.

    python -m tests.chaos                                # every scenario, short form (2,000 prompts, 2 workers)
    python -m tests.chaos --scenario worker-kill --full  # one scenario, full form (20,000 prompts, 4 workers)
    python -m tests.chaos --list

Each scenario runs on its own private redis-server, sglang-sim and ``rq worker -w worker.Worker`` processes on
loopback (demo/stack.py), injects its fault, lets the run finish, and checks: nothing lost, nothing twice,
Redis' counter equal to the sum of ``completion_tokens`` on disk, no unexpected traceback in the logs, failed
samples only where the fault makes them expected. It reports the requests the simulator did beyond the
samples written (wasted GPU work) and the recovery time. Results go to bench/results/chaos-<form>.json;
docs/reliability.md explains each scenario and its figures. tests/chaos/test_chaos.py runs the "ci" forms;
``make chaos`` the full ones.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

from demo.synthetic import write_prompts
from tests.chaos import auth, outage, redis_faults, sglang_faults, turns, workers
from tests.chaos.audit import Result
from tests.chaos.run import SCALES, Ctx, Scale

#: Where the figures go: they are measurements, which docs/reliability.md cites, beside the benchmarks' own.
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"

#: name -> (what is injected, the scenario)
SCENARIOS: dict[str, tuple[str, Callable[[Ctx], Result]]] = {
    "worker-kill": ("kill -9 a whole worker every 5 s (ci: 3 s), a replacement started at once",
                    workers.worker_kill),
    "worker-kill-turns": ("kill -9 a worker every 5 s (ci: 3 s) during a produce --turns all run of 3-turn "
                          "conversations; per-turn checks from the simulator's request log", turns.worker_kill_turns),
    "worker-kill-turns-budget": ("the same with a budget of 30% of the run: kills go on for 60 s past the close",
                                 turns.worker_kill_turns_budget),
    "worker-restart": ("kill -9 + restart under the same name; a chunk run twice; finished chunks requeued",
                       workers.worker_restart),
    "sigterm": ("SIGTERM every worker mid-run", workers.sigterm_all),
    "redis-kill": ("kill -9 redis-server three times (AOF everysec), restarted each time", redis_faults.redis_kill),
    "redis-empty": ("Redis restarted empty mid-run; produce rerun", redis_faults.redis_empty),
    "redis-stale": ("Redis restarted from a copy of its AOF taken earlier in the run; produce rerun",
                    redis_faults.redis_stale),
    "redis-host-crash": ("Redis' host crashes under appendfsync everysec: its last second of writes lost",
                         redis_faults.redis_host_crash),
    "redis-kill-20s": ("kill -9 redis-server once, restarted from its AOF 20 s later", outage.redis_kill_20),
    "redis-kill-90s": ("kill -9 redis-server once, restarted from its AOF 90 s later (every lease lapsed)",
                       outage.redis_kill_90),
    "redis-freeze-45s": ("SIGSTOP redis-server for 45 s: connections open, nothing answered",
                         outage.redis_freeze_45),
    "redis-blackhole": ("every open connection to Redis black-holed at once (no reset), new ones work",
                        outage.redis_blackhole),
    "sglang-faults": ("503, 429 + Retry-After, 500, resets, hangs past the timeout, 400s, then a full outage",
                      sglang_faults.sglang_faults),
    "malformed": ("malformed SGLang bodies (every kind)", sglang_faults.malformed),
    "wrong-key": ("workers with a wrong SGLANG_API_KEY, restarted as they exit, for 20 s; then the right key",
                  auth.wrong_key),
    "produce-races": ("two produce at once; produce --detach killed -9 repeatedly while enqueueing",
                      workers.produce_races),
}


def make_ctx(scale: Scale, workdir: Path, tokenizer: Path | None = None) -> Ctx:
    """A scratch directory with the scale's prompts file, and a tokenizer (built here unless given)."""
    if tokenizer is None:
        from demo.tokenizer import build_tokenizer
        tokenizer = build_tokenizer(workdir / "tok", thinking="none")
    data = write_prompts(workdir / f"prompts-{scale.prompts}.jsonl", scale.prompts)
    return Ctx(scale, workdir, tokenizer, data)


def run_scenario(name: str, ctx: Ctx) -> Result:
    t0 = time.monotonic()
    try:
        res = SCENARIOS[name][1](ctx)
    except Exception as exc:  # a scenario that could not finish is a failed scenario, with its reason
        res = Result(name, ctx.scale.name)
        res.check("scenario ran to the end", False, f"{type(exc).__name__}: {exc}")
        res.note = traceback.format_exc(limit=3)
    res.wall_s = time.monotonic() - t0
    return res


def table(results: list[Result]) -> str:
    lines = ["| scenario | form | lost | duplicates | drift | failed | wasted | recovery | checks |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        f = r.figures
        lines.append(f"| {r.scenario} | {r.scale} | {f.get('lost', '-')} | {f.get('duplicates', '-')} | "
                     f"{f.get('drift', '-')} | {f.get('failed', '-')} | {f.get('wasted', '-')} | "
                     f"{f.get('recovery_s', '-')} | {'ok' if r.ok else 'FAILED: ' + '; '.join(r.failures())[:300]} |"
                     .replace("\n", " "))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), metavar="NAME",
                    help="run only this scenario (repeatable; default: all); see --list")
    ap.add_argument("--full", action="store_true", help="the full form: 20,000 prompts, 4 workers (heavy)")
    ap.add_argument("--scale", choices=sorted(SCALES), default=None, help="short (default), full or ci")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    ap.add_argument("--keep", type=Path, default=None, help="keep logs and outputs in this directory")
    args = ap.parse_args(argv)
    if args.list:
        for name, (what, _) in SCENARIOS.items():
            print(f"{name:16} {what}")
        return 0
    scale = SCALES[args.scale or ("full" if args.full else "short")]
    names = args.scenario or list(SCENARIOS)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="budgetq-chaos-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ctx = make_ctx(scale, work)
        for name in names:
            print(f"== {name} ({scale.name}): {SCENARIOS[name][0]}", flush=True)
            res = run_scenario(name, ctx)
            results.append(res)
            print(json.dumps(res.as_dict()), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"chaos-{scale.name}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    previous.update({r.scenario: r.as_dict() for r in results})  # one file per form, a row per scenario
    path.write_text(json.dumps(previous, indent=2) + "\n")
    print(table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
