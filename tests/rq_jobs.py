"""The chunk jobs in the queue, read back as a worker reads them: RQ's own Job class and JSON serializer."""
from __future__ import annotations

from typing import Any

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from budget import keys
from tests.replies import texts


def rq_reader(r: "redis.Redis") -> Queue:
    """The queue as a worker sees it: RQ's own Job class and JSON serializer."""
    return Queue(keys.QUEUE_NAME, connection=r, serializer=JSONSerializer)


def job_payloads(r: "redis.Redis") -> list[dict[str, Any]]:
    """The payload of every queued chunk job, in queue order, read as a worker reads it."""
    queue = rq_reader(r)
    out = []
    for job_id in texts(r.lrange(keys.RQ_QUEUE, 0, -1)):
        job = queue.fetch_job(job_id)
        assert job is not None
        out.append(job.args[0])
    return out
