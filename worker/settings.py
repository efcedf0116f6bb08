"""Settings module for ``rq worker -c worker.settings``.

rq reads only these UPPERCASE names from it. With ``-c`` rq does not look at the ``REDIS_URL`` environment
variable itself, so this module does. Everything else a worker needs (``SGLANG_URL``, concurrency, timeouts)
is read from the environment by ``worker.Worker`` (see worker/config.py).
"""
import os

from budget.keys import QUEUE_NAME

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUES = [QUEUE_NAME]
