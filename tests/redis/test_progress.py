"""Progress bars: validating, rendering and enqueueing each show one on stderr when asked, and nothing otherwise.

``produce`` asks for them when stderr is a terminal and ``--quiet`` is not given; stdout (the summary table,
``--json``) never carries one.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import redis

from budget import keys
from producer.session.loop import Producer
from tests.producers import code_inputs

PHASES = ("validating", "rendering", "enqueueing")


@pytest.mark.parametrize("show", [True, False])
def test_each_long_phase_has_a_bar_on_stderr(show: bool, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    inputs, options = code_inputs(tokenizer_dir, tmp_path / "out", chunk_size=1, show_progress=show)
    producer = Producer(r, inputs.prepared, options, echo=lambda msg: None)
    producer.attach()
    producer.run(detach=True)
    assert r.llen(keys.RQ_QUEUE) == 150
    out, err = capsys.readouterr()
    assert out == ""
    for phase in PHASES:
        assert (f"{phase}:" in err) == show, err


def test_a_batch_redis_refuses_goes_back_to_the_todo_list(r: "redis.Redis", redis_url: str, tokenizer_dir: Path,
                                                         tmp_path: Path) -> None:
    """An enqueue that fails must not drop its samples: they go back to the front of the to-do list, so an
    attached run enqueues them later instead of finishing without them. Here Redis refuses the batch's queue
    push (an ACL user without RPUSH/LPUSH, on our own session server), so MULTI/EXEC aborts as a whole."""
    inputs, options = code_inputs(tokenizer_dir, tmp_path / "out")
    r.acl_setuser("nopush", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                  categories=["+@all"], commands=["-rpush", "-lpush"])
    try:
        limited = redis.Redis.from_url(redis_url.replace("redis://", "redis://nopush:pw@"))
        producer = Producer(limited, inputs.prepared, options, echo=lambda msg: None)
        producer.attach()
        [d] = producer.runs
        before = list(d.todo)
        with pytest.raises(redis.RedisError):
            producer.run(detach=True)
        assert list(d.todo) == before and d.enqueued_samples == 0
        assert r.llen(keys.RQ_QUEUE) == 0 and r.hlen(keys.DatasetKeys("code_instruct").pending) == 0
    finally:
        r.acl_deluser("nopush")
    producer = Producer(r, inputs.prepared, options, echo=lambda msg: None)
    producer.attach()
    producer.run(detach=True)
    assert r.llen(keys.RQ_QUEUE) == -(-150 // 8)


def test_the_progress_line_follows_a_budget_changed_while_attached(r: "redis.Redis", tokenizer_dir: Path,
                                                                   tmp_path: Path) -> None:
    """``produce budget NAME AMOUNT`` from another shell: the attached produce's next step shows the new budget
    (it showed the one it attached with)."""
    from producer.ops.status import change_budget
    inputs, options = code_inputs(tokenizer_dir, tmp_path / "out")
    producer = Producer(r, inputs.prepared, options, echo=lambda msg: None)
    producer.attach()
    [d] = producer.runs
    change_budget(r, d.name, 123_456)
    producer.step()
    assert d.budget == 123_456 and "tokens 0/123456 " in producer.progress_line()
    producer.release()
