"""The simulator's settings: one frozen dataclass, and the argparse front end that fills it.

Every knob of the model lives here so the engine, the text generator and the HTTP layer receive one
`SimConfig` as a parameter and read nothing from the environment.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Sequence, cast

from sglang_sim.faults import (
    MALFORMED_KINDS,
    OUTAGE_MODES,
    FaultSettings,
    OutageMode,
    parse_error_rate,
    parse_kinds,
    parse_outage,
)

LengthDist = Literal["lognormal", "exponential", "fixed"]
ReasoningStyle = Literal["open", "full", "none", "qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45",
                         "kimi", "kimi_k2", "gpt-oss"]

LENGTH_DISTS: tuple[LengthDist, ...] = ("lognormal", "exponential", "fixed")
REASONING_STYLES: tuple[ReasoningStyle, ...] = ("open", "full", "none", "qwen3", "qwen3-thinking", "deepseek-r1",
                                                "deepseek-v3", "glm45", "kimi", "kimi_k2", "gpt-oss")
#: The styles named after a model family (sglang_sim/families.py): they need --tokenizer.
FAMILY_STYLES: tuple[ReasoningStyle, ...] = REASONING_STYLES[3:]

# Token ids of the thinking markers, as in the Qwen3 vocabulary, so output_ids look like a real model's.
THINK_OPEN_ID = 151667
THINK_CLOSE_ID = 151668
# Pseudo-words get ids from here upwards; small ids stay free for EOS/BOS-like specials.
WORD_ID_BASE = 1000
# How many distinct pseudo-words the lexicon holds (ids WORD_ID_BASE .. WORD_ID_BASE + LEXICON_SIZE - 1).
LEXICON_SIZE = 4096


@dataclass(frozen=True)
class SimConfig:
    """All parameters of one simulated SGLang server. Defaults mirror a mid-size GPU deployment."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    # Contract
    eos_id: int = 2
    context_length: int = 32768
    # Output lengths and text
    seed: int = 0
    length_dist: LengthDist = "lognormal"
    mean_tokens: float = 300.0
    sigma: float = 0.8
    reasoning_style: ReasoningStyle = "open"
    reasoning_fraction: float = 0.6
    # A tokenizer directory: output_ids are the real ids of the generated text (sglang_sim/families.py)
    tokenizer: str | None = None
    # --turn-length-scale: the drawn length times entry k (the last entry for later turns) for a prompt that holds k
    # earlier assistant turns (a conversation's turn k): answers whose length depends on their place in the
    # conversation, as in real multi-turn data. Needs --tokenizer (the prompt is decoded to count them). () = off.
    turn_length_scale: tuple[float, ...] = ()
    # --length-scale-by-text: (TEXT, F) pairs; a request whose decoded prompt contains TEXT answers with the drawn
    # length times F (the first pair that matches; none: 1). Datasets whose answers differ in length, as real ones
    # do (~5x), told apart by what their prompts say. Needs --tokenizer (the prompt is decoded). () = off.
    length_scale_by_text: tuple[tuple[str, float], ...] = ()
    # Speed model (simulated seconds; all divided by time_scale on the wall clock)
    tokens_per_second_per_request: float = 1000.0
    saturation_batch: int = 64
    max_running: int = 256
    prefill_tokens_per_second: float = 0.0
    time_scale: float = 1.0
    zero_latency: bool = False
    # Prefix cache: pages of `prefix_cache_page` tokens, at most `prefix_cache_pages` of them (0 = off)
    prefix_cache_page: int = 16
    prefix_cache_pages: int = 200_000
    # How often (wall seconds) in-flight requests are checked for a vanished client, as a backstop to
    # aiohttp's handler cancellation (SGLang itself checks about every 4 s).
    disconnect_check_interval: float = 1.0
    # Wall seconds after start during which /health answers 503, as SGLang does until its warm-up request
    # has run (ServerStatus.Starting); /generate is served meanwhile, as there.
    warmup_seconds: float = 0.0
    # Fault injection (see faults.py and docs/simulator.md); all off by default.
    fault_seed: int | None = None  # None = seed
    error_rates: tuple[tuple[int, float], ...] = ()  # (status, fraction of /generate requests)
    retry_after: float | None = None  # Retry-After seconds on 429/503 answers
    reset_rate: float = 0.0
    hang_rate: float = 0.0
    malformed_rate: float = 0.0
    malformed_kinds: tuple[str, ...] = MALFORMED_KINDS
    abort_rate: float = 0.0
    outages: tuple[tuple[float, float], ...] = ()  # (start, duration), wall seconds since start
    outage_mode: OutageMode = "503"
    # Poison samples: every /generate whose rid starts with one of these hangs (as --hang-rate's hang), every
    # attempt, so a test can kill the worker that runs it each time (docs/simulator.md).
    hang_rid_prefixes: tuple[str, ...] = ()
    # Evidence for tests and benchmarks: append one JSON line per answered /generate (rid, input_ids, output_ids,
    # finish_reason, completion_tokens, port) to this file, so a test can see what each request was sent from the
    # server's side (docs/simulator.md, "Request log"). None = no log.
    request_log: str | None = None
    # The model's vocabulary size: reported in /server_info as `vocab_size` (SGLang 0.5.23 reports none; budgetq's
    # producer checks prompts against it when a server says, budget/serverinfo.py). None = unknown, nothing reported.
    vocab_size: int | None = None
    # Die as SGLang does on an input id past its embedding (vocab_size padded to a multiple of 64; or < 0): IndexError,
    # and the scheduler's death takes the whole server down, every connection dropped, the port closed. Off.
    oov_crash: bool = False

    def __post_init__(self) -> None:
        problems = validate(self)
        if problems:
            raise ValueError("; ".join(problems))

    def replace(self, **changes: object) -> "SimConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def validate(cfg: SimConfig) -> list[str]:
    """Every reason `cfg` is unusable; empty when it is fine."""
    problems = _style_problems(cfg)
    problems += _range_problems(cfg)
    problems += _eos_problems(cfg)
    problems += FaultSettings.from_config(cfg).problems()
    problems += _evidence_problems(cfg)
    return problems


def _style_problems(cfg: SimConfig) -> list[str]:
    """The output's shape: length distribution, reasoning style, and what needs a tokenizer."""
    problems = []
    if cfg.length_dist not in LENGTH_DISTS:
        problems.append(f"length_dist must be one of {LENGTH_DISTS}")
    if cfg.reasoning_style not in REASONING_STYLES:
        problems.append(f"reasoning_style must be one of {REASONING_STYLES}")
    if cfg.reasoning_style in FAMILY_STYLES and cfg.tokenizer is None:
        problems.append(f"reasoning_style {cfg.reasoning_style} needs --tokenizer (its markers are real tokens)")
    if cfg.turn_length_scale and cfg.tokenizer is None:
        problems.append("turn_length_scale needs --tokenizer (the prompt is decoded to count its assistant turns)")
    if any(not x > 0 for x in cfg.turn_length_scale):
        problems.append("turn_length_scale entries must be > 0")
    if cfg.length_scale_by_text and cfg.tokenizer is None:
        problems.append("length_scale_by_text needs --tokenizer (the prompt is decoded to find the text)")
    if any(not text or not f > 0 for text, f in cfg.length_scale_by_text):
        problems.append("length_scale_by_text needs a non-empty TEXT and a factor > 0")
    return problems


def _range_problems(cfg: SimConfig) -> list[str]:
    """The numeric settings of lengths, speed, cache and timing: (out of range?, message), in order."""
    checks = (
        (not 0.0 <= cfg.reasoning_fraction <= 1.0, "reasoning_fraction must be in [0, 1]"),
        (cfg.mean_tokens < 1, "mean_tokens must be >= 1"),
        (cfg.sigma < 0, "sigma must be >= 0"),
        (cfg.tokens_per_second_per_request <= 0, "tokens_per_second_per_request must be > 0"),
        (cfg.saturation_batch < 1 or cfg.max_running < 1, "saturation_batch and max_running must be >= 1"),
        (cfg.prefill_tokens_per_second < 0, "prefill_tokens_per_second must be >= 0 (0 = free prefill)"),
        (cfg.time_scale <= 0, "time_scale must be > 0"),
        (cfg.context_length < 2, "context_length must be >= 2"),
        (cfg.prefix_cache_page < 1 or cfg.prefix_cache_pages < 0,
         "prefix_cache_page must be >= 1 and prefix_cache_pages >= 0"),
        (cfg.disconnect_check_interval <= 0, "disconnect_check_interval must be > 0"),
        (cfg.warmup_seconds < 0, "warmup_seconds must be >= 0"),
    )
    return [message for bad, message in checks if bad]


def _eos_problems(cfg: SimConfig) -> list[str]:
    """eos_id must not collide with the ids the simulator emits itself."""
    if cfg.eos_id < 0 or cfg.eos_id in (THINK_OPEN_ID, THINK_CLOSE_ID) or (
        WORD_ID_BASE <= cfg.eos_id < WORD_ID_BASE + LEXICON_SIZE
    ):
        return [(
            f"eos_id must be >= 0 and outside the simulator's own ids ({WORD_ID_BASE}.."
            f"{WORD_ID_BASE + LEXICON_SIZE - 1}, {THINK_OPEN_ID}, {THINK_CLOSE_ID})"
        )]
    return []


def _evidence_problems(cfg: SimConfig) -> list[str]:
    """The request log, poison rids, vocabulary and outages (checked after the faults): (wrong?, message)."""
    checks = (
        (cfg.request_log is not None and not cfg.request_log, "request_log must be a file path"),
        (any(not prefix for prefix in cfg.hang_rid_prefixes), "hang_rid_prefixes must not be empty strings"),
        (cfg.vocab_size is not None and cfg.vocab_size <= 0, "vocab_size must be > 0"),
        (cfg.oov_crash and cfg.vocab_size is None,
         "oov_crash needs vocab_size (the ids at or above it are the ones that kill the server)"),
        (any(start < 0 or duration <= 0 for start, duration in cfg.outages),
         "outages need START >= 0 and DURATION > 0"),
    )
    return [message for bad, message in checks if bad]


def build_parser() -> argparse.ArgumentParser:
    """The `sglang-sim` command line; option names follow the SimConfig fields."""
    d = SimConfig()
    p = argparse.ArgumentParser(
        prog="sglang-sim",
        description="A CPU-cheap simulator of SGLang's native /generate HTTP API.",
        epilog="Example: sglang-sim --port 30000 --time-scale 20 --mean-tokens 500",
    )
    p.add_argument("--host", default=d.host, help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="TCP port, 0 = any free one (default %(default)s)")
    p.add_argument("--api-key", default=d.api_key, help="require 'Authorization: Bearer KEY' (like SGLang)")
    p.add_argument("--eos-id", type=int, default=d.eos_id, help="token id ending a stopped output (default %(default)s)")
    p.add_argument("--context-length", type=int, default=d.context_length,
                   help="context window: a prompt reaching it, or a prompt plus max_new_tokens over it, is refused with 400 (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="RNG seed for lengths and words (default %(default)s)")
    p.add_argument("--length-dist", choices=LENGTH_DISTS, default=d.length_dist,
                   help="distribution of the natural output length (default %(default)s)")
    p.add_argument("--mean-tokens", type=float, default=d.mean_tokens, help="mean natural output length (default %(default)s)")
    p.add_argument("--sigma", type=float, default=d.sigma, help="lognormal shape (default %(default)s)")
    p.add_argument("--reasoning", action=argparse.BooleanOptionalAction, default=True,
                   help="emit a reasoning part closed by </think> (default on; --no-reasoning = style none)")
    p.add_argument("--reasoning-style", choices=REASONING_STYLES, default=d.reasoning_style,
                   help="open: 'r</think>a' (prompt ends with <think>), full: '<think>r</think>a', none, or a model "
                        "family (qwen3, qwen3-thinking, deepseek-r1, deepseek-v3, glm45, kimi, kimi_k2, gpt-oss: "
                        "its format and tool calls; needs --tokenizer) (default %(default)s)")
    p.add_argument("--turn-length-scale", type=_scales, default=d.turn_length_scale, metavar="F[,F...]",
                   help="multiply the drawn length by entry k (the last entry beyond) when the prompt holds k earlier "
                        "assistant turns: a conversation's turn k (needs --tokenizer; ChatML, GLM and harmony "
                        "assistant headers are counted)")
    p.add_argument("--length-scale-by-text", dest="length_scale_by_text", type=_text_scale, action="append",
                   metavar="TEXT=F",
                   help="multiply the drawn length by F when the decoded prompt contains TEXT (repeatable; the first "
                        "that matches wins): datasets with lengths of their own, told apart by their prompts "
                        "(needs --tokenizer)")
    p.add_argument("--tokenizer", default=d.tokenizer, metavar="DIR",
                   help="tokenizer directory: output_ids are the real ids of the text, and skip_special_tokens "
                        "decides whether special tokens stay in text (default: pseudo-word ids)")
    p.add_argument("--reasoning-fraction", type=float, default=d.reasoning_fraction,
                   help="share of output tokens spent reasoning (default %(default)s)")
    p.add_argument("--tokens-per-second-per-request", type=float, default=d.tokens_per_second_per_request,
                   help="decode speed of one request while the batch is below saturation (default %(default)s)")
    p.add_argument("--saturation-batch", type=int, default=d.saturation_batch,
                   help="running requests beyond which aggregate throughput stops growing (default %(default)s)")
    p.add_argument("--max-running", type=int, default=d.max_running,
                   help="requests decoded at once; more wait in a FIFO queue (default %(default)s)")
    p.add_argument("--prefill-tokens-per-second", type=float, default=d.prefill_tokens_per_second,
                   help="serial prefill speed for uncached prompt tokens, 0 = free (default %(default)s)")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="divide every simulated duration by this (default %(default)s)")
    p.add_argument("--zero-latency", action="store_true", help="answer at once (overhead benchmarks)")
    p.add_argument("--prefix-cache-page", type=int, default=d.prefix_cache_page,
                   help="prefix cache granularity in tokens (default %(default)s)")
    p.add_argument("--prefix-cache-pages", type=int, default=d.prefix_cache_pages,
                   help="prefix cache capacity in pages, 0 = no cache (default %(default)s)")
    p.add_argument("--disconnect-check-interval", type=float, default=d.disconnect_check_interval,
                   help="seconds between sweeps for vanished clients (default %(default)s)")
    p.add_argument("--warmup-seconds", type=float, default=d.warmup_seconds,
                   help="/health answers 503 for this long after start, like SGLang before its warm-up (default %(default)s)")
    p.add_argument("--request-log", default=d.request_log, metavar="PATH",
                   help="append one JSON line per answered /generate (rid, input_ids, output_ids, text, finish_reason, "
                        "completion_tokens, port), flushed per line; several servers may share one file")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, metavar="N",
                   help="the model's vocabulary size, reported in /server_info as vocab_size (default: none)")
    p.add_argument("--oov-crash", action="store_true",
                   help="die as SGLang does on an input id past its embedding (--vocab-size padded to a multiple of 64): "
                        "IndexError, every connection dropped, the port closed, the process exits 1")
    add_fault_options(p)
    return p


def add_fault_options(p: argparse.ArgumentParser) -> None:
    """The fault-injection options; each rate is a fraction of /generate requests."""
    g = p.add_argument_group("fault injection", "Example: sglang-sim --error-rate 503=0.1 --retry-after 2 "
                             "--reset-rate 0.02 --outage 30:10")
    g.add_argument("--fault-seed", type=int, default=None, help="RNG seed of the fault draws (default: --seed)")
    g.add_argument("--error-rate", dest="error_rates", metavar="STATUS=P", type=parse_error_rate, action="append",
                   help="answer this share of requests with STATUS at once, SGLang's error shape (repeatable)")
    g.add_argument("--retry-after", type=float, default=None, metavar="SECONDS",
                   help="send Retry-After on 429 and 503 answers")
    g.add_argument("--reset-rate", type=float, default=0.0, metavar="P", help="close the connection without an answer")
    g.add_argument("--hang-rate", type=float, default=0.0, metavar="P",
                   help="never answer (until the client leaves or the server stops)")
    g.add_argument("--malformed-rate", type=float, default=0.0, metavar="P", help="mangle the reply")
    g.add_argument("--malformed-kind", dest="malformed_kinds", type=parse_kinds, action="append",
                   metavar="KIND[,KIND]", help=f"which manglings (repeatable; default all): {', '.join(MALFORMED_KINDS)}")
    g.add_argument("--abort-rate", type=float, default=0.0, metavar="P",
                   help="run, then end with finish_reason abort (HTTP 200) part-way")
    g.add_argument("--outage", dest="outages", metavar="START:DURATION", type=parse_outage, action="append",
                   help="wall seconds after start: /generate and /health fail for DURATION (repeatable)")
    g.add_argument("--hang-rid-prefix", dest="hang_rid_prefixes", metavar="PREFIX", action="append",
                   help="never answer a /generate whose rid starts with PREFIX, on every attempt: a poison sample "
                        "(repeatable; budget.record.request_id's first 28 characters name a sample)")
    g.add_argument("--outage-mode", choices=OUTAGE_MODES, default="503",
                   help="503: answer 503 at once; refuse: close the listening socket (default %(default)s)")


def _scales(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of numbers") from None


def _text_scale(entry: str) -> tuple[str, float]:
    text, sep, factor = entry.rpartition("=")
    try:
        if not sep or not text:
            raise ValueError
        return text, float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{entry!r}: TEXT=F, F a number") from None


def from_argv(argv: Sequence[str] | None = None) -> SimConfig:
    """Parse a command line into a SimConfig; bad values exit with argparse's usage error."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    style = cast(ReasoningStyle, ns.reasoning_style if ns.reasoning else "none")
    fields = {f.name for f in dataclasses.fields(SimConfig)}
    values: dict[str, Any] = {k: v for k, v in vars(ns).items() if k in fields}
    values["reasoning_style"] = style
    # Repeatable options arrive as lists (None when absent); the last --error-rate for a status wins.
    values["error_rates"] = tuple(dict(ns.error_rates or ()).items())
    values["outages"] = tuple(ns.outages or ())
    values["hang_rid_prefixes"] = tuple(ns.hang_rid_prefixes or ())
    values["length_scale_by_text"] = tuple(ns.length_scale_by_text or ())
    kinds = [k for group in ns.malformed_kinds or () for k in group]
    values["malformed_kinds"] = tuple(dict.fromkeys(kinds)) or MALFORMED_KINDS
    try:
        return SimConfig(**values)
    except ValueError as e:
        parser.error(str(e))
