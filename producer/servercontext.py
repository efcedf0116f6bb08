"""At attach, the SGLang servers' own context limit wins over the one the prompts were checked against.

Before Redis is touched, ``produce`` checks every prompt against a context it can know offline (``--max-context``,
the tokenizer, the model's config.json: producer.prepare.choose_context). The limit SGLang enforces is its own:
``--context-length`` may have lowered it, and a KV cache smaller than the context (``max_total_num_tokens``)
caps every request too. A prompt over it would be refused (400) or cut short by the server, one request at a
time, after its chunk was queued and started. So when the workers have recorded their servers' limits in
``bq:server_info`` (budget/serverinfo.py), ``produce`` takes the smallest (a chunk may run on any server), drops
the prompts that no longer fit from what it will enqueue, and says how many: they count as "over context" in the
summary, like the ones found offline. A server that reports a larger limit changes nothing (the prompts skipped
offline were not rendered into the run; ``--max-context`` raises the offline limit).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from producer.prepare import Prepared
from render.modeldir import Context, sane_context

#: What a /get_server_info entry says limits one request, in the order they are preferred for messages.
LIMIT_KEYS = ("context_length", "max_total_num_tokens")


def server_context(servers: Sequence[Mapping[str, Any]]) -> Context | None:
    """The smallest per-request limit any recorded server states, and which server and key said it; None when
    none records one (an older worker, or a server that leaves ``context_length`` null)."""
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


def apply_server_context(prepared: Sequence[Prepared], limit: Context, max_tokens: int) -> dict[str, int]:
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


def recheck(servers: Sequence[Mapping[str, Any]], prepared: Sequence[Prepared], checked: Context,
            max_tokens: int, *, echo: Any, warn: Any) -> dict[str, int]:
    """Apply the servers' limit when it is below ``checked`` (what the prompts were checked against), reporting
    each dataset's count of samples it skips. Returns {dataset: samples dropped}."""
    limit = server_context(servers)
    if limit is None:
        echo("no worker recorded its SGLang servers' context length in Redis: prompts stay checked "
             f"against {checked.tokens:,} ({checked.source})")
        return {}
    if limit.tokens >= checked.tokens:
        echo(f"the SGLang servers' context is {limit.tokens:,} ({limit.source}): every prompt checked against "
             f"{checked.tokens:,} ({checked.source}) fits")
        return {}
    dropped = apply_server_context(prepared, limit, max_tokens)
    for name, n in sorted(dropped.items()):
        warn(f"warning: {name}: {n:,} samples skipped, not enqueued: prompt + --max-tokens {max_tokens:,} exceeds "
             f"the SGLang servers' context of {limit.tokens:,} ({limit.source}), which is below the "
             f"{checked.tokens:,} they were checked against ({checked.source})")
    if not dropped:
        echo(f"the SGLang servers' context is {limit.tokens:,} ({limit.source}): every selected prompt fits")
    return dropped
