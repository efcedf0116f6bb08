"""Workers started the documented way never run a pickle payload or a function outside the allowlist."""
from __future__ import annotations

import os
import pickle
import subprocess
import zlib
from pathlib import Path
from typing import Any

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from budget import keys
from demo.stack import worker_argv


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def test_pickle_and_foreign_functions_are_refused(r: "redis.Redis", redis_url: str, tmp_path: Path) -> None:
    json_queue = Queue(keys.QUEUE_NAME, connection=r, serializer=JSONSerializer)
    # 1. A JSON job naming os.system.
    foreign = json_queue.enqueue("os.system", f"touch {tmp_path / 'json-ran'}", job_id="foreign")
    # 2. A job whose payload is a pickle that runs a command when unpickled, written straight into Redis.
    decoy = json_queue.enqueue("os.getcwd", job_id="pickled")
    r.hset(keys.rq_job_key("pickled"), "data", zlib.compress(pickle.dumps(Evil(tmp_path / "pickle-ran"))))
    # 3. A job enqueued with RQ's default (pickle) serializer.
    Queue(keys.QUEUE_NAME, connection=r).enqueue("os.system", f"touch {tmp_path / 'default-ran'}",
                                                 job_id="default_pickle")
    env = {**os.environ, "REDIS_URL": redis_url, "SGLANG_URL": "http://127.0.0.1:9"}
    res = subprocess.run([*worker_argv("guard"), "--burst"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr  # the worker stayed up and drained the queue
    assert not list(tmp_path.iterdir()), "a refused job ran"
    for job_id in ("foreign", "pickled", "default_pickle"):
        assert r.hget(keys.rq_job_key(job_id), "status") == b"failed", job_id
    assert "is not allowed by worker.Worker" in res.stderr + res.stdout
    assert foreign.id and decoy.id
