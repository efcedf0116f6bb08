"""A dataset's settings, resolved once (``resolve``: ``DatasetSettings``), what a run stores of them in run.json,
and how a rerun is compared with it.

A response made under other settings would mix two distributions in one training set (and two parsers, two
splits of the same text, in one file), so a dataset's settings are stored when its run starts and a rerun must
give the same ones (producer/session/attach.py checks them before anything is written). The settings carry the run
format (``version``, budget/payload.py VERSION): a run of another format is refused, never read.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Mapping

from budget.payload import VERSION, ThinkPayload
from producer.generations import MIX_SETTING, Generations, TemplateMix, chunk_params
from producer.generations import SETTING as GENERATIONS
from producer.order import Order
from producer.settings import RunSettings
from render.chat import ChatTemplate, Renderer

#: ``--turns``: regenerate every assistant turn of a conversation (``all``, budget/history.py ``plan``), or only
#: the answer to its last user turn on the dataset's own history (``last``).
ALL: Final = "all"
LAST: Final = "last"
TURNS: Final = (ALL, LAST)  # producer/cli.py spells them out, to keep `produce --help` light (tests check it)
#: The run.json key of the run format.
VERSION_KEY: Final = "version"
#: The run.json key of the run's ``--tokenizer`` (a directory made absolute, or a Hugging Face id as given), for
#: ``produce export`` to find it. Not a setting: a rerun may name the same tokenizer by another path (the
#: ``tokenizer`` fingerprint is what must not change), so it is left out of the comparison (`without_location`).
TOKENIZER_PATH: Final = "tokenizer_path"
#: The setting of a run's ``--chat-template FILE``: the sha256 of the template text (only with the option), and
#: the run.json key of the file's absolute path, not a setting, for ``produce export`` (as `TOKENIZER_PATH`).
CHAT_TEMPLATE: Final = "chat_template"
CHAT_TEMPLATE_PATH: Final = "chat_template_path"
_LOCATIONS: Final = (TOKENIZER_PATH, CHAT_TEMPLATE_PATH)


def run_json(stored: Mapping[str, Any], tokenizer: str | None,
             chat_template: ChatTemplate | None = None) -> dict[str, Any]:
    """What run.json holds: the stored settings, and where the run's tokenizer (`TOKENIZER_PATH`) and its
    ``--chat-template`` file (`CHAT_TEMPLATE_PATH`) are."""
    out = dict(stored)
    if tokenizer:
        path = Path(tokenizer).expanduser()
        out[TOKENIZER_PATH] = str(path.resolve()) if path.is_dir() else tokenizer
    if chat_template is not None:
        out[CHAT_TEMPLATE_PATH] = chat_template.path
    return out


def without_location(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A run.json's stored settings, without what is not a setting (`TOKENIZER_PATH`, `CHAT_TEMPLATE_PATH`)."""
    return {k: v for k, v in settings.items() if k not in _LOCATIONS}


def stored_settings(renderer: Renderer, sampling_params: dict[str, Any], chat_template_kwargs: dict[str, Any],
                 system_prompt: str | None, reasoning_parser: str, order: Order, turns: str,
                 mix: TemplateMix | None, chat_template: ChatTemplate | None = None) -> dict[str, Any]:
    """What must not change between a run and its resume (run.json, and the dataset's ``settings`` in Redis).
    ``template_kwargs_mix`` and ``chat_template`` (the --chat-template file's digest; its text is in the
    ``tokenizer`` fingerprint too) are there only when given; ``generations`` is added by ``resolve`` when above 1."""
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
    if chat_template is not None:
        settings[CHAT_TEMPLATE] = chat_template.digest
    return settings


def settings_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            if key == "tokenizer":
                out.append("tokenizer or chat template differs")
            elif key == CHAT_TEMPLATE:
                was, now = (f"sha256 {d[:12]}" if d else "none" for d in (old.get(key), new.get(key)))
                out.append(f"--chat-template: stored {was}, now {now}")
            elif key == "sampling_params":
                a, b = old.get(key) or {}, new.get(key) or {}
                for p in sorted(set(a) | set(b)):
                    if a.get(p) != b.get(p):
                        out.append(f"{p}: stored {a.get(p)!r}, now {b.get(p)!r}")
            else:
                out.append(f"{key}: stored {old.get(key)!r}, now {new.get(key)!r}")
    return out


@dataclass(frozen=True)
class DatasetSettings:
    """A dataset's settings, resolved once (``resolve``) before it is rendered, and read as they are by every later
    step: selection, the settings check, the chunks, the loop, the plan. ``stored`` is what run.json and the
    dataset's ``settings`` in Redis hold."""

    order: Order
    turns: str  # ALL or LAST
    reasoning_parser: str
    chat_template_kwargs: Mapping[str, Any]
    mix: TemplateMix | None
    #: run.json's sampling parameters (a --temperature list stays a list), and what a chunk sends: the list's
    #: first entry, generation 0's (producer/generations.py; a later generation carries its own override).
    sampling_params: Mapping[str, Any]
    chunk_params: dict[str, Any]
    generations: Generations
    think: ThinkPayload | None  # the chat template's thinking markers
    stored: Mapping[str, Any]

    @property
    def max_new_tokens(self) -> int:
        return int(self.chunk_params["max_new_tokens"])


def resolve(s: RunSettings, renderer: Renderer, parser: str) -> DatasetSettings:
    """The settings of a dataset of ``produce run`` ``s``, with the tokenizer's ``renderer`` and the reasoning
    ``parser`` (given or detected): skip_special_tokens defaults to what the parser needs of this tokenizer (false
    when a marker it reads is one of the tokenizer's special tokens, issue 25)."""
    from producer.parsers import skip_special_tokens_default
    params = {**s.sampling_params(), "skip_special_tokens": s.skip_special_tokens if s.skip_special_tokens is not None
              else skip_special_tokens_default(parser, renderer.tokenizer)}
    kwargs = dict(s.chat_template_kwargs)
    stored = stored_settings(renderer, params, kwargs, s.mapping.system_prompt, parser, s.order, s.turns, s.template_mix,
                             s.chat_template)
    if s.generations > 1:
        stored[GENERATIONS] = s.generations
    think = renderer.think
    return DatasetSettings(order=s.order, turns=s.turns, reasoning_parser=parser, chat_template_kwargs=kwargs,
                           mix=s.template_mix, sampling_params=params, chunk_params=chunk_params(params),
                           generations=Generations.from_params(s.generations, params),
                           think={"start": think.start, "end": think.end} if think else None, stored=stored)
