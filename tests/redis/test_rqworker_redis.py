"""worker.Worker's pubsub thread when Redis goes silent: rq's teardown closes the thread's connection while it
still polls (it waits 1 s for the thread, then closes), and the thread meets the closed socket. That must end
the thread quietly, not with a traceback in the worker's log (the chaos suite's redis-blackhole scenario met it
once: tests/chaos/test_chaos.py)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import redis
from redis.client import PubSubWorkerThread

from worker.rqworker import Worker

CLOSED_SOCKET = TypeError("argument must be an int, or have a fileno() method.")  # redis-py's, on a closed socket


def handle(worker: object, pubsub: object, thread: PubSubWorkerThread) -> None:
    """As redis-py's thread calls the handler: inside the ``except`` that caught the error."""
    try:
        raise CLOSED_SOCKET
    except TypeError as exc:
        Worker._pubsub_exception_handler(worker, exc, pubsub, thread)  # type: ignore[arg-type]


def test_a_stopped_pubsub_thread_ends_quietly_on_its_closed_socket(r: "redis.Redis") -> None:
    worker = SimpleNamespace(name="w", log=logging.getLogger("test.rqworker"))
    pubsub = r.pubsub()
    pubsub.subscribe("bq-test-channel")
    thread = PubSubWorkerThread(pubsub, sleep_time=1)
    try:
        thread._running.set()  # running: rq's own handler decides, and anything but a lost connection ends it
        with pytest.raises(TypeError):
            handle(worker, pubsub, thread)
        thread.stop()  # what rq's unsubscribe does before it closes the connection
        handle(worker, pubsub, thread)
    finally:
        pubsub.close()
