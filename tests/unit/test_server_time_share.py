"""worker/sglang.py ServerTime: each request is charged dt / N of its server's busy time, so the charges of every request a
server ran sum to exactly the time it was busy, and a dataset's server time is what its requests cost."""
from __future__ import annotations

import pytest

from worker.sglang import ServerTime


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_two_overlapping_requests_share_the_time_both_ran() -> None:
    clock = Clock()
    st = ServerTime(["a"], clock)
    first = st.start("a")       # t 100: alone for 2 s
    clock.t = 102.0
    second = st.start("a")      # t 102: two at once for 2 s
    clock.t = 104.0
    one = st.end("a", first)    # 2 / 1 + 2 / 2
    clock.t = 106.0
    two = st.end("a", second)   # 2 / 2 + 2 / 1
    assert (one, two) == (3.0, 3.0)
    assert one + two == 6.0     # the 6 s the server was busy, not the 8 request-seconds


def test_idle_time_is_charged_to_nobody_and_servers_keep_their_own_clocks() -> None:
    clock = Clock()
    st = ServerTime(["a", "b"], clock)
    a = st.start("a")
    clock.t += 1
    assert st.end("a", a) == 1.0
    clock.t += 50              # idle: no request
    b1, a2 = st.start("b"), st.start("a")
    b2 = st.start("b")
    clock.t += 4
    assert st.end("a", a2) == 4.0        # alone at a, whatever b runs
    assert st.end("b", b1) == st.end("b", b2) == 2.0


def test_other_workers_requests_from_the_load_divide_the_time() -> None:
    clock = Clock()
    st = ServerTime(["a"], clock)
    mine = st.start("a")
    st.note_load("a", 4, peers=2)        # the server runs 4: this worker's 1 and 3 of another worker
    clock.t += 8
    assert st.end("a", mine) == 2.0      # 8 s shared by 4


def test_a_worker_alone_at_its_server_ignores_a_load_that_counts_ended_requests() -> None:
    """The load was read a moment ago: requests counted there may have ended since. Alone, the own count is exact."""
    clock = Clock()
    st = ServerTime(["a"], clock)
    mine = st.start("a")
    st.note_load("a", 5, peers=1)
    clock.t += 3
    assert st.end("a", mine) == 3.0


def test_without_a_count_each_peer_is_taken_to_run_as_many() -> None:
    clock = Clock()
    st = ServerTime(["a"], clock)
    ids = [st.start("a") for _ in range(2)]
    st.note_load("a", None, peers=3)     # 2 here, so 6 at the server
    clock.t += 6
    assert [st.end("a", b) for b in ids] == [1.0, 1.0]


def test_a_router_url_is_several_servers_busy_at_once() -> None:
    clock = Clock()
    st = ServerTime(["r"], clock)
    ids = [st.start("r") for _ in range(4)]
    st.note_load("r", 4, peers=1, servers=2)   # 4 requests over 2 servers behind the router: 2 each
    clock.t += 10
    assert sum(st.end("r", b) for b in ids) == pytest.approx(20.0)   # both servers busy for 10 s


def test_an_unknown_url_is_ignored() -> None:
    clock = Clock()
    st = ServerTime(["a"], clock)
    mine = st.start("a")
    st.note_load("elsewhere", 3, peers=2)  # a server the worker was not configured with: nothing to share
    clock.t += 1
    assert st.end("a", mine) == 1.0
