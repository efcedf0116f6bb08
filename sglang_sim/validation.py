"""Checking a /generate body the way SGLang 0.5.23 does, with SGLang's three error shapes.

SGLang answers 400 in three different bodies depending on which layer refused the request (see
reference/sglang-generate.md): FastAPI type validation gives the OpenAI-like object, a JSON
contract violation (an unknown sampling key) gives `{"error": "..."}`, and a ValueError from the
tokenizer manager (bad value, context overflow, duplicate rid) gives `{"error": {"message": ...}}`.
Clients branch on these shapes, so the simulator reproduces each one where SGLang would use it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from sglang_sim.config import SimConfig
from sglang_sim.textgen import pseudo_tokenize

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default, not the 16 some docs still show

_INT_KEYS = ("max_new_tokens", "top_k", "min_new_tokens", "n", "sampling_seed")
_FLOAT_KEYS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
_BOOL_KEYS = ("ignore_eos", "skip_special_tokens", "no_stop_trim")
_LIST_KEYS = ("stop", "stop_token_ids")
KNOWN_SAMPLING_KEYS = frozenset(_INT_KEYS + _FLOAT_KEYS + _BOOL_KEYS + _LIST_KEYS)
# Every key of SGLang 0.5.23's SamplingParams (sglang/api/v1/api_types.py), in its order: the ones above are
# checked and used, the others accepted and ignored; any other key is refused with SGLang's own message.
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)


class ApiError(Exception):
    """A refusal to send back as-is: HTTP status plus JSON body."""

    def __init__(self, status: int, body: Mapping[str, Any]) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body


def type_error(message: str) -> ApiError:
    """FastAPI/pydantic validation failure, rendered by SGLang's RequestValidationError handler."""
    return ApiError(400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


def contract_error(message: str) -> ApiError:
    """0.5.23's JSON contract violation shape."""
    return ApiError(400, {"error": message})


def value_error(message: str, status: int = 400) -> ApiError:
    """A ValueError raised inside SGLang's tokenizer manager, as http_server returns it."""
    return ApiError(status, {"error": {"message": message}})


@dataclass(frozen=True)
class GenerateSpec:
    """A validated single-prompt /generate request."""

    prompt: list[int] | list[str]  # token ids, or pseudo-tokens of a text prompt
    raw_prompt: list[int] | str
    rid: str | None
    max_new_tokens: int  # already capped by the context length when the client sent null
    min_new_tokens: int
    ignore_eos: bool
    sampling_seed: int | None
    greedy: bool
    skip_special_tokens: bool = True  # SGLang's default: special tokens left out of `text`
    #: the request's sampling_params as sent (for the request log: which temperature and seed a request asked for)
    sampling_params: dict[str, Any] | None = None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _all_ints(values: list[Any]) -> bool:
    # map/set run in C: this check is on the hot path for every prompt token.
    return set(map(type, values)) <= {int}


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_types(body: Mapping[str, Any]) -> None:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and not (isinstance(text, str) or (isinstance(text, list) and all(isinstance(t, str) for t in text))):
        raise type_error("text: Input should be a valid string or list of strings")
    if ids is not None and not (
        isinstance(ids, list)
        and (_all_ints(ids) or all(isinstance(r, list) and _all_ints(r) for r in ids))
    ):
        raise type_error("input_ids: Input should be a valid list of integers or list of lists of integers")
    sp = body.get("sampling_params")
    if sp is not None and not isinstance(sp, (dict, list)):
        raise type_error("sampling_params: Input should be a valid dictionary or list of dictionaries")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, (str, list)):
        raise type_error("rid: Input should be a valid string or list of strings")
    for key in ("stream", "return_logprob"):
        if body.get(key) is not None and not isinstance(body[key], (bool, list)):
            raise type_error(f"{key}: Input should be a valid boolean")


def _check_sampling_types(sp: Mapping[str, Any]) -> None:
    """Unknown keys first, then each known key's type."""
    unknown = [k for k in sp if k not in SGLANG_SAMPLING_KEYS]
    if unknown:  # serde's text, as api_types.decode_SamplingParams words it
        listed = ", ".join(f"`{k}`" for k in SGLANG_SAMPLING_KEYS)
        raise contract_error(f"unknown field `{unknown[0]}`, expected one of {listed}")
    for k, v in sp.items():
        if v is None or k not in KNOWN_SAMPLING_KEYS:
            continue
        ok = (
            (k in _INT_KEYS and _is_int(v))
            or (k in _FLOAT_KEYS and _is_number(v))
            or (k in _BOOL_KEYS and isinstance(v, bool))
            or (k == "stop" and (isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))))
            or (k == "stop_token_ids" and isinstance(v, list) and _all_ints(v))
        )
        if not ok:
            raise type_error(f"sampling_params.{k}: Input has the wrong type, got {v!r}")


def _check_sampling(sp: Mapping[str, Any]) -> dict[str, Any]:
    """Types, then unknown keys, then SamplingParams.verify()'s ranges; returns the values with defaults."""
    _check_sampling_types(sp)

    def num(key: str, default: float) -> float:
        # As given, not float(): SGLang's messages print what was sent ("got -1.", not "got -1.0.").
        v = sp.get(key)
        return default if v is None else v  # type: ignore[no-any-return]

    temperature, top_p, min_p = num("temperature", 1.0), num("top_p", 1.0), num("min_p", 0.0)
    freq, pres, rep = num("frequency_penalty", 0.0), num("presence_penalty", 0.0), num("repetition_penalty", 1.0)
    top_k = sp.get("top_k")
    top_k = -1 if top_k is None else top_k
    min_new = sp.get("min_new_tokens") or 0
    max_new = sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    n = sp.get("n")
    # SamplingParams.verify()'s order: the first range that fails is the one reported. Predicates, not values,
    # so that a check after a None test (max_new_tokens) is only evaluated when the one before it passed.
    ranges = (
        (lambda: not math.isfinite(temperature) or temperature < 0,
         f"temperature must be a non-negative finite number, got {temperature}."),
        (lambda: not 0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}."),
        (lambda: not 0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}."),
        (lambda: top_k != -1 and top_k < 1, f"top_k must be -1 (disable) or at least 1, got {top_k}."),
        (lambda: not -2.0 <= freq <= 2.0, f"frequency_penalty must be in [-2, 2], got {freq}."),
        (lambda: not -2.0 <= pres <= 2.0, f"presence_penalty must be in [-2, 2], got {pres}."),
        (lambda: not 0.0 < rep <= 2.0, f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rep}."),
        (lambda: min_new < 0, f"min_new_tokens must be in [0, max_new_tokens], got {min_new}."),
        (lambda: max_new is not None and max_new < 0, f"max_new_tokens must be at least 0, got {max_new}."),
        (lambda: max_new is not None and min_new > max_new,
         f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}."),
        (lambda: n is not None and n != 1, f"n must be 1 in sglang-sim (n > 1 is not simulated), got {n}."),
    )
    for bad, message in ranges:
        if bad():
            raise value_error(message)
    return {
        "max_new_tokens": max_new,
        "min_new_tokens": min_new,
        "ignore_eos": bool(sp.get("ignore_eos")),
        "sampling_seed": sp.get("sampling_seed"),
        "greedy": temperature == 0.0,
        "skip_special_tokens": sp.get("skip_special_tokens", True) is not False,
    }


def parse_generate(body: object, cfg: SimConfig) -> GenerateSpec:
    """Validate a decoded /generate JSON body; raises ApiError with SGLang's status and shape."""
    if not isinstance(body, dict):
        raise type_error("Input should be a valid dictionary or object to extract fields from")
    _check_types(body)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise value_error("Either text, input_ids or input_embeds should be provided.")
    if ids is not None and len(ids) == 0:
        raise value_error("input_ids cannot be empty.")
    if isinstance(text, list) or (ids and isinstance(ids[0], list)) or isinstance(body.get("sampling_params"), list) or isinstance(body.get("rid"), list):
        raise value_error("batch not supported by simulator: send one prompt per request")
    if body.get("stream"):
        raise value_error("stream not supported by sglang-sim")
    if body.get("return_logprob"):
        raise value_error("return_logprob not supported by sglang-sim")
    sampling = _check_sampling(body.get("sampling_params") or {})
    ids_list: list[int] | None = list(ids) if ids is not None else None
    prompt: list[int] | list[str] = ids_list if ids_list is not None else pseudo_tokenize(text or "")
    n_in = len(prompt)
    ctx = cfg.context_length
    if n_in >= ctx:
        raise value_error(f"The input ({n_in} tokens) is longer than the model's context length ({ctx} tokens).")
    max_new = sampling["max_new_tokens"]
    # The scheduler (init_req_max_new_tokens) then caps every request at max_req_len - prompt - 1, with
    # max_req_len = context - 1: a null max_new_tokens ("until the context is full") and one that just fits
    # end with `length` two tokens short of the context.
    cap = max(0, ctx - n_in - 2)
    if max_new is None:
        max_new = cap
    elif max_new + n_in > ctx:  # tokenizer_manager._validate_one_request: strictly more than the context
        raise value_error(
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
            f"You requested a total of {max_new + n_in} tokens: {n_in} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
            "or the completion to fit within the limit."
        )
    else:
        max_new = min(max_new, cap)
    return GenerateSpec(
        prompt=prompt,
        raw_prompt=ids_list if ids_list is not None else (text or ""),
        rid=body.get("rid"),
        max_new_tokens=max_new,
        min_new_tokens=min(sampling["min_new_tokens"], max_new),  # the scheduler restores this after its cap
        ignore_eos=sampling["ignore_eos"],
        sampling_seed=sampling["sampling_seed"],
        greedy=sampling["greedy"],
        skip_special_tokens=sampling["skip_special_tokens"],
        sampling_params=dict(body.get("sampling_params") or {}),
    )
