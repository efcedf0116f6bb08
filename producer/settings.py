"""``produce run``'s options as one checked, frozen value (`RunSettings`), built once from what click parsed.

Everything that can be wrong with the options alone is found here, before a file is read or Redis is touched
(exit 2, producer/errors.py UsageError); what needs the files (a --budget naming an unknown dataset) is checked
by `RunSettings.budgets_for` once they are read. docs/cli.md describes every option.
"""
from __future__ import annotations

import datetime
import json
import re
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from budget.urls import server_urls
from producer.amount import UNLIMITED, Budget, parse_budget_option, parse_mix
from producer.errors import UsageError
from producer.generations import MixError, TemplateMix, parse_temperatures
from producer.inputs.records import FieldMapping
from producer.order import DEFAULT_SEED, RANDOM, Order

if TYPE_CHECKING:
    from budget.mix import Mix
    from render.chat import ChatTemplate
    from render.modeldir import Context


@dataclass(frozen=True)
class RunSettings:
    """What ``produce run`` was asked to do, parsed and checked; the fields mirror its options (docs/cli.md)."""

    files: tuple[str, ...]
    tokenizer: str
    max_tokens: int
    max_context: int | None
    max_samples: int | None
    out_dir: Path
    redis_url: str
    #: --budget AMOUNT (every dataset not named; None: the stored budget, or unlimited) and NAME=AMOUNT; an
    #: AMOUNT may be UNLIMITED (producer/amount.py): explicitly none
    budget: Budget | None
    named_budgets: Mapping[str, Budget]
    #: --mix NAME=WEIGHT,...: the datasets' weights in one budget whose total is --budget AMOUNT (docs/mix.md)
    mix: Mapping[str, Fraction] | None
    mix_pacing: bool
    #: --deadline / --for: when every request must have ended, unix seconds (None: no deadline; a stored one stays)
    deadline: float | None
    #: --budget-mode MODE and NAME=MODE (None: the stored mode, else predict)
    mode: str | None
    named_modes: Mapping[str, str]
    order: Order  # --order and --order-seed, defaults filled in
    turns: str  # --turns
    generations: int
    temperatures: tuple[float, ...] | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    skip_special_tokens: bool | None  # None: what the run's reasoning parser needs
    chat_template_kwargs: Mapping[str, Any]
    #: --chat-template FILE, read (not yet compiled: render/chat.py load_tokenizer does); None: the tokenizer's
    chat_template: ChatTemplate | None
    template_mix: TemplateMix | None
    reasoning_parser: str
    skip_invalid: bool
    mapping: FieldMapping
    expect_mean: float | None
    dry_run: bool
    pilot: int | None
    #: where --pilot sends its requests (SGLANG_URL; empty without --pilot) and the key it sends them with
    pilot_urls: tuple[str, ...]
    api_key: str | None = field(repr=False)
    throughput: float | None
    in_flight: int | None
    as_json: bool
    chunk_size: int
    queue_depth: int
    new_run: bool
    detach: bool
    job_timeout: int
    allow_eviction: bool
    require_aof: bool
    #: bars while validating, rendering and enqueueing: for a person at a terminal, never in JSON logs
    show_progress: bool

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, sglang_url: str, api_key: str | None,
                     terminal: bool) -> "RunSettings":
        """Check and parse the ``run`` command's options (click's keyword arguments). ``sglang_url`` and
        ``api_key``: SGLANG_URL and SGLANG_API_KEY, which only --pilot uses; ``terminal``: stderr is one.
        Raises UsageError naming the option at fault."""
        o = options
        try:
            budget, named_budgets = parse_budget_option(o["budgets"])
            mode, named_modes = parse_mode_option(o["modes"])
            weights = parse_mix(tuple(o.get("mix") or ()))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if weights:
            if named_budgets:
                raise UsageError(f"--budget {next(iter(named_budgets))}=...: with --mix a dataset's budget is its "
                                 "share of the total; give the total as --budget AMOUNT and the shares as weights")
            if budget is None or budget == UNLIMITED:
                raise UsageError("--mix needs the total it shares: --budget AMOUNT (e.g. --budget 40M --mix "
                                 "code=1,traces=2)")
        top_k = o["top_k"]
        if top_k is not None and top_k != -1 and top_k < 1:
            raise UsageError("--top-k must be -1 or at least 1")
        temperatures = _temperatures(o["temperature"], o["generations"])
        if (o["pilot"] or o["throughput"] or o["in_flight"] or o["as_json"]) and not o["dry_run"]:
            raise UsageError("--pilot, --throughput, --in-flight and --json go with --dry-run")
        kwargs = _template_kwargs(o["chat_template_kwargs"])
        template = _chat_template(o.get("chat_template"))
        try:
            mapping = FieldMapping(messages_field=o["messages_field"], prompt_field=o["prompt_field"],
                                   conversations_field=o["conversations_field"], id_field=o["id_field"],
                                   system_prompt=o["system_prompt"], tools_field=o.get("tools_field") or "tools")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if o["max_context"] is not None:
            check_max_tokens(o["max_tokens"], _context(o["max_context"]))
        if o["order"] == "file" and o["order_seed"] is not None:
            raise UsageError("--order-seed goes with --order random")
        order = Order(o["order"] or RANDOM, DEFAULT_SEED if o["order_seed"] is None else o["order_seed"])
        mix = None
        if o["template_kwargs_mix"] is not None:
            try:
                mix = TemplateMix.parse(o["template_kwargs_mix"], order.seed)
            except MixError as exc:
                raise UsageError(f"--template-kwargs-mix: {exc}") from None
        try:
            pilot_urls = server_urls(sglang_url) if o["pilot"] else ()
        except ValueError as exc:
            raise UsageError(f"--pilot: {exc}") from None
        return cls(
            files=tuple(o["files"]), tokenizer=o["tokenizer"], max_tokens=o["max_tokens"],
            max_context=o["max_context"], max_samples=o["max_samples"], out_dir=o["out_dir"],
            redis_url=o["redis_url"], budget=budget, named_budgets=named_budgets, mix=weights or None,
            mix_pacing=o.get("mix_pacing", True), deadline=_deadline(o.get("deadline"), o.get("for_"), time.time()),
            mode=mode,
            named_modes=named_modes, order=order, turns=o["turns"], generations=o["generations"],
            temperatures=temperatures, top_p=o["top_p"], top_k=top_k,
            seed=o["seed"], skip_special_tokens=o["skip_special_tokens"], chat_template_kwargs=kwargs,
            chat_template=template, template_mix=mix, reasoning_parser=o["reasoning_parser"], skip_invalid=o["skip_invalid"], mapping=mapping,
            expect_mean=o["expect_mean"], dry_run=o["dry_run"], pilot=o["pilot"], pilot_urls=pilot_urls,
            api_key=api_key, throughput=o["throughput"], in_flight=o["in_flight"], as_json=o["as_json"],
            chunk_size=o["chunk_size"], queue_depth=o["queue_depth"], new_run=o["new_run"], detach=o["detach"],
            job_timeout=o["job_timeout"], allow_eviction=o["allow_eviction"], require_aof=o["require_aof"],
            show_progress=not o["quiet"] and o["log_format"] == "text" and terminal)

    def sampling_params(self) -> dict[str, Any]:
        """The run's sampling parameters (run.json ``sampling_params``): a --temperature list stays a list
        (generation k takes entry k mod len: producer/generations.py); one value is a number."""
        params: dict[str, Any] = {"max_new_tokens": self.max_tokens}
        if self.temperatures is not None:
            t = self.temperatures
            params["temperature"] = t[0] if len(t) == 1 else list(t)
        if self.top_p is not None:
            params["top_p"] = self.top_p
        if self.top_k is not None:
            params["top_k"] = self.top_k
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params

    def budgets_for(self, names: Iterable[str]) -> dict[str, Budget | None]:
        """Each dataset's --budget; a name given to --budget or --budget-mode that is not a dataset is an error."""
        names = set(names)
        unknown = sorted((set(self.named_budgets) | set(self.named_modes)) - names)
        if unknown:
            raise UsageError(f"--budget/--budget-mode name unknown dataset(s): {', '.join(unknown)} (datasets: "
                             f"{', '.join(sorted(names))})")
        if self.mix is not None:
            check_mix_names(self.mix, names)
            return dict.fromkeys(names)  # each dataset's budget is its share (RunOptions.mix), not --budget
        return {n: self.named_budgets.get(n, self.budget) for n in names}

    def given_mix(self) -> "Mix | None":
        """--budget TOTAL --mix ...: the mix as given (no member dry yet); None without --mix."""
        from budget.mix import Mix
        if self.mix is None:
            return None
        return Mix(total=int(self.budget), weights=dict(self.mix))  # type: ignore[arg-type]

    def modes_for(self, names: Iterable[str]) -> dict[str, str | None]:
        return {n: self.named_modes.get(n, self.mode) for n in names}


_DURATION_RE = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def parse_duration(text: str) -> float:
    """``--for``: 20h, 90m, 1h30m, 2d, 45s -> seconds. ValueError names the input."""
    m = _DURATION_RE.fullmatch(text.strip())
    if not text.strip() or m is None or not any(m.groups()):
        raise ValueError(f"--for {text!r}: expected a duration like 20h, 90m, 1h30m or 2d")
    d, h, mi, sec = (int(x or 0) for x in m.groups())
    return float(((d * 24 + h) * 60 + mi) * 60 + sec)


def _deadline(deadline: str | None, duration: str | None, now: float) -> float | None:
    """--deadline WHEN (ISO 8601; without an offset, this machine's local time) or --for DURATION, as unix
    seconds. A deadline in the past, or both options, is an error (exit 2)."""
    if deadline is not None and duration is not None:
        raise UsageError("give --deadline or --for, not both")
    if duration is not None:
        try:
            seconds = parse_duration(duration)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if seconds <= 0:
            raise UsageError(f"--for {duration}: must be longer than 0")
        return now + seconds
    if deadline is None:
        return None
    try:
        when = datetime.datetime.fromisoformat(deadline.strip())
    except ValueError:
        raise UsageError(f"--deadline {deadline!r}: expected a date and time like 2026-12-05T08:00 (local time) or "
                         "2026-12-05T08:00+00:00") from None
    at = when.timestamp()  # naive: local time
    if at <= now:
        raise UsageError(f"--deadline {deadline}: it is in the past (now {time.strftime('%Y-%m-%dT%H:%M:%S')})")
    return at


def check_mix_names(weights: Mapping[str, Fraction], names: set[str]) -> None:
    """--mix names every dataset of the run, and only those (exit 2): a dataset left out would have no share, a
    name that is not a dataset is a typo."""
    unknown, missing = sorted(set(weights) - names), sorted(names - set(weights))
    if unknown or missing:
        parts = ([f"names unknown dataset(s) {', '.join(unknown)}"] if unknown else []) + \
                ([f"gives no weight to {', '.join(missing)}"] if missing else [])
        raise UsageError(f"--mix {' and '.join(parts)} (datasets of this run: {', '.join(sorted(names))}); "
                         "a mix names every dataset of the run")


def check_max_tokens(max_tokens: int, context: "Context") -> None:
    """Refuse (exit 2) a --max-tokens that leaves no room for a prompt in the context: every prompt would be
    skipped one by one and the run would end "complete" having sent nothing. Called as soon as the context is
    known: at once for --max-context, once the tokenizer is read otherwise, again with the servers' limit."""
    if max_tokens >= context.tokens:
        raise UsageError(f"--max-tokens {max_tokens:,} leaves no room for a prompt in the context of "
                         f"{context.tokens:,} tokens ({context.source}): give a --max-tokens below it"
                         + ("" if context.source == "--max-context" else " (or --max-context, if that is wrong)"))


def _context(tokens: int) -> "Context":
    from render.modeldir import Context
    return Context(tokens, "--max-context")


def parse_mode_option(values: Iterable[str]) -> tuple[str | None, dict[str, str]]:
    """--budget-mode MODE (all datasets) or NAME=MODE (one), like --budget. Raises ValueError."""
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


def _temperatures(text: str | None, generations: int) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        temperatures = tuple(parse_temperatures(text))
    except ValueError as exc:
        raise UsageError(f"--temperature: {exc}") from None
    if len(temperatures) > 1 and generations == 1:
        raise UsageError(f"--temperature {text}: a list goes with --generations N > 1 (generation k uses entry k "
                         "mod its length; one generation would use the first only)")
    return temperatures


def _chat_template(path: str | None) -> ChatTemplate | None:
    from render import RenderError
    from render.chat import read_chat_template
    if not path:
        return None
    try:
        return read_chat_template(path)
    except RenderError as exc:  # it names the file: "chat template file PATH: ..."
        raise UsageError(str(exc)) from None


def _template_kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"--chat-template-kwargs: not valid JSON ({exc})") from None
    if not isinstance(kwargs, dict):
        raise UsageError("--chat-template-kwargs: expected a JSON object")
    return kwargs
