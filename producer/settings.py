"""The settings, each resolved once as a frozen value: ``produce run``'s options (`RunSettings`), a dataset's
(``resolve``: `DatasetSettings`), what a run stores of them in run.json and how a rerun is compared with it, and
the order a dataset's prompts are sent in (`Order`), and the reasoning parser a run uses (`detect`, at the end:
``--reasoning-parser auto`` read from the tokenizer).

Options. Everything that can be wrong with the options alone is found here, before a file is read or Redis is
touched (exit 2, producer/errors.py UsageError); what needs the files (a --budget naming an unknown dataset) is
checked by `RunSettings.budgets_for` once they are read. docs/cli.md describes every option.

A dataset's settings. A response made under other settings would mix two distributions in one training set (and
two parsers, two splits of the same text, in one file), so a dataset's settings are stored when its run starts
and a rerun must give the same ones (producer/session/attach.py checks them before anything is written). The
settings carry the run format (``version``, budget/record.py VERSION): a run of another format is refused,
never read.

The order. The subset a budget keeps is the first prompts of the order. Public datasets are often sorted (by
source, topic, length, difficulty), so a budget that closes a dataset after 30% of it in file order keeps the
file's first 30%: a biased subset. ``--order random`` (the default) sends each dataset's prompts in a seeded
random order instead; ``--order file`` keeps the file's order. The permutation sorts prompts by a keyed hash of
(seed, id): BLAKE2b of the id, keyed with the seed. A prompt's place depends only on its own id and the seed,
never on the other ids or on the file's order, so:

- a rerun, a reattach, a budget raised later or a larger ``--max-samples`` extend the same selection: the
  first N of the order are always the same N prompts;
- adding or removing other prompts (a file that grew, a line now skipped) does not reorder the rest.

Token budgets given on the command line (`parse_amount`): ``10M``, ``500k``, ``1.5G``, ``10_000_000``.

A budget is an exact count of tokens, so parsing is exact too: ``decimal.Decimal`` with enough precision for the
input, never float (``1.1M`` is 1100000, not 1100000.0000000002). Accepted:

* digits, optionally grouped with single underscores between digits as in Python (``10_000_000``);
* an optional fraction (``1.5``), which must come out whole after the suffix (``1.0001k`` is rejected);
* an optional case-insensitive suffix k, M or G, powers of 1000 (``10m`` is ten million: nobody budgets in
  milli-tokens);
* surrounding whitespace.

``unlimited`` (or ``none``, any case) is a budget too in ``--budget``: explicitly none, which a rerun must be able
to say apart from no ``--budget`` at all (keep the stored one).

Rejected: signs, exponent notation (``1e6``: easy to mistype, and ``1e6M`` would be a puzzle; write ``1M``), NaN,
infinity, ``.5``, ``5.``, anything outside 0..MAX_AMOUNT. MAX_AMOUNT is the largest integer a float (Lua numbers,
JSON readers in other languages) holds exactly, so a budget survives every hop unrounded.
"""
from __future__ import annotations

import datetime
import decimal
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Iterable, Literal, Mapping, Sequence, TypeVar, Union

from budget.record import VERSION, ThinkPayload
from budget.urls import server_urls
from producer.errors import UsageError
from producer.generations import MIX_SETTING, Generations, MixError, TemplateMix, chunk_params, parse_temperatures
from producer.generations import SETTING as GENERATIONS
from producer.inputs.reader import valid_name
from producer.inputs.records import FieldMapping
from render.chat import ThinkMarkers

if TYPE_CHECKING:  # render.chat loads jinja2: not for `produce --help` (tests/redis/test_turns_producer.py)
    from budget.ledger import Mix
    from producer.generations import Variants
    from render.chat import ChatTemplate, Renderer
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
    #: AMOUNT may be UNLIMITED (producer/settings.py): explicitly none
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
        from budget.ledger import Mix
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


RANDOM: Final = "random"
FILE: Final = "file"
ORDERS: Final = (RANDOM, FILE)
DEFAULT_SEED: Final = 0


@dataclass(frozen=True)
class Order:
    mode: str = RANDOM
    seed: int = DEFAULT_SEED

    def setting(self) -> dict[str, Any]:
        """What run.json records (``order``)."""
        return {"mode": RANDOM, "seed": self.seed} if self.mode == RANDOM else {"mode": FILE}

    def describe(self) -> str:
        return f"random (seed {self.seed})" if self.mode == RANDOM else "file"


def rank(seed: int, sample_id: str) -> bytes:
    """The sort key of one prompt: BLAKE2b(id) keyed with the seed. 16 bytes: a collision is never seen in
    practice, and ties fall back to the id, so the order is a function of the ids and the seed alone."""
    key = str(seed).encode()
    return hashlib.blake2b(sample_id.encode("utf-8", "surrogatepass"), key=key, digest_size=16).digest()


T = TypeVar("T")


def permute(items: Sequence[T], order: Order, id_of: Any = None) -> list[T]:
    """``items`` in ``order``: as given for file order, else sorted by ``rank`` of each one's id
    (``id_of(item)``, default ``item.id``)."""
    if order.mode != RANDOM:
        return list(items)
    get = id_of or (lambda item: item.id)
    return sorted(items, key=lambda item: (rank(order.seed, get(item)), get(item)))


#: ``--turns``: regenerate every assistant turn of a conversation (``all``, budget/record.py ``plan``), or only
#: the answer to its last user turn on the dataset's own history (``last``).
ALL: Final = "all"
LAST: Final = "last"
TURNS: Final = (ALL, LAST)  # producer/cli.py spells them out, to keep `produce --help` light (tests check it)
#: The run.json key of the run format.
VERSION_KEY: Final = "version"
#: The run.json key of the run's ``--tokenizer`` (a directory made absolute, or a Hugging Face id as given), for
#: ``produce export`` to find it. Not a setting: a rerun may name the same tokenizer by another path (the
#: ``tokenizer`` fingerprint is what must not change), so it is left out of the comparison (`without_location`).
TOKENIZER_PATH: Final = "tokenizer_path"
#: The setting of a run's ``--chat-template FILE``: the sha256 of the template text (only with the option), and
#: the run.json key of the file's absolute path, not a setting, for ``produce export`` (as `TOKENIZER_PATH`).
CHAT_TEMPLATE: Final = "chat_template"
CHAT_TEMPLATE_PATH: Final = "chat_template_path"
_LOCATIONS: Final = (TOKENIZER_PATH, CHAT_TEMPLATE_PATH)


def run_json(stored: Mapping[str, Any], tokenizer: str | None,
             chat_template: ChatTemplate | None = None) -> dict[str, Any]:
    """What run.json holds: the stored settings, and where the run's tokenizer (`TOKENIZER_PATH`) and its
    ``--chat-template`` file (`CHAT_TEMPLATE_PATH`) are."""
    out = dict(stored)
    if tokenizer:
        path = Path(tokenizer).expanduser()
        out[TOKENIZER_PATH] = str(path.resolve()) if path.is_dir() else tokenizer
    if chat_template is not None:
        out[CHAT_TEMPLATE_PATH] = chat_template.path
    return out


def without_location(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A run.json's stored settings, without what is not a setting (`TOKENIZER_PATH`, `CHAT_TEMPLATE_PATH`)."""
    return {k: v for k, v in settings.items() if k not in _LOCATIONS}


def stored_settings(renderer: Renderer, sampling_params: dict[str, Any], chat_template_kwargs: dict[str, Any],
                 system_prompt: str | None, reasoning_parser: str, order: Order, turns: str,
                 mix: TemplateMix | None, chat_template: ChatTemplate | None = None) -> dict[str, Any]:
    """What must not change between a run and its resume (run.json, and the dataset's ``settings`` in Redis).
    ``template_kwargs_mix`` and ``chat_template`` (the --chat-template file's digest; its text is in the
    ``tokenizer`` fingerprint too) are there only when given; ``generations`` is added by ``resolve`` when above 1."""
    think = renderer.think
    settings = {
        VERSION_KEY: VERSION,
        "tokenizer": renderer.fingerprint(),
        "chat_template_kwargs": chat_template_kwargs,
        "sampling_params": sampling_params,
        "think": [think.start, think.end] if think else None,
        "system_prompt": system_prompt,
        "reasoning_parser": reasoning_parser,
        "order": order.setting(),
        "turns": turns,
    }
    if mix is not None:
        settings[MIX_SETTING] = mix.setting()
    if chat_template is not None:
        settings[CHAT_TEMPLATE] = chat_template.digest
    return settings


def settings_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            if key == "tokenizer":
                out.append("tokenizer or chat template differs")
            elif key == CHAT_TEMPLATE:
                was, now = (f"sha256 {d[:12]}" if d else "none" for d in (old.get(key), new.get(key)))
                out.append(f"--chat-template: stored {was}, now {now}")
            elif key == "sampling_params":
                a, b = old.get(key) or {}, new.get(key) or {}
                for p in sorted(set(a) | set(b)):
                    if a.get(p) != b.get(p):
                        out.append(f"{p}: stored {a.get(p)!r}, now {b.get(p)!r}")
            else:
                out.append(f"{key}: stored {old.get(key)!r}, now {new.get(key)!r}")
    return out


@dataclass(frozen=True)
class DatasetSettings:
    """A dataset's settings, resolved once (``resolve``) before it is rendered, and read as they are by every later
    step: selection, the settings check, the chunks, the loop, the plan. ``stored`` is what run.json and the
    dataset's ``settings`` in Redis hold."""

    order: Order
    turns: str  # ALL or LAST
    reasoning_parser: str
    chat_template_kwargs: Mapping[str, Any]
    mix: TemplateMix | None
    #: run.json's sampling parameters (a --temperature list stays a list), and what a chunk sends: the list's
    #: first entry, generation 0's (producer/generations.py; a later generation carries its own override).
    sampling_params: Mapping[str, Any]
    chunk_params: dict[str, Any]
    generations: Generations
    think: ThinkPayload | None  # the chat template's thinking markers
    stored: Mapping[str, Any]
    #: --tokenizer as given and --chat-template: where run.json points (``run_json``), and the files a multi-turn
    #: run stores for its workers (producer/session/attach.py ``share_tokenizer``).
    tokenizer: str
    chat_template: ChatTemplate | None
    #: --template-kwargs-mix: the renderer of each drawn combination (producer/generations.py); None: no mix.
    variants: Variants | None = None

    @property
    def max_new_tokens(self) -> int:
        return int(self.chunk_params["max_new_tokens"])


def resolve(s: RunSettings, renderer: Renderer, parser: str, variants: Variants | None = None) -> DatasetSettings:
    """The settings of a dataset of ``produce run`` ``s``, with the tokenizer's ``renderer``, the reasoning
    ``parser`` (given or detected) and the renderers of ``s``'s template mix: skip_special_tokens defaults to
    what the parser needs of this tokenizer (false when a marker it reads is one of its special tokens, issue 25)."""
    params = {**s.sampling_params(), "skip_special_tokens": s.skip_special_tokens if s.skip_special_tokens is not None
              else skip_special_tokens_default(parser, renderer.tokenizer)}
    kwargs = dict(s.chat_template_kwargs)
    stored = stored_settings(renderer, params, kwargs, s.mapping.system_prompt, parser, s.order, s.turns, s.template_mix,
                             s.chat_template)
    if s.generations > 1:
        stored[GENERATIONS] = s.generations
    think = renderer.think
    return DatasetSettings(order=s.order, turns=s.turns, reasoning_parser=parser, chat_template_kwargs=kwargs,
                           mix=s.template_mix, sampling_params=params, chunk_params=chunk_params(params),
                           generations=Generations.from_params(s.generations, params),
                           think={"start": think.start, "end": think.end} if think else None, stored=stored,
                           tokenizer=s.tokenizer, chat_template=s.chat_template, variants=variants)


MAX_AMOUNT = 2**53 - 1
SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_AMOUNT_RE = re.compile(r"([0-9]+(?:_[0-9]+)*(?:\.[0-9]+(?:_[0-9]+)*)?)([kKmMgG]?)")
_EXPONENT_RE = re.compile(r"[+-]?[0-9._]*[0-9][eE][+-]?[0-9]+[kKmMgG]?")
_EXAMPLES = "expected a whole number of tokens like 10M, 500k or 1500000"

#: ``--budget unlimited``: explicitly no budget, unlike no ``--budget`` (None: keep the stored budget).
UNLIMITED: Final = "unlimited"
#: A budget given on the command line: a number of tokens, or UNLIMITED.
Budget = Union[int, Literal["unlimited"]]
_UNLIMITED_WORDS = ("unlimited", "none")


def budget_limit(budget: Budget | None) -> int | None:
    """The limit the ledger is given (None: unlimited) of a ``--budget`` (None: not given, so none is known)."""
    return None if budget is None or budget == UNLIMITED else int(budget)


class _Bad(ValueError):
    """The reason alone; the public functions prefix the offending value."""


def parse_amount(text: str) -> int:
    """Parse one budget amount into a whole number of tokens; ValueError names the input and what is wrong."""
    try:
        return _parse(text)
    except _Bad as e:
        raise ValueError(f"invalid budget {_quote(text)}: {e}") from None


def parse_budget_option(values: tuple[str, ...]) -> tuple[Budget | None, dict[str, Budget]]:
    """Split repeated ``--budget`` values into (default for every dataset, per dataset name).

    ``AMOUNT`` sets the default (at most once); ``NAME=AMOUNT`` one dataset (at most once per name); an AMOUNT of
    ``unlimited`` is UNLIMITED. Whether every NAME is a dataset actually given is for the caller to check, which
    knows the datasets.
    """
    default: Budget | None = None
    per_name: dict[str, Budget] = {}
    for value in values:
        name, sep, amount_text = value.partition("=")
        name = name.strip()
        if sep and not valid_name(name):
            raise ValueError(f"invalid budget {_quote(value)}: {_quote(name)} is not a valid dataset name "
                             f'(letters, digits, "_" and "-" only, 1 to 64 characters)')
        text = amount_text if sep else value
        try:
            amount: Budget = UNLIMITED if text.strip().lower() in _UNLIMITED_WORDS else _parse(text)
        except _Bad as e:
            raise ValueError(f"invalid budget {_quote(value)}: {e}") from None
        if not sep:
            if default is not None:
                raise ValueError(f"invalid budget {_quote(value)}: a default budget (without NAME=) was already "
                                 f"given; use NAME=AMOUNT for one dataset")
            default = amount
        elif name in per_name:
            raise ValueError(f"invalid budget {_quote(value)}: dataset {_quote(name)} already has a budget")
        else:
            per_name[name] = amount
    return default, per_name


def _parse(text: str) -> int:
    stripped = text.strip()
    if not stripped:
        raise _Bad(f"empty; {_EXAMPLES}")
    match = _AMOUNT_RE.fullmatch(stripped)
    if match is None:
        if stripped.startswith("-") and _AMOUNT_RE.fullmatch(stripped[1:]):
            raise _Bad("must not be negative")
        if _EXPONENT_RE.fullmatch(stripped):
            raise _Bad("exponent notation is not supported; write 1M or 1000000 instead of 1e6")
        raise _Bad(_EXAMPLES)
    number, suffix = match.group(1).replace("_", ""), match.group(2).lower()
    # Precision enough for every digit of the input times the largest multiplier: the product is exact.
    context = decimal.Context(prec=len(number) + 12, traps=[decimal.Inexact, decimal.InvalidOperation])
    value = context.multiply(decimal.Decimal(number), decimal.Decimal(SUFFIXES[suffix]))
    if value != value.to_integral_value(context=context):
        detail = f" ({match.group(0)} = {value.normalize(context)})" if suffix else ""
        raise _Bad(f"not a whole number of tokens{detail}")
    if value > MAX_AMOUNT:
        raise _Bad(f"too large (at most {MAX_AMOUNT} tokens)")
    return int(value)


def _quote(text: str, limit: int = 60) -> str:
    """Quote user input for a message: bounded, and printable even if it holds control characters."""
    shown = text if len(text) <= limit else text[:limit] + "..."
    return '"' + shown.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'


_WEIGHT_RE = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def parse_mix(values: tuple[str, ...]) -> dict[str, Fraction]:
    """``--mix NAME=WEIGHT[,NAME=WEIGHT...]`` (repeatable) -> each dataset's weight, exact (docs/mix.md).

    A weight is a positive decimal number (``1``, ``2.5``); 0 is refused (leave the dataset out of the run), and so
    are a name given twice and an entry that is not NAME=WEIGHT. ValueError names the entry."""
    weights: dict[str, Fraction] = {}
    for value in values:
        for entry in value.split(","):
            name, sep, weight = (x.strip() for x in entry.partition("="))
            if not sep or not name:
                raise ValueError(f"invalid --mix entry {_quote(entry)}: expected NAME=WEIGHT, e.g. code=1,traces=2")
            if not valid_name(name):
                raise ValueError(f"invalid --mix entry {_quote(entry)}: {_quote(name)} is not a valid dataset name "
                                 f'(letters, digits, "_" and "-" only, 1 to 64 characters)')
            if not _WEIGHT_RE.fullmatch(weight):
                raise ValueError(f"invalid --mix entry {_quote(entry)}: the weight must be a positive number like "
                                 "1 or 2.5")
            w = Fraction(weight)
            if w == 0:
                raise ValueError(f"invalid --mix entry {_quote(entry)}: a weight of 0 gives the dataset nothing; "
                                 "leave it out of the run instead")
            if name in weights:
                raise ValueError(f"invalid --mix entry {_quote(entry)}: dataset {_quote(name)} already has a weight")
            weights[name] = w
    return weights


# -- the reasoning parser: ``--reasoning-parser NAME``, or ``auto``, detected from the tokenizer's chat template(s)
# and vocabulary for each family's markers (docs/models.md, "Detection"; SGLang's template_detection.py rules)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

AUTO: Final = "auto"
# DeepSeek-V3.1's template switches on a `thinking` variable ("if not thinking is defined", "if thinking"); the word
# alone (a comment, a system prompt) is not enough.
_THINKING_TOGGLE: Final = re.compile(
    r"\bthinking\s+is\s+(?:defined|not\s+defined|true|false)|\bif\s+(?:not\s+)?thinking\b")

#: The markers a parser's thinking block opens and closes with, for the rendered prompt's ``opens_think``; None:
#: the parser does not use it (gpt-oss reasoning is a harmony channel, "none" does not think).
PARSER_MARKERS: Final[Mapping[str, ThinkMarkers | None]] = {
    "qwen3": ThinkMarkers(), "qwen3-thinking": ThinkMarkers(), "deepseek-r1": ThinkMarkers(),
    "deepseek-v3": ThinkMarkers(), "glm45": ThinkMarkers(), "kimi_k2": ThinkMarkers(),
    "kimi": ThinkMarkers("◁think▷", "◁/think▷"), "gpt-oss": None, "none": None,
}


class AmbiguousParser(ValueError):
    """Detection found no single family; the message names the candidates and the option to choose one."""


@dataclass(frozen=True)
class Evidence:
    """What detection looks at: the template text(s) joined, and the vocabulary."""

    template: str
    vocab: frozenset[str]
    opens_think: bool  # a one-user-message prompt, rendered, ends inside an open <think>

    def has(self, marker: str) -> bool:
        return marker in self.template or marker in self.vocab


def evidence(tokenizer: PreTrainedTokenizerBase, opens_think: bool) -> Evidence:
    template = getattr(tokenizer, "chat_template", None) or ""
    text = template if isinstance(template, str) else "\n".join(str(t) for t in dict(template).values())
    return Evidence(text, frozenset(tokenizer.get_vocab()), opens_think)


def detect(ev: Evidence) -> str:
    """The one parser `ev` points to; raises AmbiguousParser naming the candidates otherwise."""
    families: list[str] = []
    if ev.has("<|channel|>"):
        families.append("gpt-oss")
    if ev.has("◁think▷"):
        families.append("kimi")
    if ev.has("<|tool_calls_section_begin|>"):
        families.append("kimi_k2")
    if ev.has("<arg_key>"):
        families.append("glm45")
    if ev.has("<｜Assistant｜>"):
        if _THINKING_TOGGLE.search(ev.template):
            families.append("deepseek-v3")
        elif ev.has("<think>"):
            families.append("deepseek-r1")
    if not families and ev.has("<think>"):
        if ev.has("<tool_call>"):
            families.append("qwen3-thinking" if ev.opens_think else "qwen3")
        else:
            raise AmbiguousParser(
                "cannot tell the reasoning parser from the tokenizer: it has <think> but none of the markers that "
                "tell the families apart (candidates: qwen3, qwen3-thinking, deepseek-r1); give "
                "--reasoning-parser NAME, the name the SGLang server was launched with")
    if len(families) > 1:
        raise AmbiguousParser(
            f"cannot tell the reasoning parser from the tokenizer: it has the markers of {', '.join(families)} "
            "(candidates: " + ", ".join(families) + "); give --reasoning-parser NAME, the name the SGLang server "
            "was launched with")
    return families[0] if families else "none"


def mismatches(parser: str, servers: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """Warnings for servers whose recorded ``--reasoning-parser`` differs from the run's (bq:server_info).

    SGLang's own parser only runs on its chat-completions path, which budgetq does not use, so a difference
    changes nothing in the data; it usually means the run names the wrong model family, so it is said.
    """
    out = []
    for entry in servers or []:
        theirs = entry.get("reasoning_parser")
        if theirs is not None and theirs != parser:
            out.append(f"server {entry.get('url', '?')} was launched with --reasoning-parser {theirs}, this run "
                       f"parses with {parser}: check that the run names the model's family")
    return out


#: The text markers each parser reads in a generated turn (worker/reasoning.py): if one of them is a special token
#: of the run's tokenizer, SGLang's detokenizer deletes it under the default skip_special_tokens=true, and the parser
#: no longer sees the thinking block or the tool call.
PARSER_TEXT_MARKERS: Final[Mapping[str, tuple[str, ...]]] = {
    "qwen3": ("<think>", "</think>", "<tool_call>", "</tool_call>"),
    "qwen3-thinking": ("<think>", "</think>", "<tool_call>", "</tool_call>"),
    "deepseek-r1": ("<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"),
    "deepseek-v3": ("<think>", "</think>", "<tool_call>", "</tool_call>", "<｜tool▁calls▁begin｜>",
                    "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"),
    "glm45": ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
              "</arg_value>"),
    "kimi": ("\u25c1think\u25b7", "\u25c1/think\u25b7"),
    "kimi_k2": ("<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
    "gpt-oss": ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>"),
    "none": (),
}


def special_markers(parser: str | None, tokenizer: Any) -> list[str]:
    """The markers `parser` reads that are special tokens of `tokenizer` (deleted from the text by
    skip_special_tokens=true)."""
    special = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    special.update(str(t.content) for t in decoder.values() if getattr(t, "special", False))
    return [m for m in PARSER_TEXT_MARKERS.get(str(parser), ()) if m in special]


def skip_special_tokens_default(parser: str | None, tokenizer: Any = None) -> bool:
    """The ``skip_special_tokens`` a run sends, decided from its tokenizer: false when a marker the parser reads
    is a special token there (harmony's always; Kimi-K2's tool-call section in the real tokenizer), so that the
    text keeps it; otherwise SGLang's default, true (EOS and other special tokens left out of ``text``). SGLang's
    own chat path sends false whenever tools are declared and for gpt-oss; budgetq asks the tokenizer instead,
    so a family whose markers are plain added tokens keeps the default. Without a tokenizer: the harmony rule
    alone (worker.reasoning.skip_special_tokens_for)."""
    if parser == "gpt-oss":
        return False
    return tokenizer is None or not special_markers(parser, tokenizer)
