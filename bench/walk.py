"""The walk: which modules of producer/, worker/ and budget/ one sample passes through, from its dataset line to
its exported row, measured on the real commands.

    python -m bench.walk                 # ~30 s: a one-turn line and a conversation's; bench/results/walk.json
    python -m bench.walk --functions     # with the functions that ran in each module
    python -m bench.walk --line '{"messages": [...]}' --json walk.json   # another line, written elsewhere

bench/results/walk.json (what docs/architecture.md's code maps must name, tests/unit/test_docs.py) holds, per
line, stage -> module -> the functions that ran.

What runs: a private redis-server and ``sglang-sim`` (demo/stack.py), then, as users type them, an attached
``produce FILE`` of a one-line dataset, one ``rq worker -w worker.Worker -c worker.settings --burst`` started once
the chunk is queued, and ``produce export NAME --for specforge --tokenizer DIR``. Each of the three runs under a
profiler (``python -m bench.walk trace``: sys.setprofile and threading.setprofile, then the command's own
module as ``__main__``) that writes down every function of producer/, worker/, budget/ (and render/, listed
apart) that runs, and in which stage. No status, servers, budget or dashboard command is run.

The definition. A module is on the walk when a function it defines runs *on behalf of the sample*: inside a
stage's call, in the asyncio tasks and callbacks that call schedules and the threads it starts or submits to
(the stage is a context variable, so it follows asyncio's context copies; a thread started, or an executor
work item submitted, inside a stage gets that stage). The stages, each entered at one function:

- ``read``: producer/inputs/reader.py ``read_all`` (the line read and validated);
- ``prepare``: the rest of producer/prepare.py ``load_inputs`` (settings resolved, the prompt rendered, selected);
- ``attach``: producer/session/loop.py ``Producer.attach`` (run.json, locks, budgets, what is left to do);
- ``enqueue``: producer/session/loop.py ``enqueue_chunks`` (the chunk payload onto the RQ queue);
- ``work``: worker/rqworker.py ``Worker.execute_job`` on the chunk (admit, /generate, commit);
- ``collect``: producer/results.py ``collect`` (the results stream into raw_responses.jsonl);
- ``produce``: the rest of the ``produce`` process, the command around its stages (options, launch, the
  pre-flight checks, the attached loop, the progress line and summary, the manifests);
- ``export``: the whole ``produce export`` process (the record into a training row, manifest.json).

Not on the walk: what a worker runs whether or not there is a sample (its start-up, RQ's work loop, the health,
load-report, server-info and window threads), import-time code (module and class bodies, and anything called
while a module is being imported), and code outside the three packages (rq, redis-py, aiohttp, click,
transformers). A module whose only part on the path is data (a dataclass read, a constant) is not counted: the
walk counts modules with a function that ran. The count is of modules, each listed under the first stage, in
the order above, in which one of its functions ran; it is printed with and without the modules only the stage
``produce`` ran (the command's own checks and reports, no hop of the sample's data).
"""
from __future__ import annotations

import argparse
import atexit
import contextvars
import json
import os
import runpy
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
COUNTED: Final = ("producer", "worker", "budget")
LISTED: Final = (*COUNTED, "render")  # render/ is recorded and shown, but not counted (as /tmp/walk.py counts)
STAGES: Final = ("read", "prepare", "attach", "enqueue", "work", "collect", "produce", "export")
#: (module, qualified name) -> the stage its call is.
ENTRIES: Final = {
    ("producer.inputs.reader", "read_all"): "read",
    ("producer.prepare", "load_inputs"): "prepare",
    ("producer.session.loop", "Producer.attach"): "attach",
    ("producer.session.loop", "enqueue_chunks"): "enqueue",
    ("worker.rqworker", "Worker.execute_job"): "work",
    ("producer.results", "collect"): "collect",
}
CO_OPTIMIZED: Final = 0x1  # set on functions, not on module and class bodies
QUEUE_KEY: Final = "rq:queue:budgetq"
#: The lines walked by default: a one-turn sample, and a conversation whose last user turn is regenerated after
#: its first (``--turns all``: the worker renders turn 1 itself).
LINES: Final[dict[str, dict[str, Any]]] = {
    "one turn": {"id": "walk-1", "messages": [
        {"role": "user", "content": "Write a function that adds two numbers, and test it."}]},
    "conversation": {"id": "walk-2", "messages": [
        {"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And another one?"}]},
}


# -- the profiler, inside a traced process ---------------------------------------------------------------------
class Tracer:
    """Records (module, stage) -> qualified names of the functions that ran; ``root`` is the stage of code outside
    every entry (None: not on the walk)."""

    def __init__(self, root: str | None) -> None:
        self.stage: contextvars.ContextVar[str | None] = contextvars.ContextVar("walk_stage", default=root)
        self.modules: dict[str, str | None] = {}  # file name -> module name (None: not a listed package)
        self.seen: set[tuple[Any, str]] = set()
        self.ran: dict[str, dict[str, set[str]]] = {}  # stage -> module -> functions
        self.saved: dict[FrameType, str | None] = {}  # a frame that entered a stage -> the stage before it
        self.threads: dict[threading.Thread, str | None] = {}  # a thread started -> the stage that started it
        self.items: dict[Any, str | None] = {}  # an executor work item -> the stage that submitted it
        self.lock = threading.Lock()
        import concurrent.futures.thread as cft
        self.thread_start = threading.Thread.start.__code__
        self.item_init = cft._WorkItem.__init__.__code__
        self.item_run = cft._WorkItem.run.__code__

    def module_of(self, filename: str) -> str | None:
        try:
            return self.modules[filename]
        except KeyError:
            pass
        name = None
        try:
            rel = Path(filename).resolve().relative_to(ROOT)
        except ValueError:
            rel = None
        if rel is not None and rel.parts and rel.parts[0] in LISTED and rel.suffix == ".py":
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
        self.modules[filename] = name
        return name

    def install(self) -> None:
        threading.setprofile(self._boot)
        sys.setprofile(self.profile)

    def _boot(self, frame: FrameType, event: str, arg: Any) -> None:
        """A new thread's first event: it takes the stage of the code that started it, then is profiled."""
        self.stage.set(self.threads.pop(threading.current_thread(), None))
        sys.setprofile(self.profile)
        self.profile(frame, event, arg)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "return":
            if frame in self.saved:
                self.stage.set(self.saved.pop(frame))
            return
        if event != "call":
            return
        code = frame.f_code
        if code is self.thread_start:
            self.threads[frame.f_locals["self"]] = self.stage.get()
            return
        if code is self.item_init:
            self.items[frame.f_locals["self"]] = self.stage.get()
            return
        if code is self.item_run:
            self.saved[frame] = self.stage.get()
            self.stage.set(self.items.pop(frame.f_locals["self"], None))
            return
        module = self.module_of(code.co_filename)
        if module is None or not code.co_flags & CO_OPTIMIZED:
            return
        entered = ENTRIES.get((module, code.co_qualname))
        if entered is not None:
            self.saved[frame] = self.stage.get()
            self.stage.set(entered)
        stage = self.stage.get()
        if stage is None or (code, stage) in self.seen or importing(frame):
            return
        with self.lock:
            self.seen.add((code, stage))
            self.ran.setdefault(stage, {}).setdefault(module, set()).add(code.co_qualname)

    def dump(self, path: Path) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        with self.lock:
            doc = {stage: {m: sorted(f) for m, f in mods.items()} for stage, mods in self.ran.items()}
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def importing(frame: FrameType | None) -> bool:
    """Is this call part of a module being imported (a module-level call, a decorator)?"""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def trace(out: Path, root: str | None, module: str, args: list[str]) -> None:
    """Run MODULE as ``python -m MODULE ARGS`` under the tracer; what ran goes to OUT as the process exits."""
    tracer = Tracer(root)
    atexit.register(tracer.dump, out)
    sys.argv = [module, *args]
    tracer.install()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


# -- the run, in the parent process -----------------------------------------------------------------------------
def traced(out: Path, root: str, module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "bench.walk", "trace", str(out), root, "--", module, *args]


def measure(work: Path, line: dict[str, Any], timeout: float) -> dict[str, dict[str, list[str]]]:
    """Run the three commands on one line under the tracer; return stage -> module -> functions, merged."""
    import redis

    from demo.stack import NotReady, Stack, spawn, wait_until, worker_argv, worker_env
    from demo.tokenizer import build_tokenizer

    tok = build_tokenizer(work / "tok")
    data = work / "walk.jsonl"
    data.write_text(json.dumps(line) + "\n")
    out = work / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    traces = {name: work / f"{name}.trace.json" for name in ("produce", "worker", "export")}
    sim = ["--time-scale", "50", "--mean-tokens", "40", "--seed", "1", "--tokenizer", str(tok)]
    with Stack(work / "stack", sim_args=sim, workers=0) as stack:
        produce = spawn("produce", traced(traces["produce"], "produce", "producer.cli", str(data), "--tokenizer",
                                          str(tok), "--max-tokens", "256", "--out", str(out), "--redis-url",
                                          stack.redis_url), work, env, cwd=ROOT)
        client = redis.Redis.from_url(stack.redis_url)
        try:
            wait_until(lambda: bool(client.llen(QUEUE_KEY)), timeout, "the chunk on the queue", watch=[produce])
        finally:
            client.close()
        wenv = {**worker_env(stack.redis_url, stack.sim_urls[0]), "PYTHONPATH": env["PYTHONPATH"]}
        worker = spawn("worker", traced(traces["worker"], "-", "rq.cli", *worker_argv("walk")[3:], "--burst"),
                       work, wenv, cwd=ROOT)
        for service in (worker, produce):
            if service.proc.wait(timeout) != 0:
                raise NotReady(f"{service.name} exited {service.proc.returncode} (log {service.log}):\n"
                               f"{service.tail()}")
    name = data.stem
    dest = work / "rows.jsonl"
    export = spawn("export", traced(traces["export"], "export", "producer.cli", "export", name, "--out", str(out),
                                    "--for", "specforge", "--tokenizer", str(tok), "--truncated", "keep",
                                    "--dest", str(dest)), work, env, cwd=ROOT)
    if export.proc.wait(timeout) != 0:
        raise NotReady(f"export exited {export.proc.returncode} (log {export.log}):\n{export.tail()}")
    rows = [r for r in dest.read_text().splitlines() if r.strip()]
    if not rows:
        raise NotReady(f"the export wrote no row (log {export.log}):\n{export.tail()}")
    merged: dict[str, dict[str, set[str]]] = {}
    for path in traces.values():
        for stage, mods in json.loads(path.read_text()).items():
            for module, functions in mods.items():
                merged.setdefault(stage, {}).setdefault(module, set()).update(functions)
    return {stage: {m: sorted(f) for m, f in sorted(mods.items())} for stage, mods in merged.items()}


def by_stage(ran: dict[str, dict[str, list[str]]]) -> dict[str, list[str]]:
    """Each module under the first stage (in STAGES' order) in which one of its functions ran."""
    placed: set[str] = set()
    out: dict[str, list[str]] = {}
    for stage in STAGES:
        new = sorted(m for m in ran.get(stage, {}) if m not in placed)
        placed.update(new)
        out[stage] = new
    return out


def counted(module: str) -> bool:
    return module.split(".")[0] in COUNTED


def report(ran: dict[str, dict[str, list[str]]], functions: bool) -> str:
    lines = []
    staged = by_stage(ran)
    total = [m for mods in staged.values() for m in mods if counted(m)]
    for stage in STAGES:
        mods = [m for m in staged[stage] if counted(m)]
        lines.append(f"{stage} ({len(mods)} new, {sum(counted(m) for m in ran.get(stage, {}))} ran):")
        for m in mods:
            extra = f"  {', '.join(ran[stage][m])}" if functions else ""
            lines.append(f"  {m}{extra}")
    data = {m for stage, mods in ran.items() if stage != "produce" for m in mods if counted(m)}
    lines.append(f"walk: {len(total)} modules of {', '.join(COUNTED)}; {len(data)} without the produce command's own "
                 f"({len(total) - len(data)}: ran only in the stage produce)")
    others = sorted({m for mods in staged.values() for m in mods if not counted(m)})
    lines.append(f"also ran (not counted): {', '.join(others) or 'nothing'}")
    return "\n".join(lines)


def walk_modules(ran: dict[str, dict[str, list[str]]]) -> set[str]:
    """Every counted module on the walk."""
    return {m for mods in ran.values() for m in mods if counted(m)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "trace":
        out, root, sep, module, *rest = sys.argv[2:]
        assert sep == "--", "python -m bench.walk trace OUT ROOT -- MODULE ARGS..."
        trace(Path(out), None if root == "-" else root, module, rest)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--line", type=json.loads, default=None, help="walk this dataset line (JSON) alone")
    ap.add_argument("--functions", action="store_true", help="list the functions that ran in each module")
    ap.add_argument("--json", type=Path, default=None,
                    help="write line -> stage -> module -> functions here (default, without --line: "
                         "bench/results/walk.json)")
    ap.add_argument("--timeout", type=float, default=180.0)
    args = ap.parse_args()
    from bench.harness import save_results, scratch
    lines = {"given": args.line} if args.line is not None else LINES
    walks = {}
    for name, line in lines.items():
        with scratch("walk") as work:
            walks[name] = measure(work, line, args.timeout)
        print(f"== {name}: {json.dumps(line)}")
        print(report(walks[name], args.functions))
    doc = {"lines": lines, "walks": walks}
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    elif args.line is None:
        print(f"written to {save_results('walk', doc)}")


if __name__ == "__main__":
    main()
