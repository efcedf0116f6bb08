"""worker.Worker's pubsub thread when Redis goes silent: rq's teardown closes the thread's connection while it
still polls (it waits 1 s for the thread, then closes), and the thread meets the closed socket. That must end
the thread quietly, not with a traceback in the worker's log (the chaos suite's redis-blackhole scenario met it
once: tests/chaos/test_chaos.py)."""
from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from redis.client import PubSubWorkerThread

from demo.stack import RedisServer
from tests.chaos.blackhole import BlackHole
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


def test_teardown_on_a_silent_connection_closes_the_pubsub_once(redis_server: RedisServer) -> None:
    """The worker's channel goes silent (tests/chaos/blackhole.py), so the thread never reads UNSUBSCRIBE's
    reply and is still blocked when teardown closes its connection. The worst interleaving is forced: the
    thread, woken by the disconnect, ends and closes the pubsub before teardown's own thread goes on. rq's
    unsubscribe then dies in redis-py's reset on ``connection = None`` (the worker exited 1 in the chaos
    suite); Worker.unsubscribe must end the thread, close the pubsub and raise nothing."""
    with BlackHole(upstream_port=redis_server.port) as hole:
        client = redis.Redis(port=hole.port)
        worker = SimpleNamespace(name="w", log=logging.getLogger("test.rqworker"), pubsub_channel_name="bq-ch")
        pubsub = client.pubsub()
        pubsub.subscribe(**{"bq-ch": lambda message: None})
        thread = pubsub.run_in_thread(sleep_time=60, daemon=True, exception_handler=lambda exc, ps, t:
                                      Worker._pubsub_exception_handler(worker, exc, ps, t))  # type: ignore[arg-type]
        assert pubsub.connection is not None
        assert hole.silence() == 1
        conn = pubsub.connection
        real_disconnect = conn.disconnect
        main = threading.current_thread()

        def disconnect(*args: Any, **kwargs: Any) -> None:
            real_disconnect(*args, **kwargs)
            if threading.current_thread() is main:
                thread.join(10)  # the thread wakes, ends and closes the pubsub before this thread goes on

        conn.disconnect = disconnect  # type: ignore[method-assign]
        worker.pubsub, worker.pubsub_thread = pubsub, thread
        Worker.unsubscribe(worker)  # type: ignore[arg-type]
        assert not thread.is_alive()
        assert pubsub.connection is None
        client.close()
