"""The chunk job payload: the one contract between the producer and the workers.

A chunk is one RQ job (JSON-serialized, never pickle). It carries everything a worker needs so the worker
never imports transformers or reads the dataset files: the rendered ``input_ids`` of each sample, the
sampling parameters and the thinking markers of the chat template.
"""
from __future__ import annotations

import hashlib
from typing import Any, Final, NotRequired, TypedDict

from budget import keys

#: The run format: every chunk payload (``v``), run.json and a dataset's settings in Redis (``version``) carry it.
#: A producer or a worker refuses anything of another format (OTHER_VERSION says what to do).
VERSION: Final = 4
OTHER_VERSION: Final = "made by another budgetq version: finish it with that version, or start over with --new-run"

#: The reasoning parsers a chunk may name (worker/reasoning.py parses with them; producer/settings.py chooses one),
#: spelled as SGLang spells them: the word a user passes to ``sglang.launch_server --reasoning-parser``.
REASONING_PARSERS: Final[tuple[str, ...]] = (
    "qwen3", "qwen3-thinking", "deepseek-r1", "deepseek-v3", "glm45", "kimi", "kimi_k2", "gpt-oss", "none")

#: The job function, named by dotted string so the producer never imports worker code; the worker class
#: runs nothing else.
JOB_FUNCTION = "worker.rqworker.run_chunk"


class _SamplePayloadRequired(TypedDict):
    id: str
    input_ids: list[int]  # the prompt of the sample's first turn
    opens_think: bool  # the rendered prompt ends inside an open thinking tag


class SamplePayload(_SamplePayloadRequired, total=False):
    #: ``--turns all``, a conversation of more than one turn (budget/record.py ``plan``): the dataset's messages
    #: (system prompt applied, trailing assistant answer dropped), from which the worker renders turn i+1 on the
    #: model's own turns 0..i. Both missing: one turn, committed with ``commit``.
    messages: list[dict[str, Any]]
    turns: int  # len(plan(messages)) > 1: the most turns the conversation makes
    #: Several generations of a prompt (docs/generations.md): what this generation sends differently from the
    #: chunk's ``sampling_params`` (a temperature of a list, a derived seed), merged over them for every turn.
    #: Missing: the chunk's.
    sampling_params: dict[str, Any]
    #: ``--template-kwargs-mix`` (docs/generations.md): the chat_template_kwargs this sample was rendered with (the
    #: run's, with its drawn values merged over them), for its record and a conversation's later turns; and, for a
    #: conversation, the fingerprint of the Renderer they make (the tokenizer files stay under the conversation
    #: block's). Missing: the run's.
    chat_template_kwargs: dict[str, Any]
    tokenizer: str
    #: The record's tool definitions (producer/inputs/records.py): ``input_ids`` were rendered with them, a
    #: conversation's later turns are (``Renderer.render(messages, tools)``), and the record carries them.
    #: Missing: the record has none.
    tools: list[dict[str, Any]]


class ConversationPayload(TypedDict):
    """What a worker needs to render later turns itself (docs/multiturn.md): the run's tokenizer files are in
    Redis under this fingerprint (budget/runstate.py), and the Renderer it builds must give that fingerprint."""

    tokenizer: str  # Renderer.fingerprint() of the producer's renderer
    chat_template_kwargs: dict[str, Any]
    max_context: int  # what produce checked turn 0 against; turn i stops with "context" past it
    open_markers: list[str] | None  # [start, end] when the parser's think markers are not the template's (Kimi)
    vocab_size: NotRequired[int]  # the model's vocabulary when known (budget/serverinfo.py): later turns are checked


class ThinkPayload(TypedDict):
    start: str
    end: str


class _ChunkPayloadRequired(TypedDict):
    v: int  # VERSION
    dataset: str
    chunk: str
    sampling_params: dict[str, Any]
    think: ThinkPayload | None
    reasoning_parser: str  # the run's (worker/reasoning.py PARSERS)
    samples: list[SamplePayload]


class ChunkPayload(_ChunkPayloadRequired, total=False):
    #: Present exactly when a sample of the chunk has ``turns`` > 1 (``--turns all``).
    conversation: ConversationPayload


def sampling_params_of(chunk: ChunkPayload, sample: SamplePayload) -> dict[str, Any]:
    """What ``sample`` sends (and its record says it was sent with): the chunk's sampling parameters, with the
    sample's own override merged over them (the chunk's object itself when there is none)."""
    override = sample.get("sampling_params")
    if not override:
        return chunk["sampling_params"]
    return {**chunk["sampling_params"], **override}


def turn_request_key(sample_id: str, turn: int) -> str:
    """What names turn ``turn`` of conversation ``sample_id`` in its rids and tool-call ids: the sample id for
    turn 0 (as a one-turn sample), ``"{turn}\x1f{sample}"`` after (ids hold no control characters: unambiguous)."""
    return sample_id if turn == 0 else f"{turn}{keys.SEP}{sample_id}"


def request_id(dataset: str, sample_id: str, attempt: int) -> str:
    """A fixed-length SGLang rid: 28 hex of hash(dataset, sample) + 4 digits of attempt.

    SGLang aborts by rid *prefix* and refuses a rid still in flight, so every rid has the same length (no rid
    is a prefix of another) and each retry of a sample gets the next attempt number.
    """
    digest = hashlib.sha256(f"{dataset}\0{sample_id}".encode()).hexdigest()[:28]
    return f"{digest}{attempt % 10000:04d}"
