"""What ``produce run`` does with its checked options (producer/settings.py), start to end.

1. Read, validate and render every file (producer/prepare.py), before Redis is touched.
2. ``--dry-run``: plan each dataset (producer/plan.py; ``--pilot`` asks SGLang for real lengths) and stop.
3. Otherwise: check the output folders, Redis and what the workers recorded of their servers
   (producer/preflight.py), attach, say who listens on the queue and how the servers are (producer/ops/servers.py),
   run (producer/session/loop.py), then write each dataset's manifest (producer/export/manifest.py).

`launch` returns what the command prints (the plan or the summary table); progress and warnings go to the log as
they happen. Errors are producer/errors.py exceptions, with the exit code the command ends with.
"""
from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import redis

from producer.errors import ProduceError
from producer.prepare import Inputs
from producer.settings import Budget, RunSettings, budget_limit, check_max_tokens

if TYPE_CHECKING:
    from budget.runstate import RunState

log = logging.getLogger("budgetq.produce")


def launch(settings: RunSettings, *, warn: Callable[[str], None]) -> str:
    """Prepare the inputs, then plan them (``--dry-run``) or run them; return the text to print."""
    from producer.preflight import check_vocab_offline
    from producer.prepare import load_inputs
    started = time.monotonic()
    inputs = load_inputs(settings, echo=log.info, warn=warn)
    log.debug("read, validated and rendered %d dataset(s) in %.1f s", len(inputs.prepared),
              time.monotonic() - started)
    check_vocab_offline(inputs, settings.tokenizer)  # exit 2 on an id the model cannot take
    budgets = settings.budgets_for(p.name for p in inputs.prepared)
    if settings.dry_run:
        return dry_run(settings, inputs, budgets)
    return run(settings, inputs, budgets, warn=warn)


def dry_run(settings: RunSettings, inputs: Inputs, budgets: dict[str, Budget | None]) -> str:
    """``--dry-run``: each dataset's plan (samples needed, projected tokens, ETA), as a table or JSON. Writes
    nothing; with ``--pilot`` it sends real requests to SGLANG_URL (a failure is exit 1)."""
    from budget.mix import plan_shares
    from producer.plan import DatasetPlan, PilotResult, plan_dataset, plan_table, run_pilot
    from producer.prepare import Prepared
    s = settings
    mix = s.template_mix.describe() if s.template_mix else ""
    described = "; ".join(d for d in (inputs.settings.generations.describe(), mix) if d)
    measured: dict[str, PilotResult | None] = {}
    for p in inputs.prepared:
        measured[p.name] = None
        if s.pilot:
            try:
                measured[p.name] = run_pilot(p, s.pilot, urls=s.pilot_urls, sampling_params=p.settings.chunk_params,
                                             api_key=s.api_key)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ProduceError(f"--pilot: {exc}") from None

    def plan(p: Prepared, budget: int | None) -> DatasetPlan:
        m = measured[p.name]
        return plan_dataset(p, budget=budget, out_dir=s.out_dir, expect_mean=s.expect_mean,
                            pilot_mean=m.mean if m else None, pilot_n=len(m.lengths) if m else 0,
                            throughput=s.throughput, in_flight=s.in_flight, settings_mix=described, pilot=m)

    shared, limits = s.given_mix(), {p.name: budget_limit(budgets.get(p.name)) for p in inputs.prepared}
    if shared is not None:
        # What each member can make at most (every prompt; None: unknown mean) decides who runs dry in the plan.
        capacity = {p.name: plan(p, None).projected_tokens for p in inputs.prepared}
        shared = plan_shares(shared.total, shared.weights, capacity)
        limits.update(shared.shares())
    plans = [plan(p, limits[p.name]) for p in inputs.prepared]
    if s.as_json:
        context = {"tokens": inputs.context.tokens, "source": inputs.context.source}
        doc: dict[str, Any] = {"datasets": [x.as_dict() for x in plans], "throughput": s.throughput,
                               "context": context}
        if shared is not None:
            doc["mix"] = {"total": shared.total, "weights": {n: str(w) for n, w in shared.weights.items()},
                          "shares": shared.shares(), "runs_dry": sorted(shared.dry)}
        return json.dumps(doc, indent=2)
    table = plan_table(plans, s.throughput, inputs.context)
    return table + (f"\n{shared.describe().replace('ran dry', 'runs dry')}" if shared is not None else "")


def deadline_passed(store: "RunState", names: set[str], now: float) -> str:
    """A rerun without --deadline/--for of a run whose stored deadline passed: the line saying so (it exits 0,
    sending nothing); '' when no dataset's deadline passed. Read-only."""
    passed = {}
    for name in sorted(names):
        raw = store.field(name, "deadline")
        if raw and int(raw) / 1000 <= now:
            passed[name] = int(raw) / 1000
    if not passed:
        return ""
    when = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(max(passed.values())))
    return (f"the run's deadline ({when}) passed for {', '.join(passed)}: nothing was sent. Give a new --deadline or "
            "--for to go on.")


def run(settings: RunSettings, inputs: Inputs, budgets: dict[str, Budget | None], *,
        warn: Callable[[str], None]) -> str:
    """Check, attach and run (or enqueue and detach); write the manifests of a run that ended; return the
    summary table (or, for a rerun after its deadline, the line saying nothing was sent)."""
    from budget.runstate import RunState
    from producer.export.manifest import write_run_manifests
    from producer.ops.servers import preflight as check_workers
    from producer.preflight import (
        check_out_dirs,
        check_redis,
        check_seed,
        check_server_parsers,
        check_vocab_servers,
        connect,
        recheck_context,
    )
    from producer.session.attach import RunOptions, check_out_dir
    from producer.session.enqueue import JobSettings
    from producer.session.loop import Producer
    from producer.session.report import length_pictures, summary_table
    s = settings
    names = set(budgets)
    params = inputs.settings.chunk_params
    log.debug("run settings: out %s, chunk size %d, queue depth %d, job timeout %d s, %s", s.out_dir, s.chunk_size,
              s.queue_depth, s.job_timeout, "detach" if s.detach else "attached",
              extra={"budgets": budgets, "modes": s.modes_for(names), "sampling_params": params})
    client = connect(s.redis_url)
    if not s.new_run:  # before check_out_dirs creates this --out's folders: a refused rerun writes nothing
        check_out_dir(RunState(client), names, s.out_dir)
        if s.deadline is None:
            passed = deadline_passed(RunState(client), names, time.time())
            if passed:
                return passed
    context = recheck_context(client, inputs, s.max_tokens, warn=warn)
    check_max_tokens(s.max_tokens, context)  # the servers' smaller limit: still before anything is written
    check_out_dirs(s.out_dir, names)
    check_redis(client, allow_eviction=s.allow_eviction, require_aof=s.require_aof, warn=warn)
    check_server_parsers(client, inputs.settings.reasoning_parser, warn=warn)
    check_seed(client, params, warn=warn)
    options = RunOptions(out_dir=s.out_dir, budgets=budgets, modes=s.modes_for(names), expect_mean=s.expect_mean,
                         chunk_size=s.chunk_size, queue_depth=s.queue_depth, new_run=s.new_run,
                         job=JobSettings(job_timeout=s.job_timeout), show_progress=s.show_progress,
                         conversation=inputs.conversation(context), tokenizer=s.tokenizer, chat_template=s.chat_template,
                         variants=inputs.variants,
                         mix=s.given_mix(), mix_pacing=s.mix_pacing, deadline=s.deadline)
    check_vocab_servers(client, inputs, s.tokenizer, options.conversation)  # sets vocab_size
    producer = Producer(client, inputs.prepared, options, echo=log.info)
    try:
        producer.attach()  # enqueues nothing yet
        # who listens on the queue, how the servers are: warnings only, and only with work to wait for them
        check_workers(client, echo=log.info, warn=warn, to_enqueue=producer.to_enqueue())
        summaries = producer.run(detach=s.detach)
    except redis.RedisError as exc:
        raise ProduceError(f"Redis error: {exc}") from None
    if s.detach:
        return summary_table(summaries, detached=True)
    servers = write_run_manifests(client, s.out_dir, [x.name for x in summaries], warn=warn)
    if servers:
        check_seed(client, params, warn=warn, servers=servers)
    return summary_table(summaries) + "\n\n" + length_pictures(summaries)
