from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import redis

from tests.redis_server import RedisServer


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
def r(redis_url: str) -> Iterator["redis.Redis[bytes]"]:
    client: redis.Redis[bytes] = redis.Redis.from_url(redis_url)
    yield client
    client.close()
