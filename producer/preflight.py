"""Checks before a run writes anything: the output folders, the Redis it is about to trust with its budget state,
what the workers recorded of their SGLang servers (``bq:server_info``: reasoning parser, context, seed), and the
prompts' ids against the model's vocabulary (budget/serverinfo.py).

A queue on an evicting Redis loses jobs and counters silently under memory pressure; a Redis without AOF loses
everything since its last snapshot on a crash (with AOF everysec, a kill -9 lost nothing acknowledged here).

The vocabulary is checked twice (exit 2 on a prompt id the model cannot take): `check_vocab_offline` right after the
inputs are rendered (dry runs too; nothing is written yet), against the tokenizer directory's config.json;
`check_vocab_servers` at attach, after the servers' context recheck, against the smallest ``vocab_size`` the
workers' servers report (bq:server_info), and it puts the size checked against in the chunks' conversation block
so workers check the later turns they render.
"""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import redis

from budget import connection, logs, serverinfo
from budget.serverinfo import Vocab, check_prompts, config_vocab, servers_vocab, smallest
from producer.errors import ProduceError, UsageError
from render.modeldir import Context, ModelDirError, resolve_tokenizer, sane_context

if TYPE_CHECKING:
    from budget.payload import ConversationPayload
    from producer.prepare import Inputs, Prepared

log = logging.getLogger("budgetq.produce")


def connect(redis_url: str) -> "redis.Redis":
    """A client for ``redis_url`` (budget/connection.py: short explicit timeouts, not redis-py's defaults), pinged
    once so that a wrong URL is one clear error (exit 1) now rather than a traceback later."""
    client = connection.connect(redis_url)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ProduceError(f"cannot reach Redis at {logs.redact(redis_url)}: {exc}") from None
    log.debug("connected to Redis at %s", logs.redact(redis_url), extra={"redis": logs.redact(redis_url)})
    return client


def check_redis(client: "redis.Redis", *, allow_eviction: bool, require_aof: bool,
                warn: Callable[[str], None]) -> None:
    try:
        config: Any = client.config_get("maxmemory-policy")
        policy = _text(config.get("maxmemory-policy", ""))
        aof = _text(client.config_get("appendonly").get("appendonly", ""))
    except redis.ResponseError as exc:  # an ACL user without CONFIG, or a managed Redis that hides it
        message = f"cannot check Redis persistence and eviction settings ({exc})"
        if require_aof:
            raise ProduceError(message + "; --require-aof needs them") from None
        warn(f"warning: {message}; make sure it runs with appendonly yes and maxmemory-policy noeviction")
        return
    if policy and policy != "noeviction" and not allow_eviction:
        raise ProduceError(f"Redis evicts keys under memory pressure (maxmemory-policy {policy}): queued chunks "
                           "and budget counters could vanish silently. Set maxmemory-policy noeviction, or "
                           "pass --allow-eviction to run anyway.")
    if aof != "yes":
        if require_aof:
            raise ProduceError("Redis runs without AOF (appendonly no): a crash loses every commit since its "
                               "last snapshot. Enable appendonly yes (appendfsync everysec).")
        warn("warning: Redis runs without AOF (appendonly no): a Redis crash loses recent commits from Redis; "
             "the output files keep them and a rerun recounts them, but enable appendonly yes")


def seed_warning(servers: Sequence[Mapping[str, Any]], sampling_params: Mapping[str, Any]) -> str | None:
    """A warning when ``sampling_seed`` is sent to servers that ignore it; None when there is nothing to say.

    SGLang applies the per-request seed only when the server runs with ``--enable-deterministic-inference``
    (sglang/srt/sampling/sampling_batch_info.py), otherwise the seed is accepted and silently unused."""
    seed = sampling_params.get("sampling_seed")
    if seed is None or not servers:
        return None
    if serverinfo.seed_honoured(servers):
        return None
    without = sum(1 for s in servers if s.get("enable_deterministic_inference") is not True)
    return (f"warning: --seed {seed} is sent as sampling_seed, but {without} of the {len(servers)} SGLang servers "
            "the workers recorded do not report running with --enable-deterministic-inference: SGLang ignores "
            "the seed without it, so the run is not reproducible")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


def check_out_dirs(out_dir: Path, names: Iterable[str]) -> None:
    """Every dataset's output folder can be created and written, checked before Redis is touched: a run that
    found out only when it opened its files had already taken its collector locks and registered its datasets
    (seen in a container whose ``out/`` belonged to another user: a traceback, and a rerun refused for 30 s).
    Writing a probe file is the honest test; ``os.access`` says yes to root on a read-only mount."""
    for name in sorted(names):
        folder = out_dir / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".budgetq-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise UsageError(f"--out {out_dir}: cannot write {folder} ({exc.strerror or exc}); give an --out "
                             "folder this user can write") from None


def check_server_parsers(client: "redis.Redis", parser: str, *, warn: Callable[[str], None]) -> None:
    """Warn when a worker recorded a server launched with another --reasoning-parser (bq:server_info)."""
    from producer.settings import mismatches
    try:
        servers = serverinfo.load(client)
    except redis.RedisError:
        return  # best effort: the run itself reports Redis trouble
    for message in mismatches(parser, servers):
        warn(message)


#: What a /get_server_info entry says limits one request, in the order they are preferred for messages.
LIMIT_KEYS = ("context_length", "max_total_num_tokens")


def server_context(servers: Sequence[Mapping[str, Any]]) -> Context | None:
    """The smallest per-request limit any recorded server states, and which server and key said it; None when
    none records one (a server that leaves ``context_length`` null)."""
    best: Context | None = None
    for entry in servers:
        for key in LIMIT_KEYS:
            tokens = sane_context(entry.get(key))
            if tokens is None:
                continue
            where = entry.get("url", "?") + (f" on {entry['host']}" if entry.get("host") else "")
            if best is None or tokens < best.tokens:
                best = Context(tokens, f"SGLang server {where}: {key}, recorded by its workers in Redis")
    return best


def apply_server_context(prepared: Sequence["Prepared"], limit: Context, max_tokens: int) -> dict[str, int]:
    """Drop from each dataset the selected samples whose prompt + ``max_tokens`` exceeds ``limit``; they join
    its ``over_context`` problems. Returns {dataset: samples dropped} (datasets with none left out)."""
    dropped: dict[str, int] = {}
    for p in prepared:
        over = [prompt for prompt in p.prompts.values() if prompt.length + max_tokens > limit.tokens]
        for prompt in over:
            p.over_context.append(prompt.sample.problem(
                f"prompt of {prompt.length} tokens + --max-tokens {max_tokens} exceeds the servers' context of "
                f"{limit.tokens} ({limit.source})"))
            del p.prompts[prompt.sample.id]
        if over:
            dropped[p.name] = len(over)
    return dropped


def recheck_context(client: "redis.Redis", inputs: "Inputs", max_tokens: int, *,
                    warn: Callable[[str], None]) -> Context:
    """At attach, the SGLang servers' own context limit wins over the offline one the prompts were checked against
    (``--max-context``, the tokenizer, config.json: producer.prepare.choose_context). Returns the context the
    prompts are checked against now, what later turns of a conversation are checked against too.

    SGLang's limit is its own: ``--context-length`` may have lowered it, and a KV cache smaller than the context
    (``max_total_num_tokens``) caps every request too; a prompt over it would be refused (400) or cut short one
    request at a time, after its chunk was queued. So the smallest limit the workers recorded in
    ``bq:server_info`` (a chunk may run on any server) drops the prompts that no longer fit from what will be
    enqueued, counted as "over context" like the ones found offline. A larger one changes nothing (the prompts
    skipped offline were not rendered into the run; ``--max-context`` raises the offline limit)."""
    try:
        servers = serverinfo.load(client)
    except redis.RedisError as exc:
        raise ProduceError(f"Redis error: {exc}") from None
    checked = inputs.context
    limit = server_context(servers)
    if limit is None:
        log.info("no worker recorded its SGLang servers' context length in Redis: prompts stay checked "
                 f"against {checked.tokens:,} ({checked.source})")
        return checked
    if limit.tokens >= checked.tokens:
        log.info(f"the SGLang servers' context is {limit.tokens:,} ({limit.source}): every prompt checked against "
                 f"{checked.tokens:,} ({checked.source}) fits")
        return checked
    dropped = apply_server_context(inputs.prepared, limit, max_tokens)
    for name, n in sorted(dropped.items()):
        warn(f"warning: {name}: {n:,} samples skipped, not enqueued: prompt + --max-tokens {max_tokens:,} exceeds "
             f"the SGLang servers' context of {limit.tokens:,} ({limit.source}), which is below the "
             f"{checked.tokens:,} they were checked against ({checked.source})")
    if not dropped:
        log.info(f"the SGLang servers' context is {limit.tokens:,} ({limit.source}): every selected prompt fits")
    return limit


def check_seed(client: "redis.Redis", sampling_params: Mapping[str, Any], *, warn: Callable[[str], None],
               servers: Sequence[Mapping[str, Any]] | None = None) -> None:
    """Warn when --seed is given and no server the workers recorded (or ``servers``) honours it. Before any worker
    has recorded its servers there is nothing to check: the end of the run checks again."""
    if sampling_params.get("sampling_seed") is None:
        return
    try:
        entries = servers if servers is not None else serverinfo.load(client)
    except redis.RedisError:
        return
    message = seed_warning(entries, sampling_params)
    if message:
        warn(message)
    elif not entries:
        log.info("--seed: no worker has recorded its SGLang servers yet; whether they honour the seed is checked "
                 "at the end of the run (manifest: sampling_seed_honoured)")


def _tokenizer_vocab(tokenizer: str) -> Vocab | None:
    try:
        return config_vocab(resolve_tokenizer(tokenizer))
    except ModelDirError:
        return None


def _check(inputs: "Inputs", vocab: Vocab | None) -> None:
    message = check_prompts(((p.name, [{pid if not variant else f"{pid} ({variant})": ids
                                         for pid, prompt in p.prompts.items()
                                         for variant, (ids, _opens) in prompt.renderings.items()}])
                             for p in inputs.prepared), vocab)
    if message is not None:
        raise UsageError(message)


def check_vocab_offline(inputs: "Inputs", tokenizer: str) -> None:
    """Every rendered prompt against config.json's ``vocab_size`` (when the tokenizer directory has one)."""
    _check(inputs, _tokenizer_vocab(tokenizer))


def check_vocab_servers(client: "redis.Redis", inputs: "Inputs", tokenizer: str, conversation: "ConversationPayload | None") -> None:
    """At attach: the prompts against a smaller ``vocab_size`` the servers report, if any (best effort: none
    recorded, or Redis unreadable, changes nothing); the conversation block gets the size in force."""
    try:
        servers = serverinfo.load(client)
    except Exception:  # noqa: BLE001 - the run itself reports Redis trouble
        servers = []
    offline = _tokenizer_vocab(tokenizer)
    vocab = smallest(offline, servers_vocab(servers))
    if vocab is not None and vocab != offline:
        _check(inputs, vocab)
    if conversation is not None and vocab is not None:
        conversation["vocab_size"] = vocab.size
