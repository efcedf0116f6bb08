"""A Redis that restarted empty under an attached ``produce`` is named as such, wherever in a step it happens.

``produce`` checks the run's epoch key (budget/keys.py ``EPOCH``) at the start of each step; a restart that falls
later in the same step first shows as a counter below what the output files hold, which also means "Redis went
back to an older state". Both stop ``produce`` with exit 1 and lose nothing, but only one says what happened:
the end-to-end test in tests/e2e/test_reliability.py met the second message once, when the restart landed inside
a step. Here that window is taken on purpose.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import redis

from producer.errors import ProduceError
from producer.session.loop import Producer
from tests.producers import code_inputs


def attached(r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path) -> Producer:
    inputs, options = code_inputs(tokenizer_dir, tmp_path / "out")
    producer = Producer(r, inputs.prepared, options, echo=lambda msg: None)
    producer.attach()
    return producer


def test_an_empty_restart_inside_a_step_is_reported_as_one(r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    producer = attached(r, tokenizer_dir, tmp_path)
    [d] = producer.runs
    d.out.tokens["code_instruct-0"] = 100  # a result already on disk: Redis counted it before it restarted
    r.flushall()  # our own session server: Redis restarted empty...
    answers = iter([producer.epoch])  # ...just after the step's epoch check read the old one
    real = producer.store.epoch
    monkeypatch.setattr(producer.store, "epoch", lambda: next(answers, None) or real())
    with pytest.raises(ProduceError, match="Redis lost this run's state") as err:
        producer.step()
    assert err.value.exit_code == 1


def test_a_counter_behind_the_files_with_the_same_epoch_is_an_older_state(r: "redis.Redis", tokenizer_dir: Path,
                                                                         tmp_path: Path) -> None:
    """The other message stays for what it means: the same Redis (same epoch), its counter behind the files."""
    producer = attached(r, tokenizer_dir, tmp_path)
    [d] = producer.runs
    d.out.tokens["code_instruct-0"] = 100
    with pytest.raises(ProduceError, match="Redis went back to an older state"):
        producer.step()
