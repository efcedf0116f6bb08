"""``produce metrics``: every dataset's budget state as Prometheus text over HTTP, read-only.

Each scrape reads Redis afresh (``producer.ops.status.all_status``, the length of the shared RQ queue, and the
per-server view of ``produce servers``, producer/ops/status.py), so the
exporter holds no state: it can run anywhere that reaches Redis, several of them can run at once, and it needs no
attached ``produce``. It binds 127.0.0.1 by default: the figures name the datasets and their progress, so expose
it to a Prometheus on another host on purpose (``--host``), never by accident.

Every figure is a gauge, ``used`` included: ``--new-run`` and the reconciliation of a rerun can lower it, and a
Prometheus counter must never go down. A Redis that does not answer is reported as ``budgetq_redis_up 0`` in a
successful scrape (the exporter itself is fine), so one alert on that metric covers it.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import redis
from rq import Queue

from budget import keys, serverinfo
from producer.errors import ProduceError
from producer.ops.status import DatasetStatus, ServersView, ServerUse, all_status, read_view

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9464
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # Prometheus text exposition format 0.0.4
REDIS_UP_HELP = "1 if Redis answered this scrape, 0 if not."


@dataclass(frozen=True)
class Gauge:
    """One per-dataset metric family: its name, help text and how to read it from a dataset's status
    (``None``: no sample for that dataset, e.g. the budget of an unlimited one)."""

    name: str
    help: str
    read: Callable[[DatasetStatus], float | int | None]


PER_DATASET: tuple[Gauge, ...] = (
    Gauge("budgetq_budget_tokens", "Completion-token budget of the dataset (no sample: unlimited).",
          lambda s: s.budget),
    Gauge("budgetq_used_tokens", "Completion tokens committed: the budget counter.", lambda s: s.used),
    Gauge("budgetq_reserved_tokens", "Tokens reserved by requests in flight (predict: expected length; "
          "strict: max_new_tokens each; drain: 0).", lambda s: s.reserved),
    Gauge("budgetq_in_flight_requests", "Requests running on SGLang now.", lambda s: s.in_flight),
    Gauge("budgetq_done_samples", "Samples with a committed response.", lambda s: s.done),
    Gauge("budgetq_selected_samples", "Samples selected for the run (no sample: not recorded).",
          lambda s: s.selected),
    Gauge("budgetq_failed_samples", "Samples whose every attempt failed (they go to failed.jsonl).",
          lambda s: s.failed),
    Gauge("budgetq_not_run_samples", "Samples of a closed dataset that will not run (budget reached).",
          lambda s: s.not_run),
    Gauge("budgetq_discarded_chunks", "Chunk jobs canceled because the dataset closed.", lambda s: s.discarded_chunks),
    Gauge("budgetq_queued_chunks", "Chunk jobs of the dataset waiting in the RQ queue.", lambda s: s.queued_chunks),
    Gauge("budgetq_unwritten_results", "Committed results in Redis not yet written to disk by produce.",
          lambda s: s.unwritten),
    Gauge("budgetq_late_commits", "Responses committed after their chunk had lost its lease (kept, counted).",
          lambda s: s.late),
    Gauge("budgetq_completion_tokens_per_second", "Completion tokens committed per second over the full "
          "10-second buckets of the last minute, from the first with tokens (the running bucket is left out).", lambda s: s.tokens_per_s),
    Gauge("budgetq_open", "1 while the dataset admits requests, 0 once it is closed or complete.",
          lambda s: 1 if s.status == "open" else 0),
    Gauge("budgetq_complete", "1 once every selected sample ran and nothing is left queued, running or unwritten.",
          lambda s: 1 if s.status == "complete" else 0),
)


def _label(value: str) -> str:
    """A label value escaped as the text format requires (dataset names are already [A-Za-z0-9_-])."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float | int) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _family(lines: list[str], name: str, help_text: str, samples: list[tuple[str, float | int]]) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} gauge")
    lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)


def render_metrics(client: "redis.Redis", now: float | None = None) -> str:
    """The Prometheus text of every dataset in this Redis, plus the shared queue and Redis' own health; ``now``
    (unix time, default: the clock) is when the tok/s are read."""
    started = time.monotonic()
    lines: list[str] = []
    try:
        rows = all_status(client, now=now)
        queue_length = int(Queue(keys.QUEUE_NAME, connection=client).count)  # RQ's key, through RQ
    except redis.RedisError:
        _family(lines, "budgetq_redis_up", REDIS_UP_HELP, [("", 0)])
        return "\n".join(lines) + "\n"
    _family(lines, "budgetq_redis_up", REDIS_UP_HELP, [("", 1)])
    _family(lines, "budgetq_queue_length", "Jobs waiting in the shared RQ queue (every dataset's chunks).",
            [(f'{{queue="{_label(keys.QUEUE_NAME)}"}}', queue_length)])
    _family(lines, "budgetq_datasets", "Datasets known to this Redis.", [("", len(rows))])
    _family(lines, "budgetq_dataset_info", "Always 1; the labels give the dataset's budget mode and status.",
            [(f'{{dataset="{_label(r.name)}",mode="{_label(r.mode)}",status="{_label(r.status)}"}}', 1)
             for r in rows])
    for gauge in PER_DATASET:
        samples = [(f'{{dataset="{_label(r.name)}"}}', value) for r in rows
                   if (value := gauge.read(r)) is not None]
        _family(lines, gauge.name, gauge.help, samples)
    _family(lines, "budgetq_responses", "Committed responses by finish reason (length: cut at max_new_tokens).",
            [(f'{{dataset="{_label(r.name)}",finish_reason="{reason}"}}', count) for r in rows
             for reason, count in (("stop", r.finish_stop), ("length", r.finish_length))])
    try:
        down = serverinfo.read_down(client)
    except redis.RedisError:
        down = []
    _family(lines, "budgetq_server_down_seconds", "Seconds since a worker found this SGLang server down (no connection, "
            "or /health 503); only down servers are listed (budget/serverinfo.py).",
            [(f'{{worker="{_label(str(e.get("worker")))}",host="{_label(str(e.get("host")))}",'
              f'server="{_label(url)}"}}', round(e["for_s"], 1)) for e in down for url in sorted(e["down"])])
    try:
        view = read_view(client)
    except redis.RedisError:
        view = None
    if view is not None:
        _server_families(lines, view)
    _family(lines, "budgetq_scrape_duration_seconds", "Time this scrape took to read Redis.",
            [("", round(time.monotonic() - started, 6))])
    return "\n".join(lines) + "\n"


#: Per (server, host) families from ``produce servers``' view (producer/ops/status.py): what the live workers of
#: ``host`` do with ``server``. No sample where the value is unknown (a fixed BUDGETQ_CONCURRENCY over several
#: servers has no per-server window; max_running_requests is known to the automatic window only).
PER_SERVER: tuple[tuple[str, str, Callable[[ServerUse], float | int | None]], ...] = (
    ("budgetq_server_workers", "Live workers of this host that use this SGLang server.", lambda u: len(u.workers)),
    ("budgetq_server_up", "0 while a worker of this host finds this SGLang server down (no connection, or /health "
     "503), else 1.", lambda u: 0 if u.down else 1),
    ("budgetq_server_slow", "1 when a request of this host's workers to this server timed out or was answered 5xx "
     "or 429 in the last minute (and it is not down).", lambda u: 1 if u.slow and not u.down else 0),
    ("budgetq_server_in_flight_requests", "Requests this host's workers have in flight on this server.",
     lambda u: u.in_flight),
    ("budgetq_server_window_requests", "Requests this host's workers keep in flight on this server at most (their "
     "windows).", lambda u: u.window),
    ("budgetq_server_max_running_requests", "Requests the server runs at once, as the workers' automatic window "
     "read it (all DP ranks).", lambda u: u.capacity),
    ("budgetq_server_completion_tokens_per_second", "Completion tokens per second this server answered this host's "
     "workers, over their last report (5 s).", lambda u: u.tok_s),
)


def _server_families(lines: list[str], view: ServersView) -> None:
    _family(lines, "budgetq_rq_workers", "RQ workers registered on the queue (RQ's worker registry).",
            [(f'{{queue="{_label(keys.QUEUE_NAME)}"}}', len(view.rq_workers))])
    _family(lines, "budgetq_rq_worker_hosts", "Hosts the RQ workers registered on the queue run on.",
            [(f'{{queue="{_label(keys.QUEUE_NAME)}"}}', len(view.rq_hosts))])
    for name, help_text, read in PER_SERVER:
        _family(lines, name, help_text, [(f'{{host="{_label(u.host)}",server="{_label(u.server)}"}}', value)
                                         for u in view.uses if (value := read(u)) is not None])


class MetricsServer(ThreadingHTTPServer):
    """Serves ``GET /metrics``; one thread per request, all sharing the (thread-safe) Redis client."""

    daemon_threads = True

    def __init__(self, client: "redis.Redis", address: tuple[str, int],
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.clock = clock  # when a scrape reads its tok/s (tests pin it: the 10 s buckets move with the clock)
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, CONTENT_TYPE, render_metrics(self.server.client, self.server.clock()))
        elif path == "/":
            self._send(200, "text/plain; charset=utf-8", "budgetq metrics: GET /metrics\n")
        else:
            self._send(404, "text/plain; charset=utf-8", "not found: GET /metrics\n")

    def _send(self, status: int, content_type: str, body: str) -> None:
        data = body.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every 15 s would flood stderr; errors reach the scraper as budgetq_redis_up 0


def make_server(client: "redis.Redis", host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                clock: Callable[[], float] = time.time) -> MetricsServer:
    """Bind the exporter (``port=0``: any free port, see ``server_address``) without serving yet."""
    return MetricsServer(client, (host, port), clock)


def serve_metrics(client: "redis.Redis", host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                  on_ready: Callable[[MetricsServer], None] | None = None) -> None:
    """Serve ``http://HOST:PORT/metrics`` until ``shutdown()`` or an interrupt (KeyboardInterrupt propagates).

    ``on_ready`` gets the bound server (its ``server_address``, e.g. to print it) before serving starts. A socket
    error (the port is taken) is a ProduceError (exit 1)."""
    try:
        server = make_server(client, host, port)
        try:
            if on_ready is not None:
                on_ready(server)
            server.serve_forever()
        finally:
            server.server_close()
    except OSError as exc:
        raise ProduceError(f"cannot listen on {host}:{port}: {exc}") from None
