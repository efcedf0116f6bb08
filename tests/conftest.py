from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest
import redis

from demo.stack import RedisServer

if TYPE_CHECKING:
    from sglang_sim.launch import SimProcess
    from tests.procs import Workers

#: The timeout of a test marked ``e2e`` that sets none of its own: it runs real processes end to end (rq workers,
#: produce, the simulator), waits out leases and kills, and may share the machine with the other xdist workers. Every
#: other test has setup.cfg's ``timeout``, sized for a unit test.
E2E_TIMEOUT_S = 300


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give e2e tests their timeout; under pytest-xdist (``make test``), also hand them out first: they are most of
    the suite's time, and one started last would run alone while the other workers idle. Each xdist worker collects
    and orders alike (xdist checks that), and the order within each group is the collection order."""
    for item in items:
        if item.get_closest_marker("e2e") and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
    if hasattr(config, "workerinput"):  # an xdist worker: this order is the one the scheduler hands out
        items.sort(key=lambda item: item.get_closest_marker("e2e") is None)


@pytest.fixture(autouse=True)
def _budgetq_logging_restored() -> Iterator[None]:
    """Every test starts with the "budgetq" loggers as the interpreter left them. A command run in-process
    (``producer.cli.main``) configures them for a terminal (its own stderr handler, ``propagate = False``), and
    without this a later test's ``caplog``, whose handler sits on the root logger, would see none of their records
    (a test then passes alone and fails in the whole suite)."""
    saved = {}
    for name in ("budgetq", *[n for n in logging.root.manager.loggerDict if n.startswith("budgetq.")]):
        logger = logging.getLogger(name)
        saved[name] = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for name in [n for n in logging.root.manager.loggerDict if n == "budgetq" or n.startswith("budgetq.")]:
        logger = logging.getLogger(name)
        handlers, level, propagate = saved.get(name, ([], logging.NOTSET, True))
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database on the session's own server (flushing it is safe: we started it)."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield redis_server.url
    client.close()


@pytest.fixture
def r(redis_url: str) -> Iterator["redis.Redis"]:
    client: redis.Redis = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from demo.tokenizer import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("tok"), thinking="open")


@pytest.fixture
def sim_factory() -> Iterator[Callable[..., "SimProcess"]]:
    from sglang_sim.launch import SimProcess
    started: list[SimProcess] = []

    def start(*args: str) -> SimProcess:
        sim = SimProcess(list(args))
        sim.start()
        started.append(sim)
        return sim

    yield start
    for sim in started:
        sim.stop()


@pytest.fixture
def workers(redis_url: str, tmp_path: Path) -> Iterator[Callable[[str], "Workers"]]:
    from tests.procs import Workers
    made: list[Workers] = []

    def make(sim_url: str, **env: str) -> Workers:
        logdir = tmp_path / "worker-logs"
        logdir.mkdir(exist_ok=True)
        w = Workers(redis_url, sim_url, logdir, env)
        made.append(w)
        return w

    yield make
    for w in made:
        w.stop_all()
