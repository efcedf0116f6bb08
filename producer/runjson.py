"""What a run stores in run.json, and how a rerun is compared with it.

A response made under other settings would mix two distributions in one training set (and two parsers, two
splits of the same text, in one file), so a dataset's settings are stored when its run starts and a rerun must
give the same ones (producer/attach.py checks them before anything is written). Settings added since a run was
stored mean, when missing, what that run did: ``resume_settings`` and the ``choose_*`` functions apply that rule.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from producer.render import Renderer
from producer.templatemix import SETTING as MIX_SETTING, TemplateMix

#: ``--turns``: regenerate every assistant turn of a conversation (``all``, budget/history.py ``plan``), or only
#: the answer to its last user turn on the dataset's own history (``last``: what every run did before it).
ALL: Final = "all"
LAST: Final = "last"
#: The run.json key; missing in a stored run means ``last`` (producer/attach.py ``_settings_for``).
TURNS_SETTING: Final = "turns"


def run_settings(renderer: Renderer, sampling_params: dict[str, Any],
                 chat_template_kwargs: dict[str, Any], system_prompt: str | None = None,
                 reasoning_parser: str | None = None, order: dict[str, Any] | None = None,
                 turns: str | None = None, mix: TemplateMix | None = None) -> dict[str, Any]:
    """What must not change between a run and its resume: a response made under other settings would mix
    two distributions in one training set (and two parsers, two splits of the same text, in one file).

    ``reasoning_parser`` None leaves the key out: a run stored before parsers existed has none, and such a run
    resumes with the think-marker split it started with (producer/attach.py ``_settings_for``). ``order`` None
    likewise (producer/order.py): a run stored before --order resumes in file order; and ``turns`` None: a run
    stored before --turns resumes as ``last``; and ``mix`` None: no ``template_kwargs_mix`` key, as every run
    stored before it (one set of chat_template_kwargs for all)."""
    think = renderer.think
    settings = {
        "tokenizer": renderer.fingerprint(),
        "chat_template_kwargs": chat_template_kwargs,
        "sampling_params": sampling_params,
        "think": [think.start, think.end] if think else None,
        "system_prompt": system_prompt,
    }
    if reasoning_parser is not None:
        settings["reasoning_parser"] = reasoning_parser
    if order is not None:
        settings["order"] = order
    if turns is not None:
        settings[TURNS_SETTING] = turns
    if mix is not None:
        settings[MIX_SETTING] = mix.setting()
    return settings


def choose_turns(requested: str, explicit: bool, run_file: Path, new_run: bool) -> str:
    """The ``--turns`` mode a dataset is prepared in: ``requested``, except that a stored run.json without the key
    (a run that predates --turns, which regenerated the last turn only) resumes as ``last`` unless --turns was
    given (then attach reports the settings change). ``--new-run`` starts over, so it takes the request."""
    if new_run or explicit:
        return requested
    try:
        stored = json.loads(run_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return requested
    if isinstance(stored, dict) and TURNS_SETTING not in stored:
        return LAST
    return requested


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


#: Sampling parameters runs send since a later version, with the value that means what a stored run without them
#: did: before them nothing was sent, which is SGLang's default. A resumed run that lacks one goes on as it ran (a
#: missing setting is never a change of settings; mixing two behaviours in one dataset is what the settings check
#: exists to prevent). ``reasoning_parser``, the other setting added since, is handled the same way by
#: ``Attacher._settings_for`` (producer/attach.py; there an explicit --reasoning-parser on an old run is a change).
ADDED_SAMPLING_PARAMS: Final[dict[str, Any]] = {"skip_special_tokens": True}


def resume_settings(stored: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The settings a dataset resumed from ``stored`` goes on with, and notes on what it kept from before.

    ``new`` less every added sampling parameter (ADDED_SAMPLING_PARAMS) that ``stored`` lacks: the run keeps its
    old behaviour for them. A note names each one whose new value differs from that old behaviour, so the user
    knows an option was not applied. What remains is compared with ``stored`` as before."""
    effective = dict(new)
    notes: list[str] = []
    params = dict(new.get("sampling_params") or {})
    stored_params = stored.get("sampling_params") or {}
    for key, old in ADDED_SAMPLING_PARAMS.items():
        if key in params and key not in stored_params:
            if params.pop(key) != old:
                notes.append(f"{key}: {new['sampling_params'][key]!r} not applied, the run predates it "
                             f"(kept: not sent, SGLang's default {old!r})")
    if "sampling_params" in new:
        effective["sampling_params"] = params
    return effective, notes
