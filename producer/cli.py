"""``produce``: the command people type. Thin: parse and validate options, then call the library.

Exit codes: 0 done (or detached on purpose), 1 runtime error (Redis unreachable, dataset already attached
elsewhere), 2 usage or input error (nothing written to Redis), 130 Ctrl-C (the run goes on in the workers).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
import redis

from producer.amount import parse_budget_option

EXAMPLE = """\b
Example:
  produce data/B1_glaive.jsonl data/B2_code.jsonl --tokenizer ./tok \\
      --budget 10M --max-tokens 16384 --out out/
"""


class InputProblem(click.ClickException):
    """Bad input or options: exit 2, a clear message, no traceback, nothing written to Redis."""

    exit_code = 2


class RuntimeProblem(click.ClickException):
    exit_code = 1


class DefaultGroup(click.Group):
    """A group whose default command is ``run``: ``produce FILE...`` means ``produce run FILE...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultGroup, help="Regenerate training data under a token budget per dataset.\n\n" + EXAMPLE)
@click.version_option(package_name="budgetq")
def main() -> None:
    pass


def _sampling_params(max_tokens: int, temperature: float | None, top_p: float | None, top_k: int | None,
                     seed: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_tokens}
    if temperature is not None:
        params["temperature"] = temperature
    if top_p is not None:
        params["top_p"] = top_p
    if top_k is not None:
        params["top_k"] = top_k
    if seed is not None:
        params["sampling_seed"] = seed
    return params


@main.command("run", help="Validate, render and enqueue FILES, then stay attached until the run ends.\n\n"
              + EXAMPLE)
@click.argument("files", nargs=-1, required=True)
@click.option("--tokenizer", required=True, envvar="BUDGETQ_TOKENIZER", show_envvar=True,
              help="Local directory of the model's tokenizer with its chat template.")
@click.option("--budget", "budgets", multiple=True, metavar="AMOUNT|NAME=AMOUNT",
              help="Completion tokens per dataset (10M, 500k, 1.5G); NAME=AMOUNT for one dataset. "
                   "Default: unlimited on a first run, the stored budget on a rerun.")
@click.option("--budget-mode", "modes", multiple=True, metavar="MODE|NAME=MODE",
              help="How a dataset lands on its budget: predict (default: reserve each running request's "
                   "expected length), strict (reserve max-tokens: never above the budget), drain (stop at the "
                   "budget, let in-flight requests finish). Stored per dataset; a rerun keeps it.")
@click.option("--expect-mean", type=click.FloatRange(1), default=None,
              help="Expected completion length before results arrive (predict's prior; --dry-run's estimate).")
@click.option("--max-tokens", type=click.IntRange(1), required=True,
              help="max_new_tokens per request (required: SGLang's default of 128 truncates silently).")
@click.option("--max-context", type=click.IntRange(1), default=None,
              help="Context length; prompts whose length + --max-tokens exceed it are skipped. "
                   "Default: the tokenizer's model_max_length when it is sane.")
@click.option("--max-samples", type=click.IntRange(0), default=None,
              help="Also cap each dataset at its first N valid samples.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("out"),
              show_default=True, help="Output directory: OUT/<dataset>/raw_responses.jsonl.")
@click.option("--redis-url", envvar="REDIS_URL", show_envvar=True, default="redis://127.0.0.1:6379/0",
              show_default=True, help="Redis holding the queue and the budget state.")
@click.option("--temperature", type=click.FloatRange(0), default=None, help="Sampling temperature.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None, help="Nucleus sampling p.")
@click.option("--top-k", type=int, default=None, help="Top-k (-1 or >= 1).")
@click.option("--seed", type=int, default=None, help="Sent as sampling_seed.")
@click.option("--chat-template-kwargs", default=None, metavar="JSON",
              help='Extra chat template arguments, e.g. \'{"enable_thinking": true}\'.')
@click.option("--skip-invalid", is_flag=True, help="Skip and report bad lines instead of refusing the file.")
@click.option("--chunk-size", type=click.IntRange(1, 10_000), default=64, show_default=True,
              help="Samples per RQ job.")
@click.option("--queue-depth", type=click.IntRange(1), default=16, show_default=True,
              help="Chunks kept queued per dataset while attached.")
@click.option("--new-run", is_flag=True, help="Start these datasets over (old output is moved aside).")
@click.option("--detach", is_flag=True, help="Enqueue everything, then exit 0 without collecting.")
@click.option("--job-timeout", type=click.IntRange(60), default=6 * 3600, show_default=True,
              help="RQ job timeout of one chunk, in seconds.")
@click.option("--quiet", "-q", is_flag=True, help="Print only errors and the summary.")
def run_cmd(files: tuple[str, ...], tokenizer: str, budgets: tuple[str, ...], modes: tuple[str, ...],
            expect_mean: float | None, max_tokens: int,
            max_context: int | None, max_samples: int | None, out_dir: Path, redis_url: str,
            temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None,
            chat_template_kwargs: str | None, skip_invalid: bool, chunk_size: int, queue_depth: int,
            new_run: bool, detach: bool, job_timeout: int, quiet: bool) -> None:
    try:
        _run(**locals())
    except KeyboardInterrupt:
        # Before attach nothing was written; after it the run goes on in the workers. Either way: detach.
        click.echo("\ndetached: the workers go on; run the same command again to resume and collect.", err=True)
        sys.exit(130)


def _run(files: tuple[str, ...], tokenizer: str, budgets: tuple[str, ...], modes: tuple[str, ...],
         expect_mean: float | None, max_tokens: int,
         max_context: int | None, max_samples: int | None, out_dir: Path, redis_url: str,
         temperature: float | None, top_p: float | None, top_k: int | None, seed: int | None,
         chat_template_kwargs: str | None, skip_invalid: bool, chunk_size: int, queue_depth: int,
         new_run: bool, detach: bool, job_timeout: int, quiet: bool) -> None:
    # Everything that can be wrong with the input is found before Redis is touched.
    from producer.reader import InputError, read_all
    from producer.render import RenderError, Renderer, default_max_context, load_tokenizer
    from producer.prepare import prepare, run_settings

    try:
        default_budget, named = parse_budget_option(budgets)
    except ValueError as exc:
        raise InputProblem(str(exc)) from None
    try:
        default_mode, named_modes = parse_mode_option(modes)
    except ValueError as exc:
        raise InputProblem(str(exc)) from None
    if top_k is not None and top_k != -1 and top_k < 1:
        raise InputProblem("--top-k must be -1 or at least 1")
    kwargs: dict[str, Any] = {}
    if chat_template_kwargs:
        try:
            kwargs = json.loads(chat_template_kwargs)
        except ValueError as exc:
            raise InputProblem(f"--chat-template-kwargs: not valid JSON ({exc})") from None
        if not isinstance(kwargs, dict):
            raise InputProblem("--chat-template-kwargs: expected a JSON object")
    try:
        reads = read_all(list(files), skip_invalid)
    except InputError as exc:
        raise InputProblem(str(exc)) from None
    names = {r.name for r in reads}
    unknown = sorted((set(named) | set(named_modes)) - names)
    if unknown:
        raise InputProblem(f"--budget/--budget-mode name unknown dataset(s): {', '.join(unknown)} (datasets: "
                           f"{', '.join(sorted(names))})")
    echo = (lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True))
    for r in reads:
        for problem in r.invalid:
            click.echo(f"skipped {problem}", err=True)
        for problem in r.duplicates:
            echo(f"skipped {problem}")
    try:
        tok = load_tokenizer(tokenizer)
        renderer = Renderer(tok, chat_template_kwargs=kwargs)
    except RenderError as exc:
        raise InputProblem(str(exc)) from None
    if max_context is None:
        max_context = default_max_context(tok)
        if max_context is None:
            raise InputProblem("the tokenizer has no sane model_max_length: give --max-context")
    sampling = _sampling_params(max_tokens, temperature, top_p, top_k, seed)
    try:
        prepared = [prepare(r, renderer, max_tokens=max_tokens, max_context=max_context,
                            max_samples=max_samples, skip_invalid=skip_invalid) for r in reads]
    except RenderError as exc:
        raise InputProblem(str(exc)) from None
    for p in prepared:
        for problem in p.over_context:
            echo(f"skipped {problem}")
        echo(f"{p.name}: {len(p.samples)} samples ready ({p.prompt_tokens} prompt tokens), "
             f"{len(p.invalid)} invalid, {len(p.duplicates)} duplicate ids, {len(p.over_context)} over context")
    settings = run_settings(renderer, sampling, kwargs)
    per_dataset: dict[str, int | None] = {p.name: named.get(p.name, default_budget) for p in prepared}

    from producer.enqueue import JobSettings
    from producer.run import ProduceError, Producer, RunOptions

    think = renderer.think
    options = RunOptions(out_dir=out_dir, budgets=per_dataset, sampling_params=sampling, settings=settings,
                         think={"start": think.start, "end": think.end} if think else None,
                         modes={p.name: named_modes.get(p.name, default_mode) for p in prepared},
                         expect_mean=expect_mean,
                         chunk_size=chunk_size, queue_depth=queue_depth, new_run=new_run,
                         job=JobSettings(job_timeout=job_timeout))
    client: redis.Redis = redis.Redis.from_url(redis_url)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise RuntimeProblem(f"cannot reach Redis at {_safe_url(redis_url)}: {exc}") from None
    producer = Producer(client, prepared, options, echo=echo)
    try:
        producer.attach()
        summaries = producer.run(detach=detach)
    except ProduceError as exc:
        raise (InputProblem if exc.exit_code == 2 else RuntimeProblem)(str(exc)) from None
    except redis.RedisError as exc:
        raise RuntimeProblem(f"Redis error: {exc}") from None
    from producer.report import summary_table
    click.echo(summary_table(summaries, detached=detach))


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


def _safe_url(url: str) -> str:
    """The Redis URL without its password: secrets never reach a log."""
    from urllib.parse import urlsplit, urlunsplit
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


if __name__ == "__main__":  # pragma: no cover
    main()
