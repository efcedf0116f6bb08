"""producer/ops/metrics.py on a real redis-server: the Prometheus text says what ``produce status`` says.

Two datasets are set up through the same calls the producer and the workers make (enqueue_chunks, and the
ledger's set_budget, start_chunk, admit, commit, fail, discard), the exporter is bound on a free loopback port
and scraped over HTTP.
"""
from __future__ import annotations

import inspect
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from budget import keys
from budget.ledger import Admit, Ledger
from demo.stack import free_port
from producer.ops import metrics as metrics
from producer.ops.status import all_status
from producer.session.attach import JobSettings
from producer.session.loop import Item, enqueue_chunks, make_queue

SAMPLE = re.compile(r'^([a-z_]+)(\{[^}]*\})? (\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples of the text format, keyed by (name, labels); checks each family is announced once, first."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    announced: list[str] = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind == "gauge" and name not in announced, line
            announced.append(name)
        elif line.startswith("# HELP "):
            assert line.split()[2] not in announced, f"HELP after TYPE or twice: {line}"
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, labels, value = m.groups()
            assert name == announced[-1], f"{name} outside its family"
            key = (name, frozenset(LABEL.findall(labels or "")))
            assert key not in samples, f"duplicate sample {line}"
            samples[key] = float(value)
    return samples


def get(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def enqueue(r: "redis.Redis", name: str, n_chunks: int, size: int = 2) -> list[str]:
    chunks = [[Item(f"{name}-{c}-{i}", [1, 2, 3], False) for i in range(size)] for c in range(n_chunks)]
    return enqueue_chunks(r, make_queue(r), name, chunks, sampling_params={"max_new_tokens": 64}, think=None,
                          settings=JobSettings())


@pytest.fixture
def now() -> float:
    """The moment a test's buckets are written relative to and its scrapes read tok/s at: the 10-second buckets
    move with the clock, so a read a bucket boundary after the write would see another rate."""
    return time.time()


@pytest.fixture
def two_datasets(r: "redis.Redis", now: float) -> Iterator[None]:
    """alpha: open, predict, budget 1000, 3 chunks (one running: a commit, a request in flight, a failure);
    beta: closed at once by a budget of 0, its 2 queued chunks discarded."""
    ledger = Ledger(r)
    ledger.set_budget("alpha", 1000)
    ledger.set_mode("alpha", "predict", 64)
    alpha = enqueue(r, "alpha", 3)
    assert ledger.start_chunk("alpha", alpha[0]) == "ok"
    assert ledger.admit("alpha", "alpha-0-0", alpha[0], expected=40).verdict is Admit.START
    assert ledger.commit("alpha", "alpha-0-0", 37, {"id": "alpha-0-0"}, chunk=alpha[0], reserved=40,
                         finish_reason="stop").committed
    assert ledger.admit("alpha", "alpha-0-1", alpha[0], expected=40).verdict is Admit.START  # stays in flight
    assert ledger.fail("alpha", "alpha-1-0", alpha[1], {"id": "alpha-1-0", "reason": "400"})
    # 1200 tokens in the full 10-second bucket before last, none since: 60 tokens/s over those 20 s (the commit
    # script's layout)
    r.hset(keys.DatasetKeys("alpha").stats, f"t:{int(now // 10) - 2}", 1200)

    ledger.set_budget("beta", None)
    enqueue(r, "beta", 2)
    assert ledger.set_budget("beta", 0) == "closed"
    assert ledger.discard("beta", "budget reached") == 2
    yield


@pytest.fixture
def exporter(r: "redis.Redis", now: float) -> Iterator[str]:
    server = metrics.make_server(r, "127.0.0.1", 0, clock=lambda: now)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    assert isinstance(host, str)  # an AF_INET server's: typeshed allows bytes for other families
    yield f"http://{host}:{port}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def scrape(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        assert resp.status == 200
        return resp.headers["Content-Type"], resp.read().decode()


def test_scrape_reports_each_dataset(r: "redis.Redis", two_datasets: None, exporter: str) -> None:
    content_type, text = scrape(exporter)
    assert content_type == metrics.CONTENT_TYPE
    s = parse(text)
    assert get(s, "budgetq_redis_up") == 1
    assert get(s, "budgetq_datasets") == 2
    assert get(s, "budgetq_queue_length", queue="budgetq") == 3  # alpha's 3; beta's 2 were discarded
    assert get(s, "budgetq_dataset_info", dataset="alpha", mode="predict", status="open") == 1
    assert get(s, "budgetq_dataset_info", dataset="beta", mode="drain", status="closed") == 1

    assert get(s, "budgetq_budget_tokens", dataset="alpha") == 1000
    assert get(s, "budgetq_used_tokens", dataset="alpha") == 37
    assert get(s, "budgetq_reserved_tokens", dataset="alpha") > 0  # alpha-0-1's predicted length
    assert get(s, "budgetq_in_flight_requests", dataset="alpha") == 1
    assert get(s, "budgetq_done_samples", dataset="alpha") == 1
    assert get(s, "budgetq_failed_samples", dataset="alpha") == 1
    assert get(s, "budgetq_queued_chunks", dataset="alpha") == 2  # the third one is running
    assert get(s, "budgetq_unwritten_results", dataset="alpha") == 1
    assert get(s, "budgetq_completion_tokens_per_second", dataset="alpha") == 60.0
    assert get(s, "budgetq_responses", dataset="alpha", finish_reason="stop") == 1
    assert get(s, "budgetq_responses", dataset="alpha", finish_reason="length") == 0
    assert get(s, "budgetq_open", dataset="alpha") == 1

    assert get(s, "budgetq_budget_tokens", dataset="beta") == 0
    assert get(s, "budgetq_open", dataset="beta") == 0
    assert get(s, "budgetq_discarded_chunks", dataset="beta") == 2
    assert get(s, "budgetq_queued_chunks", dataset="beta") == 0
    assert get(s, "budgetq_used_tokens", dataset="beta") == 0


def test_every_gauge_is_what_produce_status_reads(r: "redis.Redis", two_datasets: None, exporter: str,
                                                  now: float) -> None:
    s = parse(scrape(exporter)[1])
    for row in all_status(r, now=now):
        for gauge in metrics.PER_DATASET:
            expected = gauge.read(row)
            key = (gauge.name, frozenset({("dataset", row.name)}))
            if expected is None:
                assert key not in s, key
            else:
                assert s[key] == pytest.approx(float(expected)), key


def test_unlimited_budget_has_no_budget_sample(r: "redis.Redis", exporter: str) -> None:
    Ledger(r).set_budget("gamma", None)
    enqueue(r, "gamma", 1)
    s = parse(scrape(exporter)[1])
    assert ("budgetq_budget_tokens", frozenset({("dataset", "gamma")})) not in s
    assert get(s, "budgetq_open", dataset="gamma") == 1
    assert get(s, "budgetq_queued_chunks", dataset="gamma") == 1


def test_a_finished_dataset_scrapes_as_complete(r: "redis.Redis", exporter: str) -> None:
    """Every selected sample handed out, nothing queued, running or unwritten: complete, not open (status says
    the same: tests/redis/test_status.py)."""
    from budget.runstate import RunState
    RunState(r).register("done_ds", "{}", time.time())
    Ledger(r).set_budget("done_ds", 1000)
    RunState(r).set_progress("done_ds", selected=3, todo=0)
    s = parse(scrape(exporter)[1])
    assert get(s, "budgetq_complete", dataset="done_ds") == 1 and get(s, "budgetq_open", dataset="done_ds") == 0
    info = [dict(labels) for name, labels in s if name == "budgetq_dataset_info"]
    assert [x["status"] for x in info if x["dataset"] == "done_ds"] == ["complete"]


def test_empty_redis_and_unknown_paths(exporter: str) -> None:
    s = parse(scrape(exporter)[1])
    assert get(s, "budgetq_redis_up") == 1 and get(s, "budgetq_datasets") == 0
    assert get(s, "budgetq_queue_length", queue="budgetq") == 0
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(exporter + "/secrets", timeout=5)
    assert err.value.code == 404


def test_redis_down_is_a_metric_not_a_failed_scrape() -> None:
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    s = parse(metrics.render_metrics(client))
    assert s == {("budgetq_redis_up", frozenset()): 0.0}


def test_binds_loopback_by_default(r: "redis.Redis") -> None:
    for fn in (metrics.serve_metrics, metrics.make_server):
        params = inspect.signature(fn).parameters
        assert (params["host"].default, params["port"].default) == ("127.0.0.1", 9464), fn.__name__
    server = metrics.make_server(r, port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()


def test_serve_metrics_serves_until_shut_down(r: "redis.Redis") -> None:
    ready: list[metrics.MetricsServer] = []
    bound, done = threading.Event(), threading.Event()

    def on_ready(server: metrics.MetricsServer) -> None:
        ready.append(server)
        bound.set()

    def run() -> None:
        metrics.serve_metrics(r, port=0, on_ready=on_ready)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert bound.wait(60), "the metrics server never bound its port"
    host, port = ready[0].server_address[:2]
    assert host == "127.0.0.1"
    assert "budgetq_redis_up 1" in scrape(f"http://{host}:{port}")[1]
    ready[0].shutdown()
    assert done.wait(5)
    thread.join(5)
