"""What a run stores in run.json, and how a rerun is compared with it.

A response made under other settings would mix two distributions in one training set (and two parsers, two
splits of the same text, in one file), so a dataset's settings are stored when its run starts and a rerun must
give the same ones (producer/attach.py checks them before anything is written). The settings carry the run
format (``version``, budget/payload.py VERSION): a run of another format is refused, never read.
"""
from __future__ import annotations

from typing import Any, Final

from budget.payload import VERSION
from render.chat import Renderer
from producer.order import Order
from producer.templatemix import SETTING as MIX_SETTING, TemplateMix

#: ``--turns``: regenerate every assistant turn of a conversation (``all``, budget/history.py ``plan``), or only
#: the answer to its last user turn on the dataset's own history (``last``).
ALL: Final = "all"
LAST: Final = "last"
#: The run.json key of the run format.
VERSION_KEY: Final = "version"


def run_settings(renderer: Renderer, sampling_params: dict[str, Any], chat_template_kwargs: dict[str, Any],
                 system_prompt: str | None, reasoning_parser: str, order: Order, turns: str,
                 mix: TemplateMix | None) -> dict[str, Any]:
    """What must not change between a run and its resume (run.json, and the dataset's ``settings`` in Redis).
    ``template_kwargs_mix`` is there only with a mix; ``generations`` is added by the caller when above 1."""
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
    return settings


def settings_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            if key == "tokenizer":
                out.append("tokenizer or chat template differs")
            elif key == "sampling_params":
                a, b = old.get(key) or {}, new.get(key) or {}
                for p in sorted(set(a) | set(b)):
                    if a.get(p) != b.get(p):
                        out.append(f"{p}: stored {a.get(p)!r}, now {b.get(p)!r}")
            else:
                out.append(f"{key}: stored {old.get(key)!r}, now {new.get(key)!r}")
    return out
