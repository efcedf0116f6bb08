"""``produce``'s side of budget/vocab.py: refuse (exit 2) a run whose prompts hold an id the model cannot take.

Two hooks in producer/launch.py: `check_offline` right after the inputs are rendered (dry runs too; nothing is
written yet), against the tokenizer directory's config.json; `check_servers` at attach, after the servers'
context recheck, against the smallest ``vocab_size`` the workers' servers report (bq:server_info), and it puts
the size checked against in the chunks' conversation block so workers check the later turns they render.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from budget import serverinfo
from budget.vocab import Vocab, check_prompts, config_vocab, servers_vocab, smallest
from producer.errors import UsageError
from render.modeldir import ModelDirError, resolve_tokenizer

if TYPE_CHECKING:
    import redis

    from budget.payload import ConversationPayload
    from producer.prepare import Inputs


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


def check_offline(inputs: "Inputs", tokenizer: str) -> None:
    """Every rendered prompt against config.json's ``vocab_size`` (when the tokenizer directory has one)."""
    _check(inputs, _tokenizer_vocab(tokenizer))


def check_servers(client: "redis.Redis", inputs: "Inputs", tokenizer: str, conversation: "ConversationPayload | None") -> None:
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
