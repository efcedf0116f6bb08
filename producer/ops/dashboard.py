"""``produce dashboard``: rq-dashboard 0.9.0's own web app, reading every job with RQ's JSON serializer.

Why not ``rq-dashboard --json``: that flag sets ``rq_dashboard.web.config.serializer``, which the queue and job
views pass on, but three code paths of 0.9.0 build RQ objects without it and so unpickle budgetq's JSON jobs:

- ``Worker.all(connection=...)`` (the Workers page and ``workers.json``): a worker's ``get_current_job`` then
  fetches the job with pickle, so ``workers.json`` answers 500 whenever a worker runs a chunk;
- ``Job.fetch(job_id, connection=...)`` (the job page) and ``requeue_job(job_id, connection=...)``;
- ``Queue.all(connection=...)`` (the queue list; harmless today, since it only counts, but the same mistake).

So this module keeps rq-dashboard's blueprint, templates, routes and basic auth as they are, and only replaces
those four names in ``rq_dashboard.web``'s namespace (module globals that its views look up at each request)
with subclasses whose ``serializer`` defaults to JSON (and whose queue name defaults to budgetq's, for the Jobs
tab, which names none). An explicit serializer or name still wins. rq-dashboard is pinned
to 0.9.0 beside rq 3 (docs/operations.md); `install_json_serializer` checks that the names it replaces are still
there, so a newer rq-dashboard that renames them fails at start, not on a page.

Basic auth is the app's own (`make_app`), not rq-dashboard's blueprint hook, so that several apps can be built
in one process (tests do).
"""
from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
from typing import TYPE_CHECKING, Any

from budget.keys import QUEUE_NAME
from producer.errors import ProduceError, UsageError

if TYPE_CHECKING:
    from flask import Flask

log = logging.getLogger("budgetq.dashboard")

#: The rq-dashboard release whose code paths this module was read against.
RQ_DASHBOARD_VERSION = "0.9.0"
_PATCHED = ("Worker", "Queue", "Job", "requeue_job")


class DashboardError(ProduceError):
    """rq-dashboard is missing or not the release this module knows; the message says what to install (exit 1)."""


def check_exposure(host: str, username: str | None, password: str | None) -> None:
    """Refuse (exit 2) half a basic-auth pair, and an address beyond this machine without basic auth: the pages
    show every job's arguments and the dataset names."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if bool(username) != bool(password):
        raise UsageError("give both --username and --password (RQ_DASHBOARD_USERNAME, RQ_DASHBOARD_PASSWORD), "
                         "or neither")
    if not loopback and not (username and password):
        raise UsageError(f"--host {host} exposes the dashboard beyond this machine: set RQ_DASHBOARD_USERNAME "
                         "and RQ_DASHBOARD_PASSWORD (basic auth)")


def install_json_serializer() -> None:
    """Make every RQ object rq-dashboard's views build read jobs with RQ's JSONSerializer (idempotent)."""
    try:
        from rq_dashboard import web
        from rq_dashboard.version import VERSION
    except ImportError as exc:
        raise DashboardError(f"rq-dashboard is not installed ({exc}): pip install "
                             f"'rq-dashboard=={RQ_DASHBOARD_VERSION}' six") from None
    from rq import Queue, Worker, requeue_job
    from rq.job import Job
    from rq.serializers import JSONSerializer

    missing = [name for name in _PATCHED if not hasattr(web, name)]
    if missing or not hasattr(web, "config"):
        raise DashboardError(f"rq-dashboard {VERSION} is not laid out like {RQ_DASHBOARD_VERSION} "
                             f"(no {', '.join(missing) or 'config'} in rq_dashboard.web): install "
                             f"rq-dashboard=={RQ_DASHBOARD_VERSION}")
    if VERSION != RQ_DASHBOARD_VERSION:
        log.warning("rq-dashboard %s: budgetq was checked against %s", VERSION, RQ_DASHBOARD_VERSION)
    if getattr(web, "_budgetq_json", False):
        return

    class JSONJob(Job):
        """A job fetched with JSON unless told otherwise (the job page, a worker's current job)."""

        @classmethod
        def fetch(cls, id: str, connection: Any = None, serializer: Any = None) -> Job:
            return super().fetch(id, connection=connection, serializer=serializer or JSONSerializer)

    class JSONQueue(Queue):
        """Queues listed with JSON and JSONJob (the Queues page). A queue built without a name is budgetq's, not
        RQ's "default": the Jobs tab (``/view/jobs``, which names none) then opens on the chunks, not on "No jobs"."""

        def __init__(self, name: str = QUEUE_NAME, *args: Any, **kwargs: Any) -> None:
            super().__init__(name, *args, **kwargs)

        @classmethod
        def all(cls, connection: Any = None, job_class: Any = None, serializer: Any = None,
                death_penalty_class: Any = None) -> list[Queue]:
            return super().all(connection=connection, job_class=job_class or JSONJob,
                               serializer=serializer or JSONSerializer, death_penalty_class=death_penalty_class)

    class JSONWorker(Worker):
        """Workers listed with JSON and JSONJob, so `get_current_job` reads a busy worker's chunk job."""

        @classmethod
        def all(cls, connection: Any = None, job_class: Any = None, queue_class: Any = None, queue: Any = None,
                serializer: Any = None) -> list[Any]:
            return super().all(connection=connection, job_class=job_class or JSONJob,
                               queue_class=queue_class or JSONQueue, queue=queue,
                               serializer=serializer or JSONSerializer)

    web.config.serializer = JSONSerializer  # what --json sets: the queue and job views pass it on
    web.Job = JSONJob
    web.Queue = JSONQueue
    web.Worker = JSONWorker
    web.requeue_job = functools.partial(requeue_job, serializer=JSONSerializer)
    web._budgetq_json = True


def make_app(redis_url: str, *, username: str | None, password: str | None, url_prefix: str = "",
             disable_delete: bool = True, poll_interval_ms: int | None = None) -> "Flask":
    """rq-dashboard's Flask app (its own factory and blueprint) on ``redis_url``, JSON throughout.

    Basic auth is on when ``username`` and ``password`` are given. It guards the whole app (pages, JSON,
    static files) with a constant-time comparison, and it is the app's, not the blueprint's: rq-dashboard's own
    `add_basic_auth` adds a hook to its module-level blueprint, which Flask refuses once the blueprint has been
    registered, so that would allow one app per process."""
    if bool(username) != bool(password):
        raise DashboardError("give both the dashboard user name and password (RQ_DASHBOARD_USERNAME and "
                             "RQ_DASHBOARD_PASSWORD), or neither")
    install_json_serializer()
    from rq_dashboard.cli import make_flask_app
    from rq_dashboard.web import setup_rq_connection

    app: Flask = make_flask_app(None, None, None, url_prefix)
    app.config["RQ_DASHBOARD_REDIS_URL"] = redis_url
    app.config["RQ_DASHBOARD_DISABLE_DELETE"] = disable_delete
    app.config["DEPRECATED_OPTIONS"] = []
    if poll_interval_ms:
        app.config["RQ_DASHBOARD_POLL_INTERVAL"] = poll_interval_ms
    if username and password:
        _require_basic_auth(app, username, password)
    setup_rq_connection(app)
    _add_budget_page(app, redis_url, url_prefix, (poll_interval_ms or 5000) / 1000)
    return app


def _add_budget_page(app: "Flask", redis_url: str, url_prefix: str, refresh_s: float) -> None:
    """PREFIX/budget: ``produce status``'s screen (budget, used, reserved, in flight, tok/s, eta, the servers that
    are down) read from Redis at each request and reloaded every ``refresh_s``: rq-dashboard shows queues and jobs,
    which say nothing of tokens. Behind the same basic auth as every page (it is the app's)."""
    import html

    import redis
    from flask import Response

    from producer.ops.status import all_status, status_text

    client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)

    @app.route(f"{url_prefix}/budget")
    def budget_page() -> Response:
        try:
            text = status_text(client, all_status(client))
        except redis.RedisError as exc:
            text = f"Redis unreachable ({exc})"
        page = (f'<!doctype html><html><head><meta http-equiv="refresh" content="{refresh_s:g}">'
                f"<title>budgetq budget</title></head><body><p><a href=\"{url_prefix}/\">rq-dashboard</a></p>"
                f"<pre>{html.escape(text)}</pre></body></html>")
        return Response(page, 200, {"Content-Type": "text/html; charset=utf-8"})


def _require_basic_auth(app: "Flask", username: str, password: str) -> None:
    from flask import Response, request

    want_user, want_password = username.encode(), password.encode()

    @app.before_request
    def basic_auth() -> Response | None:
        auth = request.authorization
        user = (auth.username or "").encode() if auth is not None else b""
        given = (auth.password or "").encode() if auth is not None else b""
        # Both compared every time, so the answer's timing tells nothing about which one was wrong.
        ok = hmac.compare_digest(user, want_user) & hmac.compare_digest(given, want_password)
        if auth is not None and auth.type == "basic" and ok:
            return None
        return Response("Please log in", 401, {"WWW-Authenticate": 'Basic realm="budgetq rq-dashboard"'})


def serve(app: "Flask", host: str, port: int, on_ready: Any = None) -> None:
    """Serve ``app`` until interrupted (KeyboardInterrupt propagates), with werkzeug's threaded server (as
    rq-dashboard's CLI does: Flask's ``app.run``), so a slow page never holds up the others. ``on_ready(host,
    port)`` is called once bound. A socket error (the port is taken) is a ProduceError (exit 1)."""
    from werkzeug.serving import make_server

    try:
        server = make_server(host, port, app, threaded=True)
        if on_ready is not None:
            bound_host, bound_port = server.server_address[:2]
            on_ready(str(bound_host), int(bound_port))
        try:
            server.serve_forever()
        finally:
            server.server_close()
    except OSError as exc:
        raise ProduceError(f"cannot listen on {host}:{port}: {exc}") from None
