"""Reading the simulator's request log (``sglang-sim --request-log PATH``, sglang_sim/request_log.py) in tests.

What it is for: checking from the server's side what each request was sent. A multi-turn test finds each turn's
prompt here and checks that it carries the model's previous answer (the ``text`` the server gave for the turn
before) and none of the dataset's answers, without trusting anything budgetq itself recorded.

    log = exchanges(path, tokenizer)          # rid -> [Exchange, ...] in the order answered
    turns = of_sample(log, "ds", "sample-7")  # [answers to turn 0, answers to turn 1, ...]
    assert turns[0][-1].output in turns[1][-1].prompt

Not a test module: a support module the tests import, like tests/procs.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from budget.record import request_id, turn_request_key

#: How many leading characters of a rid name its request (budget.record.request_id: 28 hex of the hash of the
#: dataset and the sample's turn, then 4 digits that count the attempts).
SAMPLE_PREFIX = 28


class Decoder(Protocol):
    """What a tokenizer must offer here: ``transformers`` tokenizers and ``tokenizers.Tokenizer`` both do. A
    transformers tokenizer is typed to return a list of strings too (its decode of a batch): one sequence of ids
    gives one string."""

    def decode(self, ids: Sequence[int], /, skip_special_tokens: bool = ...) -> str | list[str]: ...


@dataclass(frozen=True)
class Exchange:
    """One answered /generate as the server saw it."""

    line: int  # 1-based line of the log: the order the server answered in
    rid: str
    port: int
    input_ids: list[int]
    output_ids: list[int]
    output: str  # the answer's text as the server sent it (the ``text`` field)
    finish_reason: dict[str, Any]
    completion_tokens: int
    prompt: str  # input_ids decoded with the tokenizer, special tokens kept (the rendered chat template)

    @property
    def finish(self) -> str:
        """``stop``, ``length`` or ``abort``."""
        return str(self.finish_reason.get("type"))


def load(path: str | Path) -> list[dict[str, Any]]:
    """Every line of the log, in the order written. A last line without its newline (a server killed mid-write)
    is left out; any other line that is not JSON fails loudly with its line number."""
    # The last piece is empty when the file ends with a newline, else a torn last line: left out either way.
    complete = Path(path).read_text(encoding="utf-8").split("\n")[:-1]
    out = []
    for number, line in enumerate(complete, 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise AssertionError(f"{path}:{number}: not a JSON line: {exc}") from exc
    return out


def exchanges(path: str | Path, tokenizer: Decoder) -> dict[str, list[Exchange]]:
    """The log by rid: each rid's answers in the order answered (one, unless a rid was reused after an answer),
    with its prompt decoded by ``tokenizer``. Lines of text prompts (``input_text``) keep the text as prompt."""
    out: dict[str, list[Exchange]] = {}
    for line, entry in enumerate(load(path), 1):
        ids = entry.get("input_ids")
        prompt = (tokenizer.decode(ids, skip_special_tokens=False) if ids is not None
                  else str(entry.get("input_text", "")))
        assert isinstance(prompt, str), f"{path}:{line}: decoding one prompt gave {prompt!r}"
        out.setdefault(entry["rid"], []).append(Exchange(
            line=line, rid=entry["rid"], port=int(entry["port"]), input_ids=list(ids or []),
            output_ids=list(entry["output_ids"]), output=str(entry["text"]),
            finish_reason=dict(entry["finish_reason"]), completion_tokens=int(entry["completion_tokens"]),
            prompt=prompt))
    return out


def turn_prefix(dataset: str, sample_id: str, turn: int) -> str:
    """The first 28 characters of every rid a worker sends for a sample's ``turn`` (worker/turns.py: turn 0 is
    named by the sample id, a later turn by ``payload.turn_request_key``; the last 4 characters count its
    attempts)."""
    key = turn_request_key(sample_id, turn)
    return request_id(dataset, key, 0)[:SAMPLE_PREFIX]


def of_turn(log: dict[str, list[Exchange]], dataset: str, sample_id: str, turn: int) -> list[Exchange]:
    """Every answer to the requests of one turn of a sample (its attempts), in the order answered."""
    prefix = turn_prefix(dataset, sample_id, turn)
    return sorted((x for rid, answers in log.items() if rid.startswith(prefix) for x in answers),
                  key=lambda x: x.line)


def of_sample(log: dict[str, list[Exchange]], dataset: str, sample_id: str,
              max_turns: int = 64) -> list[list[Exchange]]:
    """A conversation from the server's side: for turn 0, 1, ... the answers to that turn's requests, up to the
    last turn that has any (a turn without answers before it shows as an empty list)."""
    turns = [of_turn(log, dataset, sample_id, i) for i in range(max_turns)]
    while turns and not turns[-1]:
        turns.pop()
    return turns
