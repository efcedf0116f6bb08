"""What ``produce run`` does with its checked options (producer/settings.py), start to end.

1. Read, validate and render every file (producer/prepare.py), before Redis is touched.
2. ``--dry-run``: plan each dataset (producer/plan.py; ``--pilot`` asks SGLang for real lengths) and stop.
3. Otherwise: check the output folders, Redis and what the workers recorded of their servers
   (producer/preflight.py), attach and run (producer/run.py), then write each dataset's manifest
   (producer/manifest.py).

`launch` returns what the command prints (the plan or the summary table); progress and warnings go to the log as
they happen. Errors are producer/errors.py exceptions, with the exit code the command ends with.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Callable

import redis

from producer.errors import ProduceError
from producer.generations import Generations
from producer.prepare import Inputs
from producer.settings import RunSettings

log = logging.getLogger("budgetq.produce")


def launch(settings: RunSettings, *, warn: Callable[[str], None]) -> str:
    """Prepare the inputs, then plan them (``--dry-run``) or run them; return the text to print."""
    inputs, generations = prepare(settings, warn=warn)
    budgets = settings.budgets_for(p.name for p in inputs.prepared)
    if settings.dry_run:
        return dry_run(settings, inputs, budgets, generations)
    return run(settings, inputs, budgets, generations, warn=warn)


def prepare(settings: RunSettings, *, warn: Callable[[str], None]) -> tuple[Inputs, Generations]:
    """Read, validate and render the files with the run's settings; the sampling parameters completed with what
    the reasoning parser needs, and the generations' split of them (producer/generations.py)."""
    from producer.order import choose as choose_order
    from producer.output import RUN
    from producer.parsers import skip_special_tokens_default
    from producer.prepare import load_inputs
    from producer.runjson import ALL, choose_turns
    from producer.vocab import check_offline as check_vocab_offline
    s = settings
    started = time.monotonic()
    inputs = load_inputs(s.files, tokenizer=s.tokenizer, max_tokens=s.max_tokens, max_context=s.max_context,
                         max_samples=s.max_samples, sampling_params=s.sampling_params(),
                         chat_template_kwargs=dict(s.chat_template_kwargs), skip_invalid=s.skip_invalid,
                         echo=log.info, mapping=s.mapping, show_progress=s.show_progress, warn=warn,
                         reasoning_parser=s.reasoning_parser, order=s.order,
                         order_for=lambda name, o: choose_order(o, s.out_dir / name / RUN, s.new_run),
                         turns=s.turns or ALL,
                         turns_for=lambda name, t: choose_turns(t, s.turns is not None, s.out_dir / name / RUN,
                                                                s.new_run),
                         mix=s.template_mix, generations=s.generations)
    log.debug("read, validated and rendered %d dataset(s) in %.1f s", len(inputs.prepared),
              time.monotonic() - started)
    check_vocab_offline(inputs, s.tokenizer)  # producer/vocab.py: exit 2 on an id the model cannot take
    # Known once the template is read (the parser is detected from it); stored with the run like every parameter.
    parser = inputs.settings.get("reasoning_parser")
    inputs.sampling_params["skip_special_tokens"] = (s.skip_special_tokens if s.skip_special_tokens is not None
                                                     else skip_special_tokens_default(parser))
    return inputs, inputs.set_generations(s.generations)


def dry_run(settings: RunSettings, inputs: Inputs, budgets: dict[str, int | None], generations: Generations) -> str:
    """``--dry-run``: each dataset's plan (samples needed, projected tokens, ETA), as a table or JSON. Writes
    nothing; with ``--pilot`` it sends real requests to SGLANG_URL (a failure is exit 1)."""
    from producer.plan import pilot_mean, plan_dataset, plan_table
    s = settings
    mix = s.template_mix.describe() if s.template_mix else ""
    described = "; ".join(d for d in (generations.describe(), mix) if d)
    plans = []
    for p in inputs.prepared:
        measured = None
        if s.pilot:
            try:
                measured = pilot_mean(p, s.pilot, urls=s.pilot_urls, sampling_params=inputs.sampling_params,
                                      api_key=s.api_key)
            except (OSError, RuntimeError, ValueError) as exc:
                raise ProduceError(f"--pilot: {exc}") from None
        plans.append(plan_dataset(p, budget=budgets.get(p.name), out_dir=s.out_dir, expect_mean=s.expect_mean,
                                  pilot_mean=measured, pilot_n=s.pilot or 0, throughput=s.throughput,
                                  in_flight=s.in_flight, settings_mix=described))
    if s.as_json:
        context = {"tokens": inputs.context.tokens, "source": inputs.context.source}
        return json.dumps({"datasets": [x.as_dict() for x in plans], "throughput": s.throughput,
                           "context": context}, indent=2)
    return plan_table(plans, s.throughput, inputs.context)


def run(settings: RunSettings, inputs: Inputs, budgets: dict[str, int | None], generations: Generations, *,
        warn: Callable[[str], None]) -> str:
    """Check, attach and run (or enqueue and detach); write the manifests of a run that ended; return the
    summary table."""
    from producer.enqueue import JobSettings
    from producer.manifest import write_run_manifests
    from producer.preflight import (check_out_dirs, check_redis, check_seed, check_server_parsers, connect,
                                    recheck_context)
    from producer.report import summary_table
    from producer.vocab import check_servers as check_vocab_servers
    from producer.datasetrun import RunOptions
    from producer.run import Producer
    s = settings
    names = set(budgets)
    think = inputs.renderer.think
    options = RunOptions(out_dir=s.out_dir, budgets=budgets, sampling_params=inputs.sampling_params,
                         settings=inputs.settings, think={"start": think.start, "end": think.end} if think else None,
                         reasoning_parser=inputs.reasoning_parser, parser_explicit=inputs.parser_explicit,
                         order_explicit=s.order_explicit, turns_explicit=s.turns is not None, tokenizer=s.tokenizer,
                         modes=s.modes_for(names), expect_mean=s.expect_mean, chunk_size=s.chunk_size,
                         queue_depth=s.queue_depth, new_run=s.new_run, job=JobSettings(job_timeout=s.job_timeout),
                         show_progress=s.show_progress, generations=generations, variants=inputs.variants)
    log.debug("run settings: out %s, chunk size %d, queue depth %d, job timeout %d s, %s", s.out_dir, s.chunk_size,
              s.queue_depth, s.job_timeout, "detach" if s.detach else "attached",
              extra={"budgets": budgets, "modes": options.modes, "sampling_params": inputs.sampling_params})
    check_out_dirs(s.out_dir, names)
    client = connect(s.redis_url)
    check_redis(client, allow_eviction=s.allow_eviction, require_aof=s.require_aof, warn=warn)
    check_server_parsers(client, inputs.reasoning_parser, warn=warn)
    recheck_context(client, inputs, s.max_tokens, warn=warn)
    options.conversation = inputs.conversation()  # after the recheck: the context turn 0 was checked against
    check_vocab_servers(client, inputs, s.tokenizer, options.conversation)  # producer/vocab.py; sets vocab_size
    check_seed(client, inputs.sampling_params, warn=warn)
    producer = Producer(client, inputs.prepared, options, echo=log.info)
    try:
        producer.attach()
        summaries = producer.run(detach=s.detach)
    except redis.RedisError as exc:
        raise ProduceError(f"Redis error: {exc}") from None
    if not s.detach:
        servers = write_run_manifests(client, s.out_dir, [x.name for x in summaries], warn=warn)
        if servers:
            check_seed(client, inputs.sampling_params, warn=warn, servers=servers)
    return summary_table(summaries, detached=s.detach)
