"""``produce servers``, its metrics and ``produce run``'s pre-flight lines, read from what workers record (issue 29).

Real Redis; the records are written through budget/ (serverinfo.store_load, serverinfo.store_down) as workers write them, and the
RQ workers are registered through RQ's own API (``register_birth``), as ``rq worker`` registers itself.
"""
from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import redis
from rq import Queue, Worker

from budget import keys, serverinfo
from producer.cli import main
from producer.ops.metrics import render_metrics
from producer.ops.status import preflight, read_view, servers_table

SHARED = "http://10.0.0.5:30000"
LOCAL = "http://127.0.0.1:30000"


def _fields(**kw: Any) -> dict[str, Any]:
    return {k: kw.get(k) for k in serverinfo.SERVER_FIELDS} | {"in_flight": kw.get("in_flight", 0)}


def _rq_worker(r: "redis.Redis", name: str) -> Worker:
    w = Worker([Queue(keys.QUEUE_NAME, connection=r)], name=name, connection=r)
    w.register_birth()
    return w


def _record_two_hosts(r: "redis.Redis") -> None:
    """gpu1's worker uses the shared server (auto window) and its own loopback one; gpu2's finds the shared one
    down."""
    serverinfo.store_load(r, "a", "gpu1", 11, {
        SHARED: _fields(in_flight=40, window=48, capacity=64, peers=2, tokens=9000, tok_s=812.5),
        LOCAL: _fields(in_flight=3, window=16, capacity=16, peers=1, tokens=100, tok_s=20.0,
                       last_error="HTTP 503: overloaded", error_age_s=4.0, unavailable_age_s=4.0),
    }, concurrency=None, window=64)
    serverinfo.store_load(r, "b", "gpu2", 22, {SHARED: _fields(in_flight=0, window=None, tokens=0, tok_s=0.0)},
                     concurrency=8, window=8)
    serverinfo.store_down(r, "b", "gpu2", 22, {SHARED: "connection refused"})


def test_the_view_has_one_row_per_server_with_its_hosts_state_load_and_last_error(r: "redis.Redis") -> None:
    _record_two_hosts(r)
    _rq_worker(r, "a")
    _rq_worker(r, "b")
    view = read_view(r)
    assert view.rq_workers == ["a", "b"] and view.rq_hosts == [socket.gethostname()]
    rows = {row.server: row for row in view.rows}
    assert list(rows) == [f"gpu1 {LOCAL}", SHARED], "a loopback URL is its host's own server"
    shared = rows[SHARED]
    assert (shared.hosts, shared.workers, shared.state, shared.down_workers) == (["gpu1", "gpu2"], ["a", "b"], "down",
                                                                                  ["b"])
    assert (shared.in_flight, shared.window, shared.max_running_requests, shared.tokens_per_s) == (40, 48, 64, 812.5)
    assert shared.last_error == "connection refused" and shared.down_since is not None
    local = rows[f"gpu1 {LOCAL}"]
    assert (local.state, local.in_flight, local.window, local.last_error) == ("slow", 3, 16, "HTTP 503: overloaded")

    table = servers_table(view)
    first, *lines = table.splitlines()
    assert first == f"2 rq workers listen on queue {keys.QUEUE_NAME}, on 1 host ({socket.gethostname()})"
    shared_line = next(x for x in lines if x.startswith(SHARED))
    assert "gpu1,gpu2" in shared_line and "down since " in shared_line and "1 of 2 workers" in shared_line
    assert "connection refused" in shared_line and " 40 " in shared_line and " 64 " in shared_line
    assert "slow" in next(x for x in lines if x.startswith("gpu1 "))


def test_the_metrics_give_each_host_and_server_its_own_series(r: "redis.Redis") -> None:
    _record_two_hosts(r)
    _rq_worker(r, "a")
    text = render_metrics(r).splitlines()
    assert f'budgetq_rq_workers{{queue="{keys.QUEUE_NAME}"}} 1' in text
    assert f'budgetq_server_up{{host="gpu2",server="{SHARED}"}} 0' in text
    assert f'budgetq_server_up{{host="gpu1",server="{SHARED}"}} 1' in text
    assert f'budgetq_server_in_flight_requests{{host="gpu1",server="{SHARED}"}} 40' in text
    assert f'budgetq_server_max_running_requests{{host="gpu1",server="{SHARED}"}} 64' in text
    assert f'budgetq_server_slow{{host="gpu1",server="gpu1 {LOCAL}"}} 1' in text
    assert not any(x.startswith('budgetq_server_window_requests{host="gpu2"') for x in text), \
        "a fixed window over an unknown share has no sample"


def test_a_dead_workers_stale_load_is_left_out(r: "redis.Redis") -> None:
    serverinfo.store_load(r, "live", "gpu1", 1, {SHARED: _fields(in_flight=2)}, concurrency=4, window=4)
    sec, _ = r.time()
    stale = {"worker": "gone", "host": "gpu9", "pid": 9, "at": float(sec) - serverinfo.TTL_S - 5, "concurrency": 4,
             "window": 4, "servers": {"http://10.0.0.9:30000": _fields(in_flight=7)}}
    r.hset(keys.SERVER_LOAD, "gone", json.dumps(stale))
    assert [row.server for row in read_view(r).rows] == [SHARED]
    serverinfo.store_load(r, "live", "gpu1", 1, {SHARED: _fields(in_flight=1)}, concurrency=4, window=4, prune=False)
    assert r.hexists(keys.SERVER_LOAD, "gone")
    serverinfo.store_load(r, "live", "gpu1", 1, {SHARED: _fields(in_flight=1)}, concurrency=4, window=4)
    assert not r.hexists(keys.SERVER_LOAD, "gone"), "a write prunes dead workers' entries"
    serverinfo.clear_load(r, "live")
    assert "no worker has recorded an SGLang server" in servers_table(read_view(r))


def _preflight(r: "redis.Redis", to_enqueue: int = 16) -> tuple[list[str], list[str]]:
    said: list[str] = []
    warned: list[str] = []
    preflight(r, echo=said.append, warn=warned.append, to_enqueue=to_enqueue)
    return said, warned


def test_preflight_warns_once_when_no_worker_listens(r: "redis.Redis") -> None:
    said, warned = _preflight(r)
    assert said == []
    assert warned == [f"warning: no rq worker listens on queue {keys.QUEUE_NAME}: start one with "
                      "`rq worker -w worker.Worker -c worker.settings` (REDIS_URL and SGLANG_URL set); the work "
                      "waits queued"]
    said, warned = _preflight(r, to_enqueue=0)
    assert warned == [] and said == [f"no rq worker listens on queue {keys.QUEUE_NAME}; SGLang servers as the "
                                     "workers record them: none recorded yet"], "nothing to do: nothing to warn of"
    Queue(keys.QUEUE_NAME, connection=r).enqueue_call("worker.rqworker.run_chunk", args=({},))
    assert _preflight(r, to_enqueue=0)[1] != [], "chunks already queued wait for a worker too"


def test_preflight_counts_the_workers_and_names_every_server_when_all_are_down(r: "redis.Redis") -> None:
    _rq_worker(r, "a")
    _rq_worker(r, "b")
    serverinfo.store_load(r, "a", "gpu1", 11, {SHARED: _fields()}, concurrency=8, window=8)
    said, warned = _preflight(r)
    assert said == [f"2 rq workers listen on queue {keys.QUEUE_NAME}, on 1 host ({socket.gethostname()}); SGLang "
                    "servers as the workers record them: 1 ok"] and warned == []
    serverinfo.store_down(r, "a", "gpu1", 11, {SHARED: "connection refused"})
    serverinfo.store_down(r, "b", "gpu2", 22, {"http://10.0.0.6:30000": "/health answered 503"})
    said, warned = _preflight(r)
    assert said[0].endswith("SGLang servers as the workers record them: 2 down")
    assert warned == [f"warning: every SGLang server the workers recorded is down: {SHARED} on gpu1 (connection "
                      "refused); http://10.0.0.6:30000 on gpu2 (/health answered 503); their workers take no chunk "
                      "until one answers /health (produce servers)"]


def test_produce_servers_prints_the_table_and_json(r: "redis.Redis", redis_url: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _record_two_hosts(r)
    with pytest.raises(SystemExit) as done:
        main(["servers", "--redis-url", redis_url], standalone_mode=True)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"no rq worker listens on queue {keys.QUEUE_NAME}\nserver ") and SHARED in out
    with pytest.raises(SystemExit):
        main(["servers", "--json", "--redis-url", redis_url], standalone_mode=True)
    doc = json.loads(capsys.readouterr().out)
    assert doc["queue"] == keys.QUEUE_NAME and doc["rq_workers"] == []
    assert [(s["server"], s["state"]) for s in doc["servers"]] == [(f"gpu1 {LOCAL}", "slow"), (SHARED, "down")]
