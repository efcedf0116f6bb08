"""What every budgetq process (a worker, ``produce``) sets up first: its Redis client and its log lines.

The Redis client (`connect`) is the one way budgetq opens one for budget work: short, explicit timeouts, never
inherited ones. The log lines (`configure_logs`, below the client) are text or JSON, with every URL's password
masked (`redact`), so a Redis URL with its secret never reaches a log.

Why the timeouts: a connection can go silent with no reset ever arriving (a crashed Redis host, a replaced pod, a network
black hole). A client then waits for a reply for as long as its ``socket_timeout``: redis-py's default is
none at all, and RQ sets 415 s (worker_ttl - 5) on its worker's pool because its blocking dequeue needs it. A
worker whose ledger waited that long would let its chunks' 20 s leases lapse (budget/ledger.py LEASE_MS) and
the producer would re-enqueue requests that were still running: GPU work done twice. So the ledger, the
worker's server-info thread and ``produce`` get pools of their own with every setting below shorter than the
lease: a silent connection is dropped and replaced, and the call resent, well before a lease runs out. RQ's
own dequeue connection keeps what RQ sets.

redis-py's defaults changed between major versions (timeouts, the default retry policy), so every setting is
passed explicitly here, and setup.cfg pins the major this was tested with. Resending is safe: every budget
script is idempotent (a resent commit hits the done guard), and RQ's enqueue of a chunk is guarded by
START_CHUNK (a chunk runs once however often its job is delivered).

``redis_now`` is Redis' own clock: what every worker and reader of a worker's entries (budget/serverinfo.py,
budget/serverinfo.py) compares ages with, so the hosts' clocks never matter.
"""
from __future__ import annotations

import json
import logging
import re
import socket
import sys
from datetime import datetime, timezone
from typing import Any, Callable, Final, TextIO, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

log = logging.getLogger("budgetq.redis")

T = TypeVar("T")

#: Longest wait for any one reply. Budget scripts answer in milliseconds (the slowest, a discard's batch of
#: 1,000 job marks, ~25 ms); 5 s also covers a Redis stalled on a slow fsync. With one resend (RETRIES) a call
#: on a silent connection fails or succeeds within ~2 x 5 s, half a lease, and the lease (refreshed every 5 s)
#: has slack for that.
SOCKET_TIMEOUT_S = 5.0
#: Longest wait for a new connection (TCP + AUTH + SELECT): a reachable Redis accepts in milliseconds.
SOCKET_CONNECT_TIMEOUT_S = 3.0
#: TCP keepalive on every connection, probing after 5 s idle, every 2 s, dropped after 3 unanswered probes:
#: an idle pooled connection to a host that vanished is found dead in ~11 s instead of the kernel's 2 hours.
#: (It cannot see a peer that still ACKs but never answers: SOCKET_TIMEOUT_S covers that one.)
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3
#: A connection idle longer than this is PINGed before it is used again (redis-py reconnects and retries that
#: PING once): a connection that died while it sat in the pool is replaced before a command is sent on it.
HEALTH_CHECK_INTERVAL_S = 5
#: After a timeout or connection error, redis-py reconnects and resends the command once, after 50-500 ms.
#: One resend only: waiting out a longer outage is the caller's (worker/dispatch.py, producer/session/loop.py), which
#: logs it; more resends here would only make a lost connection slower to report.
RETRIES = 1
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 0.5


class _Retry(Retry):
    """redis-py's Retry that says when a connection went silent. A timeout is the one failure nothing else
    reports: a refused or reset connection reaches the callers, which log their wait for Redis, but a timeout
    followed by a successful resend would pass unseen, and a worker cut off for 5 s is worth a log line."""

    def call_with_retry(self, do: Callable[[], T], fail: Callable[..., Any], *args: Any, **kwargs: Any) -> T:
        def failed(error: Exception, *count: Any) -> Any:
            if isinstance(error, (redis.TimeoutError, socket.timeout)):
                log.warning("Redis did not answer within %.0f s (%s): connection dropped", SOCKET_TIMEOUT_S, error)
            return fail(error, *count)
        return super().call_with_retry(do, failed, *args, **kwargs)


def _keepalive_options() -> dict[int, int]:
    """The kernel's knobs by their platform names (Linux; macOS calls the idle time TCP_KEEPALIVE)."""
    idle = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))
    options = {idle: KEEPALIVE_IDLE_S, getattr(socket, "TCP_KEEPINTVL", None): KEEPALIVE_INTERVAL_S,
               getattr(socket, "TCP_KEEPCNT", None): KEEPALIVE_COUNT}
    return {k: v for k, v in options.items() if k is not None}


def settings(connection_class: type = redis.Connection) -> dict[str, Any]:
    """The connection settings above as redis-py connection kwargs (keepalive only for TCP connections)."""
    out: dict[str, Any] = {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT_S,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "retry": _Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "retry_on_timeout": False,  # deprecated spelling; TimeoutError is in retry_on_error
    }
    if issubclass(connection_class, redis.Connection):  # TCP (and TLS); not a Unix socket
        out["socket_keepalive"] = True
        out["socket_keepalive_options"] = _keepalive_options()
    return out


def connect(url: str) -> "redis.Redis":
    """A client for ``url`` (redis://, rediss://, unix://) with budgetq's settings. Options given in the URL's
    query string (``?socket_timeout=10``) still win: redis-py applies them last."""
    connection_class = redis.ConnectionPool.from_url(url).connection_class
    return redis.Redis(connection_pool=redis.ConnectionPool.from_url(url, **settings(connection_class)))


def like(client: "redis.Redis") -> "redis.Redis":
    """A client on a new pool to the server ``client`` talks to (same address, database, credentials, TLS),
    with budgetq's settings instead of ``client``'s timeouts: for the worker, whose RQ connection has 415 s."""
    pool = client.connection_pool
    return _client(pool.connection_class, pool.connection_kwargs)


#: What ``like`` copies from the other client's pool: where the server is and who we are to it. Nothing else
#: (timeouts, retries, and the per-pool objects newer redis-py versions keep in the same dict).
_IDENTITY = frozenset({"host", "port", "path", "db", "username", "password", "credential_provider",
                       "client_name", "protocol", "encoding", "encoding_errors", "decode_responses",
                       "lib_name", "lib_version", "driver_info"})


def _client(connection_class: type, kwargs: dict[str, Any]) -> "redis.Redis":
    merged = {k: v for k, v in kwargs.items() if k in _IDENTITY or k.startswith("ssl")}
    merged.update(settings(connection_class))
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=connection_class, **merged))


def redis_now(r: "redis.Redis") -> float:
    """Redis' own clock, in seconds: the one clock every worker and reader shares."""
    sec, usec = r.time()
    return float(sec) + float(usec) / 1e6


# -- the log lines ------------------------------------------------------------------------------------------

FORMATS: Final = ("text", "json")
#: A URL's ``user:password@`` part: the password is replaced by ***.
_URL_PASSWORD: Final = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]*:)[^\s@/]+@")
#: LogRecord attributes that are not an event's extra fields.
_RECORD_ATTRS: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}
_MARK: Final = "_budgetq_handler"


def redact(text: str) -> str:
    """``text`` with the password of every URL in it replaced by ***."""
    return _URL_PASSWORD.sub(r"\g<head>***@", text)


def parse_format(value: str | None, name: str = "BUDGETQ_LOG_FORMAT") -> str:
    fmt = (value or "text").strip().lower() or "text"
    if fmt not in FORMATS:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(FORMATS)}")
    return fmt


def _jsonable(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return redact(str(value))


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, the extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": redact(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and not key.startswith("_") and key not in out:
                out[key] = _jsonable(value)
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(out, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """A classic format string; URL passwords masked."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class PlainFormatter(TextFormatter):
    """The message alone, as ``produce`` always printed it; ``debug: `` before debug lines."""

    def __init__(self) -> None:
        super().__init__("%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return "debug: " + text if record.levelno < logging.INFO else text


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the event (click's test runner swaps it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def make_formatter(fmt: str, text: logging.Formatter | None = None) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else (text or PlainFormatter())


def configure_logs(name: str, *, fmt: str, level: int | str, text: logging.Formatter | None = None) -> logging.Logger:
    """Send logger ``name``'s records (and its children's) to stderr, one line each, in ``fmt``; replaces the
    handler a previous call installed, so it can be called once per command."""
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        if getattr(handler, _MARK, False):
            logger.removeHandler(handler)
    handler = StderrHandler()
    setattr(handler, _MARK, True)
    handler.setFormatter(make_formatter(fmt, text))
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    logger.propagate = False
    return logger
