"""``produce``: the command people type. Thin: parse and check options, then call the library.

Exit codes: 0 done (or detached on purpose), 1 runtime error (Redis unreachable, dataset already attached
elsewhere), 2 usage or input error (nothing written to Redis), 130 Ctrl-C (the run goes on in the workers).
Every option can also be set by an environment variable (shown in --help); REDIS_URL is read as is.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import click
import redis

from budget import connection, logs
from budget.payload import REASONING_PARSERS
from producer.amount import parse_amount, parse_budget_option
from producer.errors import ProduceError
from producer.order import DEFAULT_SEED, ORDERS

F = TypeVar("F", bound=Callable[..., Any])

#: produce's progress and event messages: stderr, one line each, text (as always) or JSON (--log-format).
log = logging.getLogger("budgetq.produce")
_LOG = {"json": False}  # errors go through the log too while JSON is on

EXAMPLE = """\b
Example:
  produce data/B1_glaive.jsonl data/B2_code.jsonl --tokenizer ./tok \\
      --budget 10M --max-tokens 16384 --out out/
"""


class _Problem(click.ClickException):
    def show(self, file: Any = None) -> None:
        if _LOG["json"]:
            log.error(self.format_message(), extra={"exit_code": self.exit_code})
        else:
            super().show(file)


class InputProblem(_Problem):
    """Bad input or options: exit 2, a clear message, no traceback, nothing written to Redis."""

    exit_code = 2


class RuntimeProblem(_Problem):
    exit_code = 1


def _problem(exc: ProduceError) -> click.ClickException:
    return (InputProblem if exc.exit_code == 2 else RuntimeProblem)(str(exc))


class DefaultGroup(click.Group):
    """A group whose default command is ``run``: ``produce FILE...`` means ``produce run FILE...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


def opt(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option whose environment variable is BUDGETQ_<NAME>, shown in --help."""
    name = max((d for d in decls if d.startswith("--")), key=len).lstrip("-").split("/")[0]
    kwargs.setdefault("envvar", "BUDGETQ_" + name.upper().replace("-", "_"))
    kwargs.setdefault("show_envvar", True)
    return click.option(*decls, **kwargs)


def log_options(f: F) -> F:
    """--verbose and --log-format, for the commands that report progress on stderr."""
    f = opt("--log-format", type=click.Choice(logs.FORMATS), default="text", show_default=True,
            help="Progress and event messages on stderr: text, or one JSON object per line (ts, level, logger, "
                 "msg and the event's fields).")(f)
    return opt("--verbose", "-v", is_flag=True, help="Also print debug messages.")(f)


def _setup_logging(log_format: str, verbose: bool = False, quiet: bool = False) -> None:
    if verbose and quiet:
        raise InputProblem("--verbose and --quiet exclude each other")
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logs.configure("budgetq", fmt=log_format, level=level)
    _LOG["json"] = log_format == "json"


def _warn(message: str) -> None:
    """A warning of the library (worded "warning: ..." for text): the level says it in JSON."""
    log.warning(message.removeprefix("warning: ") if _LOG["json"] else message)


redis_url_option = click.option(
    "--redis-url", envvar="REDIS_URL", show_envvar=True, default="redis://127.0.0.1:6379/0", show_default=True,
    help="Redis holding the queue and the budget state.")


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]},
             help="Regenerate training data under a token budget per dataset. The default command is run: "
                  "'produce FILES...' means 'produce run FILES...'.\n\n" + EXAMPLE)
@click.version_option(package_name="budgetq")
def main() -> None:
    _LOG["json"] = False  # set again by the commands that configure logging


def _sampling_params(max_tokens: int, temperature: list[float] | None, top_p: float | None, top_k: int | None,
                     seed: int | None) -> dict[str, Any]:
    """The run's sampling parameters (run.json ``sampling_params``): a --temperature list stays a list (generation
    k takes entry k mod len: producer/generations.py); one value is a number, as it always was."""
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    if temperature is not None:
        params["temperature"] = temperature[0] if len(temperature) == 1 else list(temperature)
    if top_p is not None:
        params["top_p"] = top_p
    if top_k is not None:
        params["top_k"] = top_k
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def parse_mode_option(values: tuple[str, ...]) -> tuple[str | None, dict[str, str]]:
    """--budget-mode MODE (all datasets) or NAME=MODE (one), like --budget."""
    from budget.ledger import MODES
    default: str | None = None
    named: dict[str, str] = {}
    for value in values:
        name, sep, mode = value.rpartition("=")
        if mode not in MODES:
            raise ValueError(f'invalid --budget-mode "{value}": expected one of {", ".join(MODES)} or NAME=MODE')
        if sep:
            named[name] = mode
        elif default is None:
            default = mode
        else:
            raise ValueError("--budget-mode without a dataset name given twice")
    return default, named


def _connect(redis_url: str) -> "redis.Redis":
    client = connection.connect(redis_url)  # explicit short timeouts and retry, not redis-py's defaults
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RuntimeProblem(f"cannot reach Redis at {logs.redact(redis_url)}: {exc}") from None
    log.debug("connected to Redis at %s", logs.redact(redis_url), extra={"redis": logs.redact(redis_url)})
    return client


@main.command("run", help="Validate, render and enqueue FILES, then stay attached until the run ends.\n\n"
              + EXAMPLE)
@click.argument("files", nargs=-1, required=True)
@opt("--tokenizer", required=True,
     help="The model's directory (its tokenizer with the chat template, and config.json), or a hub id "
          "(Qwen/Qwen3-8B) found in the local Hugging Face cache; nothing is downloaded.")
@opt("--budget", "budgets", multiple=True, metavar="AMOUNT|NAME=AMOUNT",
     help="Completion tokens per dataset (10M, 500k, 1.5G); NAME=AMOUNT for one dataset. "
          "Default: unlimited on a first run, the stored budget on a rerun.")
@opt("--budget-mode", "modes", multiple=True, metavar="MODE|NAME=MODE",
     help="How a dataset lands on its budget: predict (default: reserve each running request's expected "
          "length), strict (reserve --max-tokens: never above the budget), drain (stop at the budget, let "
          "in-flight requests finish). Stored per dataset; a rerun keeps it.")
@opt("--max-tokens", type=click.IntRange(1), required=True,
     help="max_new_tokens per request (required: SGLang's default of 128 truncates silently).")
@opt("--max-context", type=click.IntRange(1), default=None,
     help="Context length; prompts whose length + --max-tokens exceed it are skipped. Default: the "
          "tokenizer's model_max_length when set, else config.json's max_position_embeddings (text_config's for "
          "multimodal models). At attach, a smaller limit the workers recorded for their servers wins.")
@opt("--max-samples", type=click.IntRange(0), default=None,
     help="Also cap each dataset at N prompts: the first N valid ones in --order (random by default, so a "
          "seeded random N, no longer the file's first N).")
@opt("--order", type=click.Choice(ORDERS), default=None,
     help="Order each dataset's prompts are sent in, so what a budget or --max-samples keeps: random (default; "
          "seeded, a function of the ids and --order-seed only) or file. Stored with the run; a run stored "
          "before it resumes in file order.")
@opt("--order-seed", type=int, default=None, metavar="N",
     help=f"Seed of --order random (default {DEFAULT_SEED}). Stored with the run.")
@opt("--turns", type=click.Choice(("all", "last")), default=None,
     help="Which assistant turns of a conversation are regenerated: all (default: each user turn in order, on "
          "the model's own earlier answers) or last (only the answer to the last user turn, on the dataset's "
          "history). Stored with the run; a run stored before it resumes as last.")
@opt("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("out"), show_default=True,
     help="Output directory: OUT/<dataset>/raw_responses.jsonl.")
@redis_url_option
@opt("--temperature", default=None, metavar="T[,T...]",
     help="Sampling temperature (>= 0). A comma-separated list (0,0.6,1.0) goes with --generations: generation k "
          "uses entry k mod the list's length. Default: not sent (SGLang's default).")
@opt("--generations", type=click.IntRange(1), default=1, show_default=True, metavar="N",
     help="Samples of each prompt. Sent in rounds: every prompt's generation 0 in --order, then generation 1, ...; "
          "so a budget keeps as many distinct prompts as it can. Raising N on a rerun extends the run; lowering it "
          "is a settings change. Records keep the prompt's id and say their generation.")
@opt("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None,
     help="Nucleus sampling p, in (0, 1]. Default: not sent.")
@opt("--top-k", type=int, default=None, help="Top-k: -1 (off) or >= 1. Default: not sent.")
@opt("--seed", type=int, default=None,
     help="Sampling seed, sent to SGLang as sampling_seed (honoured only by servers started with "
          "--enable-deterministic-inference: produce warns otherwise).")
@opt("--skip-special-tokens/--no-skip-special-tokens", "skip_special_tokens", default=None,
     help="Sent as skip_special_tokens: whether special tokens are left out of the text SGLang returns. Default: "
          "what the run's reasoning parser needs (false for gpt-oss, whose channels are special tokens).")
@opt("--chat-template-kwargs", default=None, metavar="JSON",
     help='Extra chat template arguments, e.g. \'{"enable_thinking": true}\'.')
@opt("--template-kwargs-mix", default=None, metavar="KEY=V:W,V:W[;KEY=...]",
     help="A chat template argument drawn per sample with these weights, e.g. "
          "'reasoning_effort=low:4,medium:4,high:2' (values read as JSON when they are: true, 0.5). The draw is a "
          "keyed hash of (key, id, generation) with --order-seed, so reruns draw the same; merged over "
          "--chat-template-kwargs for every turn; each record says what it drew. Stored with the run.")
@opt("--reasoning-parser", type=click.Choice(("auto", *REASONING_PARSERS)), default="auto", show_default=True,
     help="How workers split responses into reasoning, answer and tool calls: SGLang's parser name (what the "
          "server is launched with); auto detects it from the tokenizer and refuses when that is ambiguous.")
@opt("--skip-invalid", is_flag=True, help="Skip and report bad lines instead of refusing the file.")
@opt("--messages-field", default="messages", show_default=True, help="Field holding OpenAI-style messages.")
@opt("--prompt-field", default="prompt", show_default=True, help="Field holding a single user prompt.")
@opt("--conversations-field", default="conversations", show_default=True,
     help="Field holding ShareGPT conversations.")
@opt("--id-field", default="id", show_default=True, help="Field holding the sample id.")
@opt("--system-prompt", default=None, help="System turn added to conversations that have none.")
@opt("--expect-mean", type=click.FloatRange(1), default=None,
     help="Expected completion length before results arrive (predict's prior; --dry-run's estimate).")
@opt("--dry-run", is_flag=True, help="Plan only: validate, render, estimate cost and time; write nothing.")
@opt("--pilot", type=click.IntRange(1), default=None, metavar="N",
     help="With --dry-run: send N real requests per dataset to SGLANG_URL to measure completion length.")
@opt("--throughput", type=click.FloatRange(0, min_open=True), default=None, metavar="TOK/S",
     help="With --dry-run: completion tokens per second of the deployment, for the ETA.")
@opt("--in-flight", type=click.IntRange(1), default=None, metavar="N",
     help="With --dry-run and multi-turn conversations: requests the deployment runs at once (workers x "
          "BUDGETQ_CONCURRENCY, default 64), for the ETA: a conversation's turns run one after another.")
@opt("--json", "as_json", is_flag=True, envvar="BUDGETQ_PLAN_JSON", help="With --dry-run: print the plan as JSON.")
@opt("--chunk-size", type=click.IntRange(1, 10_000), default=256, show_default=True, help="Samples per RQ job.")
@opt("--queue-depth", type=click.IntRange(1), default=16, show_default=True,
     help="Chunks kept queued per dataset while attached.")
@opt("--new-run", is_flag=True,
     help="Start these datasets over (old output is moved to OUT/<dataset>.previous-<time>).")
@opt("--detach", is_flag=True, help="Enqueue what the budget needs, then exit 0 without collecting.")
@opt("--job-timeout", type=click.IntRange(60), default=6 * 3600, show_default=True,
     help="RQ job timeout of one chunk, in seconds.")
@opt("--allow-eviction", is_flag=True,
     help="Run even though Redis may evict keys (maxmemory-policy other than noeviction): not recommended.")
@opt("--require-aof", is_flag=True, help="Refuse a Redis without AOF persistence instead of warning.")
@opt("--quiet", "-q", is_flag=True, help="Print only errors, warnings and the summary.")
@log_options
def run_cmd(**options: Any) -> None:
    _setup_logging(options["log_format"], options["verbose"], options["quiet"])
    try:
        _run(**options)
    except ProduceError as exc:
        raise _problem(exc) from None
    except KeyboardInterrupt:
        # Before attach nothing was written; after it the run goes on in the workers. Either way: detach.
        if not _LOG["json"]:
            click.echo("", err=True)
        log.warning("detached: the workers go on; run the same command again to resume and collect.")
        sys.exit(130)


def _run(files: tuple[str, ...], tokenizer: str, budgets: tuple[str, ...], modes: tuple[str, ...],
         max_tokens: int, max_context: int | None, max_samples: int | None, order: str | None,
         order_seed: int | None, turns: str | None, out_dir: Path, redis_url: str,
         temperature: str | None, generations: int, top_p: float | None, top_k: int | None, seed: int | None,
         skip_special_tokens: bool | None, chat_template_kwargs: str | None, template_kwargs_mix: str | None,
         reasoning_parser: str,
         skip_invalid: bool, messages_field: str, prompt_field: str,
         conversations_field: str, id_field: str, system_prompt: str | None, expect_mean: float | None, dry_run: bool,
         pilot: int | None, throughput: float | None, in_flight: int | None, as_json: bool, chunk_size: int,
         queue_depth: int,
         new_run: bool, detach: bool, job_timeout: int, allow_eviction: bool, require_aof: bool,
         quiet: bool, verbose: bool, log_format: str) -> None:
    # Everything that can be wrong with the options and the input is found before Redis is touched.
    try:
        default_budget, named = parse_budget_option(budgets)
        default_mode, named_modes = parse_mode_option(modes)
    except ValueError as exc:
        raise InputProblem(str(exc)) from None
    if top_k is not None and top_k != -1 and top_k < 1:
        raise InputProblem("--top-k must be -1 or at least 1")
    from producer.generations import parse_temperatures
    temperatures: list[float] | None = None
    if temperature is not None:
        try:
            temperatures = parse_temperatures(temperature)
        except ValueError as exc:
            raise InputProblem(f"--temperature: {exc}") from None
        if len(temperatures) > 1 and generations == 1:
            raise InputProblem(f"--temperature {temperature}: a list goes with --generations N > 1 (generation k "
                               "uses entry k mod its length; one generation would use the first only)")
    if (pilot or throughput or in_flight or as_json) and not dry_run:
        raise InputProblem("--pilot, --throughput, --in-flight and --json go with --dry-run")
    kwargs: dict[str, Any] = {}
    if chat_template_kwargs:
        try:
            kwargs = json.loads(chat_template_kwargs)
        except ValueError as exc:
            raise InputProblem(f"--chat-template-kwargs: not valid JSON ({exc})") from None
        if not isinstance(kwargs, dict):
            raise InputProblem("--chat-template-kwargs: expected a JSON object")
    echo: Callable[[str], None] = log.info
    from producer.records import FieldMapping
    try:
        mapping = FieldMapping(messages_field=messages_field, prompt_field=prompt_field,
                               conversations_field=conversations_field, id_field=id_field,
                               system_prompt=system_prompt)
    except ValueError as exc:
        raise InputProblem(str(exc)) from None

    from producer.order import RANDOM, Order, choose as choose_order
    from producer.output import RUN
    from producer.prepare import ALL, choose_turns, load_inputs
    if order == "file" and order_seed is not None:
        raise InputProblem("--order-seed goes with --order random")
    requested_order = Order(order or RANDOM, DEFAULT_SEED if order_seed is None else order_seed)
    from producer.templatemix import MixError, TemplateMix
    template_mix: TemplateMix | None = None
    if template_kwargs_mix is not None:
        try:
            template_mix = TemplateMix.parse(template_kwargs_mix, requested_order.seed)
        except MixError as exc:
            raise InputProblem(f"--template-kwargs-mix: {exc}") from None
    started = time.monotonic()
    # Bars for validating, rendering and (with --detach) enqueueing: for a person at a terminal, never in JSON logs.
    show_progress = not quiet and log_format == "text" and sys.stderr.isatty()
    inputs = load_inputs(files, tokenizer=tokenizer, max_tokens=max_tokens, max_context=max_context,
                         max_samples=max_samples, sampling_params=_sampling_params(max_tokens, temperatures, top_p,
                                                                                   top_k, seed),
                         chat_template_kwargs=kwargs, skip_invalid=skip_invalid, echo=echo, mapping=mapping,
                         show_progress=show_progress,
                         warn=_warn, reasoning_parser=reasoning_parser, order=requested_order,
                         order_for=lambda name, o: choose_order(o, out_dir / name / RUN, new_run),
                         turns=turns or ALL,
                         turns_for=lambda name, t: choose_turns(t, turns is not None, out_dir / name / RUN, new_run),
                         mix=template_mix, generations=generations)
    log.debug("read, validated and rendered %d dataset(s) in %.1f s", len(inputs.prepared),
              time.monotonic() - started)
    # Known once the template is read (the parser is detected from it); stored with the run like every parameter.
    parser = inputs.settings.get("reasoning_parser")
    inputs.sampling_params["skip_special_tokens"] = (skip_special_tokens if skip_special_tokens is not None
                                                     else skip_special_tokens_default(parser))
    mix = inputs.set_generations(generations)
    names = {p.name for p in inputs.prepared}
    unknown = sorted((set(named) | set(named_modes)) - names)
    if unknown:
        raise InputProblem(f"--budget/--budget-mode name unknown dataset(s): {', '.join(unknown)} (datasets: "
                           f"{', '.join(sorted(names))})")
    per_dataset: dict[str, int | None] = {n: named.get(n, default_budget) for n in names}

    if dry_run:
        described = "; ".join(d for d in (mix.describe(), template_mix.describe() if template_mix else "") if d)
        _dry_run(inputs, per_dataset, out_dir, expect_mean, pilot, throughput, as_json, in_flight, described)
        return

    from producer.datasetrun import RunOptions
    from producer.enqueue import JobSettings
    from producer.report import summary_table
    from producer.run import Producer

    think = inputs.renderer.think
    options = RunOptions(out_dir=out_dir, budgets=per_dataset, sampling_params=inputs.sampling_params,
                         settings=inputs.settings, think={"start": think.start, "end": think.end} if think else None,
                         reasoning_parser=inputs.reasoning_parser, parser_explicit=inputs.parser_explicit,
                         order_explicit=order is not None or order_seed is not None,
                         turns_explicit=turns is not None, tokenizer=tokenizer,
                         modes={n: named_modes.get(n, default_mode) for n in names}, expect_mean=expect_mean,
                         chunk_size=chunk_size, queue_depth=queue_depth, new_run=new_run,
                         job=JobSettings(job_timeout=job_timeout), show_progress=show_progress, generations=mix,
                         variants=inputs.variants)
    log.debug("run settings: out %s, chunk size %d, queue depth %d, job timeout %d s, %s", out_dir, chunk_size,
              queue_depth, job_timeout, "detach" if detach else "attached",
              extra={"budgets": per_dataset, "modes": options.modes, "sampling_params": inputs.sampling_params})
    from producer.preflight import check_out_dirs, check_redis
    check_out_dirs(out_dir, names)
    client = _connect(redis_url)
    check_redis(client, allow_eviction=allow_eviction, require_aof=require_aof, warn=_warn)
    _check_server_parsers(client, inputs.reasoning_parser)
    _recheck_context(client, inputs, max_tokens)
    options.conversation = inputs.conversation()  # after the recheck: the context turn 0 was checked against
    _check_seed(client, inputs.sampling_params)
    producer = Producer(client, inputs.prepared, options, echo=echo)
    try:
        producer.attach()
        summaries = producer.run(detach=detach)
    except redis.RedisError as exc:
        raise RuntimeProblem(f"Redis error: {exc}") from None
    if not detach:
        servers = _write_run_manifests(client, out_dir, [s.name for s in summaries])
        if servers:
            _check_seed(client, inputs.sampling_params, servers)
    click.echo(summary_table(summaries, detached=detach))


def _check_server_parsers(client: "redis.Redis", parser: str) -> None:
    """Warn when a worker recorded a server launched with another --reasoning-parser (bq:server_info)."""
    from budget import serverinfo
    from producer.parsers import mismatches
    try:
        servers = serverinfo.load(client)
    except redis.RedisError:
        return  # best effort: the run itself reports Redis trouble
    for message in mismatches(parser, servers):
        _warn(message)


def _recheck_context(client: "redis.Redis", inputs: Any, max_tokens: int) -> None:
    """The SGLang servers' context limit, as their workers recorded it, wins over the offline one: prompts over
    it are skipped now (counted as over context), not sent to be refused one by one."""
    from budget import serverinfo
    from producer.servercontext import recheck, server_context
    try:
        servers = serverinfo.load(client)
    except redis.RedisError as exc:
        raise RuntimeProblem(f"Redis error: {exc}") from None
    recheck(servers, inputs.prepared, inputs.context, max_tokens, echo=log.info, warn=_warn)
    limit = server_context(servers)
    if limit is not None and limit.tokens < inputs.context.tokens:
        inputs.context = limit  # what later turns of a conversation are checked against too


def skip_special_tokens_default(parser: Any) -> bool:
    """What a reasoning parser needs from the server's detokenizer: SGLang's default (true: special tokens left
    out of ``text``) for every family but harmony (gpt-oss), whose channel markers are special tokens that the
    parser reads. The same rule as worker.reasoning.skip_special_tokens_for (the producer does not import the
    worker; tests/test_record.py checks that they agree)."""
    return parser != "gpt-oss"


def _check_seed(client: "redis.Redis", sampling_params: dict[str, Any], servers: Any = None) -> None:
    """Warn when --seed is given and no server the workers recorded honours it. Before any worker has recorded
    its servers there is nothing to check: the end of the run checks again."""
    from budget import serverinfo
    from producer.preflight import seed_warning
    if sampling_params.get("sampling_seed") is None:
        return
    try:
        entries = servers if servers is not None else serverinfo.load(client)
    except redis.RedisError:
        return
    message = seed_warning(entries, sampling_params)
    if message:
        _warn(message)
    elif not entries:
        log.info("--seed: no worker has recorded its SGLang servers yet; whether they honour the seed is checked "
                 "at the end of the run (manifest: sampling_seed_honoured)")


def _write_run_manifests(client: "redis.Redis", out_dir: Path, names: list[str]) -> list[dict[str, Any]] | None:
    """At the end of a run: each dataset's manifest.json, with what the workers recorded of their SGLang
    servers (bq:server_info) and the dataset's budget state; returns those servers. Best effort: a failure is a
    warning, never an exit code (the responses are on disk; ``produce export`` writes the manifest again)."""
    from budget import serverinfo
    from producer.export import ExportError, write_manifest
    try:
        servers: list[dict[str, Any]] | None = serverinfo.load(client) or None
    except redis.RedisError as exc:
        _warn(f"warning: cannot read the SGLang servers' info from Redis ({exc}); the manifests keep what they had")
        servers = None
    if servers is None:
        log.info("no worker recorded its SGLang servers' /get_server_info in the last %d h: the manifests keep "
                 "what they had about the server", serverinfo.MAX_AGE_S // 3600)
    for name in names:
        try:
            path = write_manifest(out_dir / name, servers=servers, extra=_manifest_extra(client, name))
        except (OSError, ExportError, redis.RedisError) as exc:
            _warn(f"warning: {name}: cannot write {out_dir / name / 'manifest.json'}: {exc}")
            continue
        log.info("%s: manifest %s%s", name, path, _describe_servers(servers), extra={
            "dataset": name, "manifest": str(path), "servers": len(servers or [])})
    return servers


def _describe_servers(servers: list[dict[str, Any]] | None) -> str:
    if not servers:
        return ""
    from budget import serverinfo
    same = serverinfo.common(servers)
    what = ", ".join(f"{k} {same[k]}" for k in ("version", "model_path") if k in same) or (
        "unknown behind a router" if serverinfo.unknown(servers) else "servers differ")
    return f" (SGLang: {what}; {len(servers)} server{'s' if len(servers) != 1 else ''})"


def _dry_run(inputs: Any, budgets: dict[str, int | None], out_dir: Path, expect_mean: float | None,
             pilot: int | None, throughput: float | None, as_json: bool, in_flight: int | None = None,
             settings_mix: str = "") -> None:
    from producer.plan import pilot_mean, plan_dataset, plan_table
    plans = []
    for p in inputs.prepared:
        measured = None
        if pilot:
            urls = [u.strip().rstrip("/") for u in os.environ.get("SGLANG_URL", "http://127.0.0.1:30000").split(",")
                    if u.strip()]
            try:
                measured = pilot_mean(p, pilot, urls=urls, sampling_params=inputs.sampling_params,
                                      api_key=os.environ.get("SGLANG_API_KEY") or None)
            except (OSError, RuntimeError, ValueError) as exc:
                raise RuntimeProblem(f"--pilot: {exc}") from None
        plans.append(plan_dataset(p, budget=budgets.get(p.name), out_dir=out_dir, expect_mean=expect_mean,
                                  pilot_mean=measured, pilot_n=pilot or 0, throughput=throughput,
                                  in_flight=in_flight, settings_mix=settings_mix))
    if as_json:
        context = {"tokens": inputs.context.tokens, "source": inputs.context.source}
        click.echo(json.dumps({"datasets": [x.as_dict() for x in plans], "throughput": throughput,
                               "context": context}, indent=2))
    else:
        click.echo(plan_table(plans, throughput, inputs.context))


@main.command("status", help="Show the budget, progress, speed and ETA of every dataset (or only of NAMES), read "
              "from Redis.\n\n"
              "\b\nExample:\n  produce status --watch")
@click.argument("names", nargs=-1)
@redis_url_option
@opt("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C (in place, unless --json).")
@opt("--interval", type=click.FloatRange(0.2), default=2.0, show_default=True, help="Seconds between refreshes.")
@opt("--json", "as_json", is_flag=True, envvar="BUDGETQ_STATUS_JSON", help="Print JSON for scripts.")
def status_cmd(names: tuple[str, ...], redis_url: str, watch: bool, interval: float, as_json: bool) -> None:
    from producer.status import all_status, status_table
    client = _connect(redis_url)
    try:
        while True:
            rows = all_status(client, list(names))
            if as_json:
                text = json.dumps([r.as_dict() for r in rows], indent=2)
            else:
                text = status_table(rows)
            if watch and not as_json:
                click.echo("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + logs.redact(redis_url) + "\n" + text)
            else:
                click.echo(text)
            if not watch:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


@main.command("budget", help="Set dataset NAME's budget to AMOUNT (12M, 500k, or unlimited) while it runs: raising "
              "reopens it (the attached produce tops up its queue; with none attached, run produce again), "
              "lowering to what is used closes it at once.\n\n"
              "\b\nExample:\n  produce budget B2_opencodeinstruct 12M")
@click.argument("name")
@click.argument("amount")
@redis_url_option
def budget_cmd(name: str, amount: str, redis_url: str) -> None:
    from budget.ledger import Ledger
    from budget.runstate import RunState
    from producer.reader import valid_name
    if not valid_name(name):
        raise InputProblem(f"invalid dataset name {name!r}")
    try:
        value = None if amount.lower() in ("unlimited", "none") else parse_amount(amount)
    except ValueError as exc:
        raise InputProblem(str(exc)) from None
    client = _connect(redis_url)
    if not RunState(client).exists(name):
        raise InputProblem(f"no dataset {name!r} in this Redis")
    ledger = Ledger(client)
    status = ledger.set_budget(name, value)
    discarded = ledger.discard(name, "budget lowered") if status == "closed" else 0
    state = ledger.state(name)
    click.echo(f"{name}: budget {'unlimited' if value is None else f'{value:,}'}, used {state.used:,}, "
               f"{status}" + (f", {discarded} queued chunks discarded" if discarded else ""))


@main.command("metrics", help="Serve every dataset's budget, usage and progress as Prometheus metrics at "
              "http://HOST:PORT/metrics, read from Redis at each scrape, until Ctrl-C. Binds 127.0.0.1 unless "
              "--host says otherwise.\n\n"
              "\b\nExample:\n  produce metrics --port 9464 --redis-url redis://redis-host:6379/0")
@redis_url_option
@opt("--host", envvar="BUDGETQ_METRICS_HOST", default="127.0.0.1", show_default=True,
     help="Address to listen on; another than loopback exposes the dataset names and progress to that network.")
@opt("--port", type=click.IntRange(0, 65535), envvar="BUDGETQ_METRICS_PORT", default=9464, show_default=True,
     help="TCP port to listen on (0: any free one, printed at start).")
@log_options
def metrics_cmd(redis_url: str, host: str, port: int, verbose: bool, log_format: str) -> None:
    from producer.metrics import MetricsServer, serve_metrics
    _setup_logging(log_format, verbose)
    client = _connect(redis_url)

    def ready(server: MetricsServer) -> None:
        bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
        log.info("serving http://%s:%d/metrics (Redis %s); Ctrl-C stops", bound_host, bound_port,
                 logs.redact(redis_url), extra={"url": f"http://{bound_host}:{bound_port}/metrics"})

    try:
        serve_metrics(client, host=host, port=port, on_ready=ready)
    except OSError as exc:
        raise RuntimeProblem(f"cannot listen on {host}:{port}: {exc}") from None
    except KeyboardInterrupt:
        return


@main.command("dashboard", help="Serve rq-dashboard (0.9.0, its own pages) at http://HOST:PORT/, reading every "
              "job with RQ's JSON serializer, so the Workers page also works while workers run chunks; deletes "
              "disabled. Binds 127.0.0.1 unless --host says otherwise; another address needs basic auth.\n\n"
              "\b\nExample:\n  RQ_DASHBOARD_USERNAME=ops RQ_DASHBOARD_PASSWORD=... produce dashboard --port 9181")
@redis_url_option
@opt("--host", envvar="BUDGETQ_DASHBOARD_HOST", default="127.0.0.1", show_default=True,
     help="Address to listen on; another than loopback requires --username and --password.")
@opt("--port", type=click.IntRange(0, 65535), envvar="BUDGETQ_DASHBOARD_PORT", default=9181, show_default=True,
     help="TCP port to listen on (0: any free one, printed at start).")
@opt("--username", envvar="RQ_DASHBOARD_USERNAME", default=None,
     help="Basic auth user name (with --password; rq-dashboard's own variable).")
@opt("--password", envvar="RQ_DASHBOARD_PASSWORD", default=None,
     help="Basic auth password: set it in the environment, not on the command line.")
@opt("--url-prefix", envvar="BUDGETQ_DASHBOARD_URL_PREFIX", default="",
     help="URL prefix, behind a reverse proxy (e.g. /rq).")
@opt("--poll-interval", type=click.IntRange(250), envvar="BUDGETQ_DASHBOARD_POLL_INTERVAL", default=None,
     metavar="MS", help="How often the pages refresh, in milliseconds. Default: rq-dashboard's (2500).")
@log_options
def dashboard_cmd(redis_url: str, host: str, port: int, username: str | None, password: str | None,
                  url_prefix: str, poll_interval: int | None, verbose: bool, log_format: str) -> None:
    import ipaddress

    from producer.dashboard import DashboardError, make_app, serve
    _setup_logging(log_format, verbose)
    # werkzeug logs every request at INFO on stderr; as rq-dashboard's own CLI, only with --verbose.
    logging.getLogger("werkzeug").setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if bool(username) != bool(password):
        raise InputProblem("give both --username and --password (RQ_DASHBOARD_USERNAME, RQ_DASHBOARD_PASSWORD), "
                           "or neither")
    if not loopback and not (username and password):
        raise InputProblem(f"--host {host} exposes the dashboard beyond this machine: set RQ_DASHBOARD_USERNAME "
                           "and RQ_DASHBOARD_PASSWORD (basic auth)")
    _connect(redis_url).close()  # a wrong URL is an exit 1 now, not a 500 on every page
    try:
        app = make_app(redis_url, username=username or None, password=password or None,
                       url_prefix=url_prefix.rstrip("/"), poll_interval_ms=poll_interval)
    except DashboardError as exc:
        raise RuntimeProblem(str(exc)) from None

    def ready(bound_host: str, bound_port: int) -> None:
        url = f"http://{bound_host}:{bound_port}{url_prefix.rstrip('/')}/"
        log.info("serving rq-dashboard at %s (Redis %s, JSON serializer, %s); Ctrl-C stops", url,
                 logs.redact(redis_url), "basic auth" if username else "no auth", extra={"url": url})

    try:
        serve(app, host, port, on_ready=ready)
    except OSError as exc:
        raise RuntimeProblem(f"cannot listen on {host}:{port}: {exc}") from None
    except KeyboardInterrupt:
        return


@main.command("export", help="Write the collected results of datasets NAMES as training conversations (ShareGPT or "
              "OpenAI messages) with the regenerated assistant turn, plus OUT/<dataset>/manifest.json.\n\n"
              "\b\nExample:\n  produce export B1_glaive --out out/ --format sharegpt --dest train/b1.jsonl")
@click.argument("names", nargs=-1, required=True)
@opt("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("out"), show_default=True,
     help="The run's output directory (holding <dataset>/raw_responses.jsonl).")
@opt("--format", "fmt", type=click.Choice(["sharegpt", "openai-messages", "tokens"]), default="sharegpt",
     show_default=True, help="Conversation format, or tokens: one row per regenerated turn of input_ids (prompt ids "
                             "+ the server's output ids) and loss_mask (1 on the output ids); needs --tokenizer.")
@opt("--dest", type=click.Path(path_type=Path), default=None,
     help="Output file when one dataset is exported to a path with a suffix (train/b1.jsonl); otherwise a "
          "directory getting <dataset>.jsonl each. Default: OUT/<dataset>/<format>.jsonl.")
@opt("--truncated", type=click.Choice(["drop", "keep"]), default="drop", show_default=True,
     help="What to do with truncated conversations (a turn cut off by --max-tokens, or its thinking never closed) "
          "and incomplete ones (ended before their last user turn): left out, or kept with truncated: true. "
          "Applied to whole conversations, in every format.")
@opt("--reasoning", type=click.Choice(["inline", "field", "drop"]), default="inline", show_default=True,
     help="Reasoning inside <think> in the content, as a reasoning_content field, or left out.")
@opt("--per-turn", is_flag=True,
     help="Conversation formats: one row per regenerated turn (its history as its prompt was rendered, then the "
          "turn) instead of one row per conversation.")
@opt("--token-ids", is_flag=True,
     help="Add input_ids (the prompt, checked id by id) and the server's output_ids (needs --tokenizer).")
@opt("--tokenizer", default=None, help="The run's tokenizer directory (for --token-ids and --format tokens).")
@opt("--redis-url", envvar="BUDGETQ_EXPORT_REDIS_URL", show_envvar=True, default=None,
     help="Optional: record the dataset's budget, mode and usage from this Redis in the manifest, and the SGLang "
          "servers' version and model the workers recorded there if the manifest has none yet.")
@opt("--server-url", metavar="URL[,URL...]", default=None,
     help="Ask these SGLang servers' /get_server_info (with SGLANG_API_KEY if set) and record their version, "
          "model and parallelism in the manifest, replacing what it had.")
@log_options
def export_cmd(names: tuple[str, ...], out_dir: Path, fmt: str, dest: Path | None, truncated: str, reasoning: str,
               per_turn: bool, token_ids: bool, tokenizer: str | None, redis_url: str | None, server_url: str | None,
               verbose: bool, log_format: str) -> None:
    from budget import serverinfo
    from producer.export import ExportError, ExportOptions, export_dataset, read_manifest
    _setup_logging(log_format, verbose)
    tok = None
    if token_ids or fmt == "tokens":
        if not tokenizer:
            raise InputProblem(f"{'--token-ids' if token_ids else '--format tokens'} needs --tokenizer")
        from producer.render import RenderError, load_tokenizer
        try:
            tok = load_tokenizer(tokenizer)
        except RenderError as exc:
            raise InputProblem(str(exc)) from None
    try:
        options = ExportOptions(format=fmt, truncated=truncated, reasoning=reasoning, token_ids=token_ids,
                                per_turn=per_turn)
    except ExportError as exc:
        raise InputProblem(str(exc)) from None
    if dest is not None and len(names) > 1 and dest.suffix:
        raise InputProblem("--dest must be a directory when exporting several datasets")
    fetched = _fetch_servers(server_url) if server_url else None
    client = _connect(redis_url) if redis_url else None
    recorded: list[dict[str, Any]] | None = None
    if client is not None and fetched is None:
        recorded = serverinfo.load(client) or None
        log.debug("%d SGLang server(s) recorded in Redis by the workers", len(recorded or []))
    for name in names:
        extra = _manifest_extra(client, name) if client is not None else None
        servers = fetched
        if servers is None and recorded is not None:
            known = read_manifest(out_dir / name)
            if known.get("server") is None and known.get("servers") is None:
                servers = recorded  # the end of the run recorded none; what serves now is the best we know
            else:
                log.debug("%s: the manifest already names its servers: kept (--server-url replaces them)", name)
        target = (dest if dest is not None and (len(names) == 1 and dest.suffix) else
                  (dest / f"{name}.jsonl" if dest is not None else out_dir / name / f"{fmt}.jsonl"))
        try:
            report = export_dataset(out_dir / name, target, options, tokenizer=tok, servers=servers, extra=extra)
        except ExportError as exc:
            raise InputProblem(str(exc)) from None
        what = "token rows" if fmt == "tokens" else ("turn rows" if per_turn else "conversations")
        click.echo(f"{name}: {report.written} {what} -> {report.path} ({report.dropped_truncated} truncated "
                   f"dropped, {report.skipped_failed} failed skipped); manifest {report.manifest}")
        if servers is not None:
            log.info("%s: manifest %s%s", name, report.manifest, _describe_servers(servers),
                     extra={"dataset": name, "manifest": str(report.manifest), "servers": len(servers)})
        if report.no_output_ids:
            log.warning("%s: %d records of %s left out: written before record version 2, they have no server "
                        "token ids", name, report.no_output_ids, out_dir / name / "raw_responses.jsonl",
                        extra={"dataset": name, "no_output_ids": report.no_output_ids})
        if report.prompt_mismatch:
            log.warning("%s: %d turns left out: the re-rendered prompt differs (first: %s)", name,
                        report.prompt_mismatch, ", ".join(report.mismatched_ids[:5]),
                        extra={"dataset": name, "prompt_mismatch": report.prompt_mismatch})


def _fetch_servers(server_url: str) -> list[dict[str, Any]]:
    """--server-url: ask each server now (SGLANG_API_KEY as the bearer token). Exit 1 if one cannot answer."""
    from budget import serverinfo
    urls = [u.strip() for u in server_url.split(",") if u.strip()]
    if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
        raise InputProblem("--server-url: expected http(s) URLs, comma-separated, not "
                           f"{serverinfo.public_url(server_url)!r}")
    api_key = os.environ.get("SGLANG_API_KEY") or None
    out = []
    for url in urls:
        try:
            found = serverinfo.discover(url, api_key=api_key)  # a router: the servers it lists
        except serverinfo.ServerInfoError as exc:
            raise RuntimeProblem(f"--server-url: {exc}") from None
        for server in found:
            out.append(serverinfo.clean({**server.entry(), "fetched": serverinfo.utc_iso(time.time())}))
            log.debug("SGLang server %s: %s", out[-1]["url"], server.info, extra={"server": out[-1]["url"]})
    return out


def _manifest_extra(client: "redis.Redis", name: str) -> dict[str, Any]:
    from budget.ledger import Ledger
    state = Ledger(client).state(name)
    return {"budget": state.budget, "budget_mode": state.mode, "used": state.used, "status": state.status}


if __name__ == "__main__":  # pragma: no cover
    main()
