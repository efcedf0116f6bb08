"""Worker settings, read from the environment once when a worker starts.

Workers are started by plain ``rq worker`` commands, so the environment is their only configuration channel.
The API key is kept here in memory and sent as a bearer token; it is never written to Redis or a log.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

from budget.urls import DEFAULT_SGLANG_URL, server_urls


def _number(env: Mapping[str, str], name: str, parse: Callable[[str], float], *, zero_ok: bool,
            what: str) -> float | None:
    """The variable as a number, None when unset or empty; a bad value is an error that names the variable (a
    worker that silently ran on a default would be worse than one that does not start)."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {what}") from None
    if not (value >= 0 if zero_ok else value > 0):  # written so that NaN fails too
        raise ValueError(f"{name}={raw!r}: must be {'0 or more' if zero_ok else 'positive'}")
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = _number(env, name, int, zero_ok=False, what="a whole number")
    return default if value is None else int(value)


def _optional_int(env: Mapping[str, str], name: str) -> int | None:
    value = _number(env, name, int, zero_ok=False, what="a whole number")
    return None if value is None else int(value)


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    value = _number(env, name, float, zero_ok=False, what="a number of seconds")
    return default if value is None else value


def _nonneg(env: Mapping[str, str], name: str, default: float) -> float:
    value = _number(env, name, float, zero_ok=True, what="a number")
    return default if value is None else value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}: expected 1 or 0 (true/false), got {raw!r}")


@dataclass(frozen=True)
class WorkerConfig:
    servers: tuple[str, ...] = (DEFAULT_SGLANG_URL,)
    api_key: str | None = field(default=None, repr=False)
    # requests in flight per worker process; None (BUDGETQ_CONCURRENCY unset): the automatic window, its share of
    # what its SGLang servers run at once, following their load (worker/window.py)
    concurrency: int | None = None
    max_attempts: int = 5  # per sample: unusable answers (aborts, broken bodies) tolerated
    retry_for: float = 600.0  # seconds a sample keeps retrying an unavailable server (5xx, 429, resets, timeouts)
    connect_timeout: float = 10.0
    request_timeout: float | None = None  # None: sized per request from max_new_tokens
    min_tokens_per_second: float = 5.0  # the slowest decode we wait for before calling a request hung
    backoff_cap: float = 20.0
    reserve_interval: float = 1.0  # seconds between predict-mode reservation updates of a running chunk
    predict_margin: float = 1.0  # predict admits while used + reserved + k x sd x sqrt(in flight) < budget
    # ... and, while requests are in flight, only if used + reserved + E[L] + t x sd x sqrt(in flight + 1) <= budget
    # (the taper, docs/budget.md); 0 turns it off
    predict_taper: float = 2.0
    # each predict reservation adds z standard errors of the length model's own estimate (worker/estimate.py
    # LengthModel.reserve): the model's error is shared by every request in flight, so it adds up as n, not
    # sqrt(n), and early in a run it is what overshoots small budgets; 0 reserves the plain estimate
    predict_model_error: float = 1.0
    # a conversation's next turn goes to the server of its previous turn while that one is healthy and not much
    # busier than the least busy (its prompt repeats the previous one: SGLang's prefix cache holds it)
    affinity: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "WorkerConfig":
        env = os.environ if env is None else env
        return cls(
            servers=server_urls(env.get("SGLANG_URL", DEFAULT_SGLANG_URL), "SGLANG_URL"),
            api_key=env.get("SGLANG_API_KEY") or None,
            concurrency=_optional_int(env, "BUDGETQ_CONCURRENCY"),
            max_attempts=_int(env, "BUDGETQ_MAX_ATTEMPTS", cls.max_attempts),
            retry_for=_nonneg(env, "BUDGETQ_RETRY_FOR", cls.retry_for),
            connect_timeout=_float(env, "BUDGETQ_CONNECT_TIMEOUT", cls.connect_timeout),
            request_timeout=_number(env, "BUDGETQ_REQUEST_TIMEOUT", float, zero_ok=False, what="a number of seconds"),
            min_tokens_per_second=_float(env, "BUDGETQ_MIN_TOKENS_PER_SECOND", cls.min_tokens_per_second),
            backoff_cap=_float(env, "BUDGETQ_BACKOFF_CAP", cls.backoff_cap),
            reserve_interval=_float(env, "BUDGETQ_RESERVE_INTERVAL", cls.reserve_interval),
            predict_margin=_nonneg(env, "BUDGETQ_PREDICT_MARGIN", cls.predict_margin),
            predict_taper=_nonneg(env, "BUDGETQ_PREDICT_TAPER", cls.predict_taper),
            predict_model_error=_nonneg(env, "BUDGETQ_PREDICT_MODEL_ERROR", cls.predict_model_error),
            affinity=_flag(env, "BUDGETQ_AFFINITY", cls.affinity),
        )
