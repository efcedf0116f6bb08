"""What ``produce run`` does with its checked options (producer/settings.py), start to end.

1. Read, validate and render every file (producer/prepare.py), before Redis is touched.
2. ``--dry-run``: plan each dataset (producer/plan.py; ``--pilot`` asks SGLang for real lengths) and stop.
3. Otherwise: check the output folders, Redis and what the workers recorded of their servers (the checks,
   below `run`), attach, say who listens on the queue and how the servers are (producer/ops/status.py),
   run (producer/session/loop.py), then write each dataset's manifest (producer/export/manifest.py).

`launch` returns what the command prints (the plan or the summary table); progress and warnings go to the log as
they happen. Errors are producer/errors.py exceptions, with the exit code the command ends with.

The checks before a run writes anything: the output folders, the Redis it is about to trust with its budget state,
what the workers recorded of their SGLang servers (``bq:server_info``: reasoning parser, context, seed), and the
prompts' ids against the model's vocabulary (budget/serverinfo.py). A queue on an evicting Redis loses jobs and
counters silently under memory pressure; a Redis without AOF loses everything since its last snapshot on a crash
(with AOF everysec, a kill -9 lost nothing acknowledged here). The vocabulary is checked twice (exit 2 on a prompt
id the model cannot take): `check_vocab_offline` right after the inputs are rendered (dry runs too; nothing is
written yet), against the tokenizer directory's config.json; `check_vocab_servers` at attach, after the servers'
context recheck, against the smallest ``vocab_size`` the workers' servers report (bq:server_info), and it puts the
size checked against in the chunks' conversation block so workers check the later turns they render.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import redis

from budget import runtime, serverinfo
from budget.serverinfo import Vocab, check_prompts, config_vocab, servers_vocab, smallest
from producer.errors import ProduceError, UsageError
from producer.prepare import Inputs, Prepared
from producer.settings import Budget, RunSettings, budget_limit, check_max_tokens
from render.modeldir import Context, ModelDirError, resolve_tokenizer, sane_context

if TYPE_CHECKING:
    from budget.runstate import RunState

log = logging.getLogger("budgetq.produce")


def launch(settings: RunSettings, *, warn: Callable[[str], None]) -> str:
    """Prepare the inputs, then plan them (``--dry-run``) or run them; return the text to print."""
    from producer.prepare import load_inputs
    started = time.monotonic()
    inputs = load_inputs(settings, echo=log.info, warn=warn)
    log.debug("read, validated and rendered %d dataset(s) in %.1f s", len(inputs.prepared),
              time.monotonic() - started)
    check_vocab_offline(inputs)  # exit 2 on an id the model cannot take
    budgets = settings.budgets_for(p.name for p in inputs.prepared)
    if settings.dry_run:
        return dry_run(settings, inputs, budgets)
    return run(settings, inputs, budgets, warn=warn)


def dry_run(settings: RunSettings, inputs: Inputs, budgets: dict[str, Budget | None]) -> str:
    """``--dry-run``: each dataset's plan (samples needed, projected tokens, ETA), as a table or JSON. Writes
    nothing; with ``--pilot`` it sends real requests to SGLANG_URL (a failure is exit 1)."""
    from budget.ledger import plan_shares
    from producer.plan import DatasetPlan, PilotResult, plan_dataset, plan_table, run_pilot
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
    from producer.ops.status import length_pictures, summary_table
    from producer.ops.status import preflight as check_workers
    from producer.session.attach import RunOptions, check_out_dir
    from producer.session.loop import JobSettings, Producer
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
    inputs = recheck_context(client, inputs, s.max_tokens, warn=warn)
    check_max_tokens(s.max_tokens, inputs.context)  # the servers' smaller limit: still before anything is written
    check_out_dirs(s.out_dir, names)
    check_redis(client, allow_eviction=s.allow_eviction, require_aof=s.require_aof, warn=warn)
    check_server_parsers(client, inputs.settings.reasoning_parser, warn=warn)
    check_seed(client, params, warn=warn)
    vocab = check_vocab_servers(client, inputs)
    options = RunOptions(out_dir=s.out_dir, budgets=budgets, modes=s.modes_for(names), expect_mean=s.expect_mean,
                         chunk_size=s.chunk_size, queue_depth=s.queue_depth, new_run=s.new_run,
                         job=JobSettings(job_timeout=s.job_timeout), show_progress=s.show_progress,
                         conversation=inputs.conversation(vocab.size if vocab is not None else None),
                         mix=s.given_mix(), mix_pacing=s.mix_pacing, deadline=s.deadline)
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


# -- the checks before a run writes anything (the module's docstring) ----------------------------------------

def connect(redis_url: str) -> "redis.Redis":
    """A client for ``redis_url`` (budget/runtime.py: short explicit timeouts, not redis-py's defaults), pinged
    once so that a wrong URL is one clear error (exit 1) now rather than a traceback later."""
    client = runtime.connect(redis_url)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ProduceError(f"cannot reach Redis at {runtime.redact(redis_url)}: {exc}") from None
    log.debug("connected to Redis at %s", runtime.redact(redis_url), extra={"redis": runtime.redact(redis_url)})
    return client


def check_redis(client: "redis.Redis", *, allow_eviction: bool, require_aof: bool,
                warn: Callable[[str], None]) -> None:
    try:
        config: Any = client.config_get("maxmemory-policy")
        policy = _text(config.get("maxmemory-policy", ""))
        aof = _text(client.config_get("appendonly").get("appendonly", ""))
    except redis.ResponseError as exc:  # an ACL user without CONFIG, or a managed Redis that hides it
        message = f"cannot check Redis persistence and eviction settings ({exc})"
        if require_aof:
            raise ProduceError(message + "; --require-aof needs them") from None
        warn(f"warning: {message}; make sure it runs with appendonly yes and maxmemory-policy noeviction")
        return
    if policy and policy != "noeviction" and not allow_eviction:
        raise ProduceError(f"Redis evicts keys under memory pressure (maxmemory-policy {policy}): queued chunks "
                           "and budget counters could vanish silently. Set maxmemory-policy noeviction, or "
                           "pass --allow-eviction to run anyway.")
    if aof != "yes":
        if require_aof:
            raise ProduceError("Redis runs without AOF (appendonly no): a crash loses every commit since its "
                               "last snapshot. Enable appendonly yes (appendfsync everysec).")
        warn("warning: Redis runs without AOF (appendonly no): a Redis crash loses recent commits from Redis; "
             "the output files keep them and a rerun recounts them, but enable appendonly yes")


def seed_warning(servers: Sequence[Mapping[str, Any]], sampling_params: Mapping[str, Any]) -> str | None:
    """A warning when ``sampling_seed`` is sent to servers that ignore it; None when there is nothing to say.

    SGLang applies the per-request seed only when the server runs with ``--enable-deterministic-inference``
    (sglang/srt/sampling/sampling_batch_info.py), otherwise the seed is accepted and silently unused."""
    seed = sampling_params.get("sampling_seed")
    if seed is None or not servers:
        return None
    if serverinfo.seed_honoured(servers):
        return None
    without = sum(1 for s in servers if s.get("enable_deterministic_inference") is not True)
    return (f"warning: --seed {seed} is sent as sampling_seed, but {without} of the {len(servers)} SGLang servers "
            "the workers recorded do not report running with --enable-deterministic-inference: SGLang ignores "
            "the seed without it, so the run is not reproducible")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def check_out_dirs(out_dir: Path, names: Iterable[str]) -> None:
    """Every dataset's output folder can be created and written, checked before Redis is touched: a run that
    found out only when it opened its files had already taken its collector locks and registered its datasets
    (seen in a container whose ``out/`` belonged to another user: a traceback, and a rerun refused for 30 s).
    Writing a probe file is the honest test; ``os.access`` says yes to root on a read-only mount."""
    for name in sorted(names):
        folder = out_dir / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".budgetq-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise UsageError(f"--out {out_dir}: cannot write {folder} ({exc.strerror or exc}); give an --out "
                             "folder this user can write") from None


def check_server_parsers(client: "redis.Redis", parser: str, *, warn: Callable[[str], None]) -> None:
    """Warn when a worker recorded a server launched with another --reasoning-parser (bq:server_info)."""
    from producer.settings import mismatches
    try:
        servers = serverinfo.load(client)
    except redis.RedisError:
        return  # best effort: the run itself reports Redis trouble
    for message in mismatches(parser, servers):
        warn(message)


#: What a /get_server_info entry says limits one request, in the order they are preferred for messages.
LIMIT_KEYS = ("context_length", "max_total_num_tokens")


def server_context(servers: Sequence[Mapping[str, Any]]) -> Context | None:
    """The smallest per-request limit any recorded server states, and which server and key said it; None when
    none records one (a server that leaves ``context_length`` null)."""
    best: Context | None = None
    for entry in servers:
        for key in LIMIT_KEYS:
            tokens = sane_context(entry.get(key))
            if tokens is None:
                continue
            where = entry.get("url", "?") + (f" on {entry['host']}" if entry.get("host") else "")
            if best is None or tokens < best.tokens:
                best = Context(tokens, f"SGLang server {where}: {key}, recorded by its workers in Redis")
    return best


def apply_server_context(prepared: Sequence[Prepared], limit: Context,
                         max_tokens: int) -> tuple[list[Prepared], dict[str, int]]:
    """Each dataset without the selected samples whose prompt + ``max_tokens`` exceeds ``limit``, which join its
    ``over_context`` problems; and {dataset: samples dropped} (datasets with none left out)."""
    kept: list[Prepared] = []
    dropped: dict[str, int] = {}
    for p in prepared:
        over = [prompt for prompt in p.prompts.values() if prompt.length + max_tokens > limit.tokens]
        if over:
            dropped[p.name] = len(over)
            problems = [prompt.sample.problem(
                f"prompt of {prompt.length} tokens + --max-tokens {max_tokens} exceeds the servers' context of "
                f"{limit.tokens} ({limit.source})") for prompt in over]
            gone = {prompt.sample.id for prompt in over}
            p = replace(p, prompts={pid: prompt for pid, prompt in p.prompts.items() if pid not in gone},
                        over_context=[*p.over_context, *problems])
        kept.append(p)
    return kept, dropped


def recheck_context(client: "redis.Redis", inputs: Inputs, max_tokens: int, *,
                    warn: Callable[[str], None]) -> Inputs:
    """At attach, the SGLang servers' own context limit wins over the offline one the prompts were checked against
    (``--max-context``, the tokenizer, config.json: producer.prepare.choose_context). Returns the inputs as they
    are checked now: their ``context`` is what later turns of a conversation are checked against too.

    SGLang's limit is its own: ``--context-length`` may have lowered it, and a KV cache smaller than the context
    (``max_total_num_tokens``) caps every request too; a prompt over it would be refused (400) or cut short one
    request at a time, after its chunk was queued. So the smallest limit the workers recorded in
    ``bq:server_info`` (a chunk may run on any server) drops the prompts that no longer fit from what will be
    enqueued, counted as "over context" like the ones found offline. A larger one changes nothing (the prompts
    skipped offline were not rendered into the run; ``--max-context`` raises the offline limit)."""
    try:
        servers = serverinfo.load(client)
    except redis.RedisError as exc:
        raise ProduceError(f"Redis error: {exc}") from None
    checked = inputs.context
    limit = server_context(servers)
    if limit is None:
        log.info("no worker recorded its SGLang servers' context length in Redis: prompts stay checked "
                 f"against {checked.tokens:,} ({checked.source})")
        return inputs
    if limit.tokens >= checked.tokens:
        log.info(f"the SGLang servers' context is {limit.tokens:,} ({limit.source}): every prompt checked against "
                 f"{checked.tokens:,} ({checked.source}) fits")
        return inputs
    kept, dropped = apply_server_context(inputs.prepared, limit, max_tokens)
    for name, n in sorted(dropped.items()):
        warn(f"warning: {name}: {n:,} samples skipped, not enqueued: prompt + --max-tokens {max_tokens:,} exceeds "
             f"the SGLang servers' context of {limit.tokens:,} ({limit.source}), which is below the "
             f"{checked.tokens:,} they were checked against ({checked.source})")
    if not dropped:
        log.info(f"the SGLang servers' context is {limit.tokens:,} ({limit.source}): every selected prompt fits")
    return replace(inputs, prepared=kept, context=limit)


def check_seed(client: "redis.Redis", sampling_params: Mapping[str, Any], *, warn: Callable[[str], None],
               servers: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Warn when --seed is given and no server the workers recorded (or ``servers``) honours it. Before any worker
    has recorded its servers there is nothing to check: the end of the run checks again."""
    if sampling_params.get("sampling_seed") is None:
        return
    try:
        entries = servers if servers is not None else serverinfo.load(client)
    except redis.RedisError:
        return
    message = seed_warning(entries, sampling_params)
    if message:
        warn(message)
    elif not entries:
        log.info("--seed: no worker has recorded its SGLang servers yet; whether they honour the seed is checked "
                 "at the end of the run (manifest: sampling_seed_honoured)")


def _tokenizer_vocab(tokenizer: str) -> Vocab | None:
    try:
        return config_vocab(resolve_tokenizer(tokenizer))
    except ModelDirError:
        return None


def _check(inputs: Inputs, vocab: Vocab | None) -> None:
    message = check_prompts(((p.name, [{pid if not variant else f"{pid} ({variant})": ids
                                         for pid, prompt in p.prompts.items()
                                         for variant, (ids, _opens) in prompt.renderings.items()}])
                             for p in inputs.prepared), vocab)
    if message is not None:
        raise UsageError(message)


def check_vocab_offline(inputs: Inputs) -> None:
    """Every rendered prompt against config.json's ``vocab_size`` (when the tokenizer directory has one)."""
    _check(inputs, _tokenizer_vocab(inputs.settings.tokenizer))


def check_vocab_servers(client: "redis.Redis", inputs: Inputs) -> Vocab | None:
    """At attach: the prompts against a smaller ``vocab_size`` the servers report, if any (best effort: none
    recorded, or Redis unreadable, changes nothing). Returns the vocabulary in force (None: none known), which
    the conversation block carries."""
    try:
        servers = serverinfo.load(client)
    except Exception:  # noqa: BLE001 - the run itself reports Redis trouble
        servers = []
    offline = _tokenizer_vocab(inputs.settings.tokenizer)
    vocab = smallest(offline, servers_vocab(servers))
    if vocab is not None and vocab != offline:
        _check(inputs, vocab)
    return vocab
