"""bq:window (budget/window.py): the live workers with an automatic window on each SGLang server."""
from __future__ import annotations

import redis

from budget import keys, window


def test_beat_counts_the_live_workers_of_each_server_and_prunes_the_lapsed(r: "redis.Redis") -> None:
    r.zadd(keys.WINDOW, {f"http://s:1{keys.SEP}gone": 0})  # lapsed long ago (Redis time 0)
    assert window.beat(r, "a", ["http://s:1", "gpu-a http://127.0.0.1:30000"]) == \
        {"http://s:1": 1, "gpu-a http://127.0.0.1:30000": 1}
    assert window.beat(r, "b", ["http://s:1"]) == {"http://s:1": 2}
    assert window.beat(r, "a", ["http://s:1", "gpu-a http://127.0.0.1:30000"])["http://s:1"] == 2
    assert f"http://s:1{keys.SEP}gone".encode() not in r.zrange(keys.WINDOW, 0, -1)
    assert 0 < r.pttl(keys.WINDOW) <= window.TTL_MS


def test_a_worker_that_leaves_is_no_longer_counted(r: "redis.Redis") -> None:
    window.beat(r, "a", ["http://s:1"])
    window.beat(r, "b", ["http://s:1"])
    window.leave(r, "b", ["http://s:1"])
    assert window.beat(r, "a", ["http://s:1"]) == {"http://s:1": 1}
