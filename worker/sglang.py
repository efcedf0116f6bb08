"""One ``POST /generate`` attempt against SGLang, and what its answer means.

Everything SGLang can answer is sorted into three outcomes: a valid generation; a final error (a 400: the
request itself is wrong and will be wrong again); a retryable error (5xx, 429, resets, timeouts, an aborted
generation, a body that breaks the contract). Retry policy lives with the caller (worker/chunk.py).
Only the fields the contract guarantees are relied on: ``meta_info.id``, ``finish_reason``,
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

from worker.config import WorkerConfig

DUPLICATE_RID = "Duplicate request ID"


class GenerateError(Exception):
    """An attempt that produced no usable generation."""

    def __init__(self, reason: str, *, retryable: bool, status: int | None = None,
                 retry_after: float | None = None, new_rid: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.new_rid = new_rid  # SGLang still runs a request with this rid: retry under the next one
        self.attempts = 1  # requests sent for the sample, set when the last attempt gave up


@dataclass(frozen=True)
class Generation:
    text: str
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str  # 'stop' or 'length'
    server: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_generation(body: Any, max_new_tokens: int, server: str) -> Generation:
    """Validate a 200 body; anything that breaks the contract is a retryable error, never a result."""
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    if not isinstance(body, dict):
        raise GenerateError("malformed response: not a JSON object", retryable=True)
    meta = body.get("meta_info")
    text = body.get("text")
    if not isinstance(meta, dict):
        raise GenerateError("malformed response: no meta_info", retryable=True)
    if not isinstance(text, str):
        raise GenerateError("malformed response: text is not a string", retryable=True)
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        message = finish.get("message") if isinstance(finish, dict) else None
        raise GenerateError(f"generation aborted: {message}", retryable=True)
    if kind not in ("stop", "length"):
        raise GenerateError(f"malformed response: finish_reason {finish!r}", retryable=True)
    tokens: Any = meta.get("completion_tokens")
    if not _is_int(tokens) or not 0 <= tokens <= max_new_tokens:
        raise GenerateError(f"malformed response: completion_tokens {tokens!r} "
                            f"(expected 0..{max_new_tokens})", retryable=True)
    output_ids = body.get("output_ids")
    if output_ids is not None and (not isinstance(output_ids, list) or len(output_ids) != tokens):
        raise GenerateError("malformed response: output_ids do not match completion_tokens", retryable=True)
    prompt_tokens: Any = meta.get("prompt_tokens")
    if not _is_int(prompt_tokens) or prompt_tokens < 0:
        raise GenerateError(f"malformed response: prompt_tokens {prompt_tokens!r}", retryable=True)
    cached = meta.get("cached_tokens", 0)
    return Generation(text=text, completion_tokens=tokens, prompt_tokens=prompt_tokens,
                      cached_tokens=cached if _is_int(cached) else 0, finish_reason=kind, server=server)


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error", body.get("message"))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:500]
    return str(body)[:500]


def _retry_after(headers: Any) -> float | None:
    raw = headers.get("Retry-After")
    try:
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:
        return None


class SGLangClient:
    """Sends attempts to the least-busy of the configured servers over one persistent session."""

    def __init__(self, session: aiohttp.ClientSession, config: WorkerConfig) -> None:
        self.session = session
        self.config = config
        self.in_flight = {url: 0 for url in config.servers}
        self._turn = 0
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    def pick_server(self) -> str:
        """Least in flight from this worker; ties go round-robin so equal servers share the load."""
        self._turn += 1
        servers = self.config.servers
        order = servers[self._turn % len(servers):] + servers[:self._turn % len(servers)]
        return min(order, key=lambda url: self.in_flight[url])

    async def generate(self, payload: dict[str, Any], max_new_tokens: int) -> Generation:
        server = self.pick_server()
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_for(max_new_tokens),
                                        sock_connect=self.config.connect_timeout)
        self.in_flight[server] += 1
        try:
            async with self.session.post(server + "/generate", json=payload, timeout=timeout,
                                         headers=self._headers) as resp:
                raw = await resp.read()
                status = resp.status
                retry_after = _retry_after(resp.headers)
        except asyncio.TimeoutError:
            raise GenerateError(f"timeout from {server}", retryable=True) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise GenerateError(f"{type(exc).__name__} from {server}: {exc}", retryable=True) from None
        finally:
            self.in_flight[server] -= 1
        if status == 200:
            try:
                body = json.loads(raw)
            except ValueError:
                raise GenerateError("malformed response: body is not JSON", retryable=True) from None
            return parse_generation(body, max_new_tokens, server)
        message = _error_message(raw)
        if status == 400:
            if DUPLICATE_RID in message:
                raise GenerateError(message, retryable=True, status=400, new_rid=True)
            raise GenerateError(f"400: {message}", retryable=False, status=400)
        raise GenerateError(f"{status}: {message}", retryable=True, status=status, retry_after=retry_after)
