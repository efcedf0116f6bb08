"""budgetq workers: run with ``rq worker -w worker.Worker -c worker.settings``."""
from worker.rqworker import Worker

__all__ = ["Worker"]
