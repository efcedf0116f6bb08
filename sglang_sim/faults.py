"""Fault injection, the pure part: which fault a /generate request gets, and the counters proving it.

Terminology
- settings: the rates and shapes in force (`FaultSettings`). They start from the SimConfig fields of
  the same names and are replaced live by `POST /sim/faults`.
- draw: one uniform number per /generate arrival, from the RNG `(fault_seed, arrival number)`, laid
  over consecutive bins `[errors by status][reset][hang][malformed][abort][no fault]`. The same seed
  and the same arrival order give the same faults, whatever the timing.
- immediate faults (errors, reset, hang, `html-502`) answer without touching the engine, as a
  failing proxy or front end would. Deferred ones (the other malformed kinds, abort) run a real
  generation first: the GPU time is spent, then the reply is mangled or cut.

The aiohttp side (shaping replies, outages, /sim/faults) is in fault_http.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

FaultKind = Literal["error", "reset", "hang", "malformed", "abort"]
OutageMode = Literal["503", "refuse"]

MALFORMED_KINDS: tuple[str, ...] = (
    "not-json",  # 200 whose body is not JSON
    "no-meta",  # 200 JSON without meta_info
    "tokens-negative",  # completion_tokens < 0
    "tokens-string",  # completion_tokens is a string
    "tokens-huge",  # completion_tokens > max_new_tokens
    "tokens-missing",  # no completion_tokens
    "html-502",  # a proxy's 502 HTML page, at once
    "truncated",  # Content-Length of the whole body, half of it written, then the connection closes
)
OUTAGE_MODES: tuple[OutageMode, ...] = ("503", "refuse")
# Seconds of per-second arrival counts kept for /sim/stats' requests_by_second.
RATE_WINDOW_SECONDS = 300
_RATE_FIELDS = ("reset_rate", "hang_rate", "malformed_rate", "abort_rate")


@dataclass(frozen=True)
class FaultSettings:
    """The live fault knobs; field names are those of SimConfig, the CLI and /sim/faults."""

    fault_seed: int = 0
    error_rates: tuple[tuple[int, float], ...] = ()  # (HTTP status, fraction of requests)
    retry_after: float | None = None  # seconds, sent on 429 and 503 answers
    reset_rate: float = 0.0
    hang_rate: float = 0.0
    malformed_rate: float = 0.0
    malformed_kinds: tuple[str, ...] = MALFORMED_KINDS
    abort_rate: float = 0.0
    outage_mode: OutageMode = "503"

    @classmethod
    def from_config(cls, cfg: Any) -> "FaultSettings":
        """The settings a server starts with, read from a SimConfig (sglang_sim/config.py, which imports this
        module: typed Any so the two do not import each other); fault_seed defaults to the server's seed."""
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)}
        if values["fault_seed"] is None:
            values["fault_seed"] = cfg.seed
        return cls(**values)

    @property
    def total_rate(self) -> float:
        """Fraction of /generate requests that get some fault."""
        return sum(r for _, r in self.error_rates) + sum(getattr(self, f) for f in _RATE_FIELDS)

    def problems(self) -> list[str]:
        """Every reason these settings are unusable; empty when fine."""
        problems = []
        for status, rate in self.error_rates:
            if not 400 <= status <= 599:
                problems.append(f"error_rates: status {status} is not a 4xx/5xx code")
            if not 0.0 <= rate <= 1.0:
                problems.append(f"error_rates: rate {rate} for {status} is not in [0, 1]")
        for name in _RATE_FIELDS:
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems.append(f"{name} must be in [0, 1]")
        if self.total_rate > 1.0 + 1e-9:
            problems.append(f"fault rates add up to {self.total_rate:g} > 1")
        if self.retry_after is not None and self.retry_after < 0:
            problems.append("retry_after must be >= 0")
        if not self.malformed_kinds or not set(self.malformed_kinds) <= set(MALFORMED_KINDS):
            problems.append(f"malformed_kinds must be a non-empty subset of {', '.join(MALFORMED_KINDS)}")
        if self.outage_mode not in OUTAGE_MODES:
            problems.append(f"outage_mode must be one of {', '.join(OUTAGE_MODES)}")
        return problems

    def as_json(self) -> dict[str, Any]:
        """The settings as GET /sim/faults shows them (error_rates as {"503": 0.1})."""
        return {
            "fault_seed": self.fault_seed,
            "error_rates": {str(s): r for s, r in self.error_rates},
            "retry_after": self.retry_after,
            "reset_rate": self.reset_rate,
            "hang_rate": self.hang_rate,
            "malformed_rate": self.malformed_rate,
            "malformed_kinds": list(self.malformed_kinds),
            "abort_rate": self.abort_rate,
            "outage_mode": self.outage_mode,
        }

    def updated(self, changes: Mapping[str, Any]) -> "FaultSettings":
        """A copy with the JSON `changes` (any subset of as_json's keys) applied; ValueError if bad."""
        values: dict[str, Any] = {}
        for key, raw in changes.items():
            if key == "fault_seed":
                values[key] = _json_int(key, raw)
            elif key == "error_rates":
                values[key] = _json_error_rates(raw)
            elif key == "retry_after":
                values[key] = None if raw is None else _json_number(key, raw)
            elif key in _RATE_FIELDS:
                values[key] = _json_number(key, raw)
            elif key == "malformed_kinds":
                values[key] = _json_kinds(raw)
            elif key == "outage_mode":
                values[key] = str(raw)
            else:
                raise ValueError(f"unknown fault setting {key!r}")
        new = dataclasses.replace(self, **values)
        problems = new.problems()
        if problems:
            raise ValueError("; ".join(problems))
        return new

    def cleared(self) -> "FaultSettings":
        """No fault at all; the seed, kinds, Retry-After and outage mode stay."""
        return dataclasses.replace(self, error_rates=(), reset_rate=0.0, hang_rate=0.0, malformed_rate=0.0, abort_rate=0.0)


@dataclass(frozen=True)
class Fault:
    """The fault drawn for one request. `cut` is the share of the output made before an abort."""

    kind: FaultKind
    status: int = 0
    malformed: str = ""
    cut: float = 0.0

    @property
    def immediate(self) -> bool:
        """Answered without running a generation."""
        return self.kind in ("error", "reset", "hang") or self.malformed == "html-502"


def draw(settings: FaultSettings, arrival: int) -> Fault | None:
    """The fault of the `arrival`-th /generate request (1-based), or None."""
    if settings.total_rate <= 0.0:
        return None  # the no-fault path builds no RNG
    rng = random.Random(f"{settings.fault_seed}:fault:{arrival}")
    u = rng.random()
    for status, rate in settings.error_rates:
        if u < rate:
            return Fault("error", status=status)
        u -= rate
    if u < settings.reset_rate:
        return Fault("reset")
    u -= settings.reset_rate
    if u < settings.hang_rate:
        return Fault("hang")
    u -= settings.hang_rate
    if u < settings.malformed_rate:
        return Fault("malformed", malformed=rng.choice(settings.malformed_kinds))
    u -= settings.malformed_rate
    if u < settings.abort_rate:
        return Fault("abort", cut=rng.random())
    return None


@dataclass
class FaultCounters:
    """What was injected so far; /sim/stats shows these at its top level."""

    requests_total: int = 0  # every /generate that reached the handler: 400s and faults included
    injected_errors: dict[int, int] = field(default_factory=dict)  # by status
    resets: int = 0
    hangs: int = 0  # hangs started (the ones still open are `hanging` in /sim/stats)
    malformed: dict[str, int] = field(default_factory=dict)  # by kind
    aborts_injected: int = 0
    outages_started: int = 0  # outage windows begun
    outage_rejected: int = 0  # /generate requests refused (503 or reset) because of an outage
    outage_cut: int = 0  # requests in flight (or hanging) when an outage began, ended by it

    def as_json(self) -> dict[str, Any]:
        """JSON-ready counters (status keys as strings)."""
        body = dataclasses.asdict(self)
        body["injected_errors"] = {str(s): n for s, n in sorted(self.injected_errors.items())}
        return body


class RequestRate:
    """Arrivals per whole second of uptime for the last `window` seconds, as [[second, count], ...].

    One deque entry per second that saw traffic, so the cost is O(1) per request. The request rate
    over [a, b) is the sum of counts with a <= second < b, divided by b - a.
    """

    def __init__(self, window: int = RATE_WINDOW_SECONDS) -> None:
        self._window = window
        self._counts: deque[list[int]] = deque()

    def add(self, second: int) -> None:
        """Count one arrival at `second` (seconds since start, nondecreasing)."""
        if self._counts and self._counts[-1][0] == second:
            self._counts[-1][1] += 1
        else:
            self._counts.append([second, 1])
            self._prune(second)

    def snapshot(self, now_second: int) -> list[list[int]]:
        """The counts of the last `window` seconds up to `now_second`."""
        self._prune(now_second)
        return [list(pair) for pair in self._counts]

    def _prune(self, now_second: int) -> None:
        while self._counts and self._counts[0][0] <= now_second - self._window:
            self._counts.popleft()


# -- parsing, shared by the CLI and /sim/faults ---------------------------------------------------


def parse_error_rate(text: str) -> tuple[int, float]:
    """`503=0.1` -> (503, 0.1); argparse type for --error-rate."""
    status, sep, rate = text.partition("=")
    try:
        if not sep:
            raise ValueError
        pair = int(status), float(rate)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected STATUS=RATE such as 503=0.1, got {text!r}") from None
    if not 400 <= pair[0] <= 599 or not 0.0 <= pair[1] <= 1.0:
        raise argparse.ArgumentTypeError(f"STATUS must be 400..599 and RATE in [0, 1], got {text!r}")
    return pair


def parse_outage(text: str) -> tuple[float, float]:
    """`10:5` -> (10.0, 5.0): an outage from 10 s after start, lasting 5 s; argparse type for --outage."""
    start, sep, duration = text.partition(":")
    try:
        if not sep:
            raise ValueError
        pair = float(start), float(duration)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected START:DURATION in seconds such as 10:5, got {text!r}") from None
    if pair[0] < 0 or pair[1] <= 0:
        raise argparse.ArgumentTypeError(f"START must be >= 0 and DURATION > 0, got {text!r}")
    return pair


def parse_kinds(text: str) -> tuple[str, ...]:
    """`truncated,no-meta` -> the kinds, checked; `all` means every kind."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if kinds == ("all",):
        return MALFORMED_KINDS
    bad = [k for k in kinds if k not in MALFORMED_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"malformed kinds must be among {', '.join(MALFORMED_KINDS)} (or all), got {text!r}")
    return kinds


def _json_number(key: str, raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ValueError(f"{key} must be a number, got {raw!r}")
    return float(raw)


def _json_int(key: str, raw: object) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f"{key} must be an integer, got {raw!r}")
    return raw


def _json_error_rates(raw: object) -> tuple[tuple[int, float], ...]:
    """{"503": 0.1} or [[503, 0.1]] -> ((503, 0.1),); replaces the whole map."""
    if isinstance(raw, dict):
        items: list[Any] = list(raw.items())
    elif isinstance(raw, list):
        items = raw
    else:
        raise ValueError(f"error_rates must be an object such as {{\"503\": 0.1}}, got {raw!r}")
    rates: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"error_rates: bad entry {item!r}")
        status, rate = item
        try:
            rates[int(status)] = _json_number("error_rates", rate)
        except (TypeError, ValueError):
            raise ValueError(f"error_rates: bad entry {item!r}") from None
    return tuple(rates.items())


def _json_kinds(raw: object) -> tuple[str, ...]:
    """["truncated", "no-meta"] or "truncated,no-meta" (or "all")."""
    if isinstance(raw, list) and all(isinstance(k, str) for k in raw):
        raw = ",".join(raw)
    if not isinstance(raw, str):
        raise ValueError(f"malformed_kinds must be a list of strings, got {raw!r}")
    try:
        return parse_kinds(raw)
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None
