"""``produce``: the command people type. Thin: each command parses its options, calls one library function, and
prints what it returns; the decisions live in the library (``run``: producer/settings.py and producer/launch.py).

Exit codes: 0 done (or detached on purpose), 1 runtime error (Redis unreachable, dataset already attached
elsewhere), 2 usage or input error (nothing written to Redis), 130 Ctrl-C (the run goes on in the workers).
The library raises producer/errors.py exceptions, which carry their code; `ProduceGroup` turns them into the
one-line ``Error: ...`` and the exit, for every command. Every option can also be set by an environment variable
(shown in --help); REDIS_URL is read as is.
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

from budget import runtime
from budget.record import REASONING_PARSERS
from budget.urls import DEFAULT_SGLANG_URL
from producer.errors import ProduceError, UsageError
from producer.launch import connect
from producer.settings import DEFAULT_SEED, ORDERS

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
    """A ProduceError as click shows it: ``Error: message`` on stderr (a JSON log line with --log-format json)."""

    def __init__(self, exc: ProduceError) -> None:
        super().__init__(str(exc))
        self.exit_code = exc.exit_code  # type: ignore[misc]  # click reads the instance's; its stub says ClassVar

    def show(self, file: Any = None) -> None:
        if _LOG["json"]:
            log.error(self.format_message(), extra={"exit_code": self.exit_code})
        else:
            super().show(file)


class ProduceGroup(click.Group):
    """The command group. Its default command is ``run``: ``produce FILE...`` means ``produce run FILE...``. And
    the one place a user-facing error of any command becomes its message and exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["run", *args]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ProduceError as exc:
            raise _Problem(exc) from None


def opt(*decls: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option whose environment variable is BUDGETQ_<NAME>, shown in --help."""
    name = max((d for d in decls if d.startswith("--")), key=len).lstrip("-").split("/")[0]
    kwargs.setdefault("envvar", "BUDGETQ_" + name.upper().replace("-", "_"))
    kwargs.setdefault("show_envvar", True)
    return click.option(*decls, **kwargs)


def log_options(f: F) -> F:
    """--verbose and --log-format, for the commands that report progress on stderr."""
    f = opt("--log-format", type=click.Choice(runtime.FORMATS), default="text", show_default=True,
            help="Progress and event messages on stderr: text, or one JSON object per line (ts, level, logger, "
                 "msg and the event's fields).")(f)
    return opt("--verbose", "-v", is_flag=True, help="Also print debug messages.")(f)


def _setup_logging(log_format: str, verbose: bool = False, quiet: bool = False) -> None:
    if verbose and quiet:
        raise UsageError("--verbose and --quiet exclude each other")
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    runtime.configure_logs("budgetq", fmt=log_format, level=level)
    _LOG["json"] = log_format == "json"


def _warn(message: str) -> None:
    """A warning of the library (worded "warning: ..." for text): the level says it in JSON."""
    log.warning(message.removeprefix("warning: ") if _LOG["json"] else message)


def listen_options(service: str, port: int, other_host: str) -> Callable[[F], F]:
    """--host and --port of a served page (BUDGETQ_<SERVICE>_HOST/_PORT): loopback unless asked otherwise."""
    def decorate(f: F) -> F:
        f = opt("--port", type=click.IntRange(0, 65535), envvar=f"BUDGETQ_{service}_PORT", default=port,
                show_default=True, help="TCP port to listen on (0: any free one, printed at start).")(f)
        return opt("--host", envvar=f"BUDGETQ_{service}_HOST", default="127.0.0.1", show_default=True,
                   help=f"Address to listen on; another than loopback {other_host}.")(f)
    return decorate


def _redis_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A Redis URL redis-py can parse, or a usage error naming it (redacted) and what is wrong, not a traceback."""
    import redis
    if value is not None:
        try:
            redis.ConnectionPool.from_url(value)
        except ValueError as exc:
            raise click.BadParameter(f"{runtime.redact(value)}: {exc}", ctx=ctx, param=param) from None
    return value


redis_url_option = click.option(
    "--redis-url", envvar="REDIS_URL", show_envvar=True, default="redis://127.0.0.1:6379/0", show_default=True,
    callback=_redis_url, help="Redis holding the queue and the budget state.")


@click.group(cls=ProduceGroup, context_settings={"help_option_names": ["-h", "--help"]},
             help="Regenerate training data under a token budget per dataset. The default command is run: "
                  "'produce FILES...' means 'produce run FILES...'.\n\n" + EXAMPLE)
@click.version_option(package_name="budgetq")
def main() -> None:
    _LOG["json"] = False  # set again by the commands that configure logging


@main.command("run", help="Validate, render and enqueue FILES, then stay attached until the run ends.\n\n"
              + EXAMPLE)
@click.argument("files", nargs=-1, required=True)
@opt("--tokenizer", required=True,
     help="The model's directory (its tokenizer with the chat template, and config.json), or a hub id "
          "(Qwen/Qwen3-8B) found in the local Hugging Face cache; nothing is downloaded.")
@opt("--budget", "budgets", multiple=True, metavar="AMOUNT|NAME=AMOUNT",
     help="Completion tokens per dataset (10M, 500k, 1.5G, or unlimited); NAME=AMOUNT for one dataset. "
          "Default: unlimited on a first run, the stored budget on a rerun (also when it gives the last run's "
          "--budget again after 'produce budget' changed it).")
@opt("--mix", multiple=True, metavar="NAME=WEIGHT[,...]",
     help="Share one budget across the datasets by weight: --budget 40M --mix code=1,fc=1,traces=2 gives code and "
          "fc 10M each and traces 20M; a dataset that runs out of prompts passes the rest of its share on to the "
          "others by weight, so the total still lands on --budget. Names every dataset of the run. docs/mix.md.")
@opt("--mix-pacing/--no-mix-pacing", default=True, show_default=True,
     help="With --mix: queue each dataset's chunks so that its tokens keep to its weight while the run goes, so a "
          "run stopped early is in proportion; --no-mix-pacing lets them progress as their chunks are pulled.")
@opt("--deadline", default=None, metavar="WHEN",
     help="Stop by WHEN (2026-12-05T08:00, local time, or with an offset): as it nears, workers start no request "
          "whose expected duration at their measured speed ends after it; what runs finishes (a long one may end "
          "past WHEN, by at most --max-tokens at the per-request speed). Stored with the "
          "run; a rerun after it passed sends nothing unless given a new one. docs/mix.md.")
@opt("--for", "for_", default=None, metavar="DURATION", help="A deadline this long from now: 20h, 90m, 1h30m, 2d.")
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
          "seeded random N, not the file's first N).")
@opt("--order", type=click.Choice(ORDERS), default=None,
     help="Order each dataset's prompts are sent in, so what a budget or --max-samples keeps: random (default; "
          "seeded, a function of the ids and --order-seed only) or file. Stored with the run; a run stored "
          "before it resumes in file order.")
@opt("--order-seed", type=int, default=None, metavar="N",
     help=f"Seed of --order random (default {DEFAULT_SEED}). Stored with the run.")
@opt("--turns", type=click.Choice(("all", "last")), default="all",
     help="Which assistant turns of a conversation are regenerated: all (default: each user turn in order, on "
          "the model's own earlier answers) or last (only the answer to the last user turn, on the dataset's "
          "history). Stored with the run.")
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
@opt("--chat-template", default=None, metavar="FILE",
     help="A Jinja chat template to render every prompt with instead of the tokenizer's (SGLang's --chat-template): "
          "for a tokenizer whose template is wrong or missing. Workers render later turns with it too, export checks "
          "rows with it; its content is part of the run's settings (run.json chat_template, chat_template_path).")
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
@opt("--tools-field", default="tools", show_default=True,
     help="Field holding the record's tool definitions (a list, or a JSON string of one): rendered into its prompts.")
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
          "BUDGETQ_CONCURRENCY, or what the servers run at once; default 64), for the ETA: a conversation's turns run one after another.")
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
    from producer.launch import launch
    from producer.settings import RunSettings
    _setup_logging(options["log_format"], options["verbose"], options["quiet"])
    settings = RunSettings.from_options(options, sglang_url=os.environ.get("SGLANG_URL", DEFAULT_SGLANG_URL),
                                        api_key=os.environ.get("SGLANG_API_KEY") or None,
                                        terminal=sys.stderr.isatty())
    try:
        click.echo(launch(settings, warn=_warn))
    except KeyboardInterrupt:
        # Before attach nothing was written; after it the run goes on in the workers. Either way: detach.
        if not _LOG["json"]:
            click.echo("", err=True)
        log.warning("detached: the workers go on; run the same command again to resume and collect.")
        sys.exit(130)


@main.command("status", help="Show the budget, progress, speed and ETA of every dataset (or only of NAMES), read "
              "from Redis.\n\n"
              "\b\nExample:\n  produce status --watch")
@click.argument("names", nargs=-1)
@redis_url_option
@opt("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C (in place, unless --json).")
@opt("--interval", type=click.FloatRange(0.2), default=2.0, show_default=True, help="Seconds between refreshes.")
@opt("--json", "as_json", is_flag=True, envvar="BUDGETQ_STATUS_JSON", help="Print JSON for scripts.")
def status_cmd(names: tuple[str, ...], redis_url: str, watch: bool, interval: float, as_json: bool) -> None:
    import redis

    from producer.ops.status import all_status, status_text
    client = connect(redis_url)
    try:
        while True:
            try:
                rows = all_status(client, list(names))
                screen = status_text(client, rows)
            except redis.RedisError as exc:  # --watch outlives a Redis restart; a single look reports it
                if not watch:
                    raise ProduceError(f"Redis at {runtime.redact(redis_url)}: {exc}") from None
                click.echo("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + runtime.redact(redis_url)
                           + f"\nRedis unreachable ({exc}); retrying every {interval:g} s", err=as_json)
                time.sleep(interval)
                continue
            if as_json:
                text = json.dumps([r.as_dict() for r in rows], indent=2)
            else:
                text = screen
            if watch and not as_json:
                click.echo("\x1b[H\x1b[2J" + time.strftime("%H:%M:%S ") + runtime.redact(redis_url) + "\n" + text)
            else:
                click.echo(text)
            if not watch:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        return


@main.command("sample", short_help="Show a few committed records of NAME and its length distribution.", help="Show a few committed records of dataset NAME (OUT/NAME/raw_responses.jsonl), while the "
              "run goes or after it: each record's last user turn, every turn's reasoning, content, tool calls, "
              "completion tokens and finish reason; then the length distribution of all its responses. A random "
              "pick over the whole file (its tail is one moment of the run: the answers that finished together, short "
              "ones early on, the longest at the end); --latest for the newest. Read-only: no Redis, nothing written.\n\n"
              "\b\nExamples:\n  produce sample code_instruct --out out/ -n 5\n  produce sample code_instruct -n 0")
@click.argument("name")
@opt("-n", "--count", type=click.IntRange(0), default=3, show_default=True, envvar="BUDGETQ_SAMPLE_COUNT",
     help="Records to show; 0: only the length distribution.")
@opt("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("out"), show_default=True,
     help="The run's output directory (holding <dataset>/raw_responses.jsonl).")
@opt("--seed", type=int, default=None, envvar="BUDGETQ_SAMPLE_SEED",
     help="Seed of the random pick: the same seed over the same records shows the same ones. Default: another "
          "pick each time.")
@opt("--latest", is_flag=True, envvar="BUDGETQ_SAMPLE_LATEST", help="The last records committed, not a random pick.")
@opt("--chars", type=click.IntRange(0), default=300, show_default=True, envvar="BUDGETQ_SAMPLE_CHARS",
     help="Characters shown of each text (on one line); 0: every text whole, as written.")
@opt("--json", "as_json", is_flag=True, envvar="BUDGETQ_SAMPLE_JSON",
     help="Print the chosen records as written, one JSON line each, and nothing else.")
def sample_cmd(name: str, count: int, out_dir: Path, seed: int | None, latest: bool, chars: int,
               as_json: bool) -> None:
    from producer.ops.sample import pick, report, results_of
    path = results_of(out_dir, name)
    picked = pick(path, count, seed=seed, latest=latest)
    if as_json:
        for result in picked.results:
            click.echo(result.text)
        return
    click.echo(report(name, path, picked, chars))


@main.command("servers", help="Show one row per SGLang server, read from what the workers record in Redis: the hosts "
              "and workers using it, its state (ok, slow, down since when), requests in flight against the windows "
              "its workers keep, its max_running_requests, tok/s and last error; first, how many rq workers listen on "
              "the queue, on which hosts.\n\n"
              "\b\nExample:\n  produce servers --redis-url redis://redis-host:6379/0")
@redis_url_option
@opt("--json", "as_json", is_flag=True, envvar="BUDGETQ_SERVERS_JSON", help="Print JSON for scripts.")
def servers_cmd(redis_url: str, as_json: bool) -> None:
    import redis

    from producer.ops.status import read_view, servers_table
    try:
        view = read_view(connect(redis_url))
    except redis.RedisError as exc:
        raise ProduceError(f"Redis at {runtime.redact(redis_url)}: {exc}") from None
    click.echo(json.dumps(view.as_dict(), indent=2) if as_json else servers_table(view))


@main.command("budget", help="Set dataset NAME's budget to AMOUNT (12M, 500k, or unlimited) while it runs: raising "
              "reopens it (the attached produce tops up its queue; with none attached, run produce again), "
              "lowering to what is used closes it at once. For a mix (docs/mix.md): --mix with every member's "
              "weight, and --total to change the total.\n\n"
              "\b\nExamples:\n  produce budget B2_opencodeinstruct 12M\n"
              "  produce budget --mix code=1,fc=2,traces=2 --total 50M")
@click.argument("name", required=False)
@click.argument("amount", required=False)
@click.option("--mix", "mix", multiple=True, metavar="NAME=WEIGHT[,...]", help="The mix's new weights (every member).")
@click.option("--total", default=None, metavar="AMOUNT", help="With --mix: the mix's new total.")
@redis_url_option
def budget_cmd(name: str | None, amount: str | None, mix: tuple[str, ...], total: str | None, redis_url: str) -> None:
    from producer.ops.status import change_budget, change_mix, parse_budget_change, parse_mix_change
    if mix:
        if name is not None:
            raise UsageError("give NAME AMOUNT or --mix, not both")
        weights, new_total = parse_mix_change(mix, total)
        click.echo(change_mix(connect(redis_url), weights, new_total))
        return
    if name is None or amount is None:
        raise UsageError("give NAME AMOUNT (one dataset) or --mix NAME=WEIGHT,... [--total AMOUNT] (a mix)")
    if total is not None:
        raise UsageError("--total goes with --mix")
    budget = parse_budget_change(name, amount)
    click.echo(change_budget(connect(redis_url), name, budget))


@main.command("metrics", help="Serve every dataset's budget, usage and progress as Prometheus metrics at "
              "http://HOST:PORT/metrics, read from Redis at each scrape, until Ctrl-C. Binds 127.0.0.1 unless "
              "--host says otherwise.\n\n"
              "\b\nExample:\n  produce metrics --port 9464 --redis-url redis://redis-host:6379/0")
@redis_url_option
@listen_options("METRICS", 9464, "exposes the dataset names and progress to that network")
@log_options
def metrics_cmd(redis_url: str, host: str, port: int, verbose: bool, log_format: str) -> None:
    from producer.ops.metrics import MetricsServer, serve_metrics
    _setup_logging(log_format, verbose)
    client = connect(redis_url)

    def ready(server: MetricsServer) -> None:
        bound_host, bound_port = str(server.server_address[0]), int(server.server_address[1])
        log.info("serving http://%s:%d/metrics (Redis %s); Ctrl-C stops", bound_host, bound_port,
                 runtime.redact(redis_url), extra={"url": f"http://{bound_host}:{bound_port}/metrics"})

    try:
        serve_metrics(client, host=host, port=port, on_ready=ready)
    except KeyboardInterrupt:
        return


@main.command("dashboard", help="Serve rq-dashboard (0.9.0, its own pages) at http://HOST:PORT/, reading every "
              "job with RQ's JSON serializer, so the Workers page also works while workers run chunks; deletes "
              "disabled. Binds 127.0.0.1 unless --host says otherwise; another address needs basic auth.\n\n"
              "\b\nExample:\n  RQ_DASHBOARD_USERNAME=ops RQ_DASHBOARD_PASSWORD=... produce dashboard --port 9181")
@redis_url_option
@listen_options("DASHBOARD", 9181, "requires --username and --password")
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
    from producer.ops.dashboard import check_exposure, make_app, serve
    _setup_logging(log_format, verbose)
    # werkzeug logs every request at INFO on stderr; as rq-dashboard's own CLI, only with --verbose.
    logging.getLogger("werkzeug").setLevel(logging.INFO if verbose else logging.WARNING)
    check_exposure(host, username, password)
    connect(redis_url).close()  # a wrong URL is an exit 1 now, not a 500 on every page
    app = make_app(redis_url, username=username or None, password=password or None,
                   url_prefix=url_prefix.rstrip("/"), poll_interval_ms=poll_interval)

    def ready(bound_host: str, bound_port: int) -> None:
        url = f"http://{bound_host}:{bound_port}{url_prefix.rstrip('/')}/"
        log.info("serving rq-dashboard at %s (Redis %s, JSON serializer, %s); Ctrl-C stops", url,
                 runtime.redact(redis_url), "basic auth" if username else "no auth", extra={"url": url})

    try:
        serve(app, host, port, on_ready=ready)
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
                             "+ the server's output ids) and loss_mask (1 on the output ids), with --tokenizer or else the run's "
                             "(run.json tokenizer_path).")
@opt("--dest", type=click.Path(path_type=Path), default=None,
     help="Output file when one dataset is exported to a path with a suffix (train/b1.jsonl); otherwise a "
          "directory getting <dataset>.jsonl each. Default: OUT/<dataset>/<format>.jsonl.")
@opt("--truncated", type=click.Choice(["drop", "keep"]), default="drop", show_default=True,
     help="What to do with truncated conversations (a turn cut off by --max-tokens, or its thinking never closed) "
          "and incomplete ones (ended before their last user turn): left out, or kept with truncated: true. "
          "Applied to whole conversations, in every format.")
@opt("--reasoning", type=click.Choice(["inline", "field", "drop"]), default="inline", show_default=True,
     help="Reasoning inside <think> in the content, as a reasoning_content field, or left out.")
@opt("--for", "trainer", type=click.Choice(["specforge", "speculators"]), default=None,
     help="The trainer that reads the file, which decides the rows of multi-turn conversations: specforge, one row "
          "per regenerated turn (train with train_only_last_turn); speculators, one row per conversation (it "
          "trains every turn on its own prefix). Needed for multi-turn data unless --per-turn/--whole says it.")
@opt("--per-turn/--whole", "per_turn", default=None,
     help="Conversation formats: one row per regenerated turn (its history as its prompt was rendered, then the "
          "turn), or one row per conversation. Default: what --for's trainer reads exactly.")
@opt("--inexact", type=click.Choice(["drop", "keep"]), default="drop", show_default=True,
     help="Conversation rows that --for's trainer would not train on exactly the ids the model generated (checked "
          "with --tokenizer, rendered as the trainer renders them): left out, or kept with inexact: true. Counted "
          "either way.")
@opt("--token-ids", is_flag=True,
     help="Add input_ids (the prompt, checked id by id) and the server's output_ids (with --tokenizer or else the "
          "run's).")
@opt("--tokenizer", default=None,
     help="The run's tokenizer directory. --token-ids and --format tokens without it use the one the run was "
          "started with (run.json tokenizer_path); with a conversation format, every row is checked as its trainer "
          "renders it (--inexact), and without it the rows are written unchecked.")
@opt("--redis-url", envvar="REDIS_URL", show_envvar=True, default=None, callback=_redis_url,
     help="Optional (REDIS_URL, as every command reads): record the dataset's budget, mode and usage from this Redis in the manifest, and the SGLang "
          "servers' version and model the workers recorded there if the manifest has none yet.")
@opt("--server-url", metavar="URL[,URL...]", default=None,
     help="Ask these SGLang servers' /get_server_info (with SGLANG_API_KEY if set) and record their version, "
          "model and parallelism in the manifest, replacing what it had.")
@log_options
def export_cmd(names: tuple[str, ...], out_dir: Path, fmt: str, dest: Path | None, truncated: str, reasoning: str,
               trainer: str | None, per_turn: bool | None, inexact: str, token_ids: bool, tokenizer: str | None,
               redis_url: str | None, server_url: str | None, verbose: bool, log_format: str) -> None:
    from producer.export.manifest import fetch_servers
    from producer.export.writer import ExportJob, ExportOptions, export_datasets
    _setup_logging(log_format, verbose)
    options = ExportOptions(format=fmt, truncated=truncated, reasoning=reasoning, token_ids=token_ids,
                            per_turn=per_turn, trainer=trainer, inexact=inexact)
    job = ExportJob.build(names, out_dir, options, dest=dest, tokenizer_dir=tokenizer)
    fetched = fetch_servers(server_url, api_key=os.environ.get("SGLANG_API_KEY") or None) if server_url else None
    client = connect(redis_url) if redis_url else None
    what = "token rows" if fmt == "tokens" else ("turn rows" if options.rows_per_turn else "conversations")
    for name, report in export_datasets(job, client=client, fetched=fetched):
        kept = "dropped" if inexact == "drop" else "kept"
        inexact_note = f", {report.inexact} inexact {kept}" if report.inexact else ""
        # Incomplete conversations (ended early: budget, tool_mismatch...) are not called truncated.
        incomplete = sum(report.dropped_incomplete.values())
        why = ", ".join(f"{reason} {n}" for reason, n in sorted(report.dropped_incomplete.items()))
        incomplete_note = f", {incomplete} incomplete dropped ({why})" if incomplete else ""
        click.echo(f"{name}: {report.written} {what} -> {report.path} ({report.dropped_truncated - incomplete} "
                   f"truncated dropped{incomplete_note}, {report.skipped_failed} failed skipped{inexact_note}); "
                   f"manifest {report.manifest}")


if __name__ == "__main__":  # pragma: no cover
    main()
