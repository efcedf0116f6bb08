"""``produce servers``: one row per SGLang server, read-only, from what the workers record; and the one or two lines
``produce run`` says of the workers and servers before it enqueues.

Sources, all written by the workers, none asked over the network from here: RQ's worker registry of budgetq's queue
(who listens, on which host), ``bq:server_load`` (budget/serverinfo.py: each worker's requests in flight, window,
max_running_requests, tokens/s and last error per server) and ``bq:server_health`` (budget/serverinfo.py: who finds
which server down, since when). A server is named as the workers name it (budget/serverinfo.py ``server_name``):
its URL, with the host in front of a loopback one. Its state: ``down`` when a worker finds it down (no connection,
or /health 503), ``slow`` when a request to it timed out or was answered 5xx or 429 within SLOW_S, else ``ok``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import redis
from rq import Queue, Worker

from budget import keys, serverinfo
from budget.runtime import redis_now
from budget.serverinfo import utc_iso

WORKER_COMMAND = "rq worker -w worker.Worker -c worker.settings"


@dataclass
class ServerUse:
    """What the live workers of one host do with one server (one series of ``produce metrics``)."""

    server: str
    host: str
    workers: list[str] = field(default_factory=list)
    in_flight: int = 0
    window: int | None = None
    capacity: int | None = None
    tok_s: float | None = None
    down: dict[str, str] = field(default_factory=dict)  # worker -> why, for the workers that find it down
    down_since: float | None = None  # Redis time the first of them went down
    slow: bool = False
    last_error: str | None = None
    error_age_s: float | None = None


@dataclass(frozen=True)
class ServerRow:
    """One server: who uses it and how it does (``produce servers``, ``--json``)."""

    server: str
    hosts: list[str]
    workers: list[str]
    state: str  # ok / slow / down
    down_since: str | None  # UTC ISO time the first worker found it down
    down_for_s: float | None
    down_workers: list[str]
    in_flight: int
    window: int | None  # the windows its workers keep on it, summed (None: none known)
    max_running_requests: int | None
    tokens_per_s: float | None  # completion tokens/s its workers got from it over their last report
    last_error: str | None
    last_error_age_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _add(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else a + b


def server_uses(loads: list[dict[str, Any]], down: list[dict[str, Any]], now: float) -> list[ServerUse]:
    """Join the load entries and health entries (as budget/ loads them) into one ServerUse per (server, host)."""
    uses: dict[tuple[str, str], ServerUse] = {}

    def use(url: str, host: str) -> ServerUse:
        name = serverinfo.server_name(url, host)
        return uses.setdefault((name, host), ServerUse(name, host))

    for entry in loads:
        host, worker, age = str(entry.get("host")), str(entry.get("worker")), float(entry.get("age_s", 0.0))
        for url, f in entry["servers"].items():
            u = use(url, host)
            u.workers.append(worker)
            u.in_flight += int(f.get("in_flight") or 0)
            if isinstance(f.get("window"), int):
                u.window = int(_add(u.window, f["window"]) or 0)
            if isinstance(f.get("capacity"), int):
                u.capacity = max(u.capacity or 0, f["capacity"])
            if isinstance(f.get("tok_s"), (int, float)):
                u.tok_s = _add(u.tok_s, float(f["tok_s"]))
            unavailable = f.get("unavailable_age_s")
            if isinstance(unavailable, (int, float)) and unavailable + age <= serverinfo.SLOW_S:
                u.slow = True
            error_age = f.get("error_age_s")
            if isinstance(f.get("last_error"), str) and isinstance(error_age, (int, float)) \
                    and (u.error_age_s is None or error_age + age < u.error_age_s):
                u.last_error, u.error_age_s = f["last_error"], round(error_age + age, 1)
    for entry in down:
        host, worker = str(entry.get("host")), str(entry.get("worker"))
        since = float(entry.get("since", now))
        for url, why in entry["down"].items():
            u = use(url, host)
            if worker not in u.workers:
                u.workers.append(worker)
            u.down[worker] = str(why)
            u.down_since = since if u.down_since is None else min(u.down_since, since)
            u.last_error, u.error_age_s = str(why), 0.0  # what /health says now outranks an older request's error
    for u in uses.values():
        u.workers.sort()
    return sorted(uses.values(), key=lambda u: (u.server, u.host))


def server_rows(uses: list[ServerUse], now: float) -> list[ServerRow]:
    """One row per server, its hosts' uses summed."""
    by_server: dict[str, list[ServerUse]] = {}
    for u in uses:
        by_server.setdefault(u.server, []).append(u)
    rows = []
    for name, group in sorted(by_server.items()):
        down_workers = sorted(w for u in group for w in u.down)
        since = min((u.down_since for u in group if u.down_since is not None), default=None)
        window = None
        for u in group:
            window = _add(window, u.window)
        tok_s = None
        for u in group:
            tok_s = _add(tok_s, u.tok_s)
        errors = [u for u in group if u.last_error is not None]
        latest = min(errors, key=lambda u: u.error_age_s or 0.0) if errors else None
        capacities = [u.capacity for u in group if u.capacity]
        rows.append(ServerRow(
            server=name, hosts=sorted({u.host for u in group}), workers=sorted({w for u in group for w in u.workers}),
            state="down" if down_workers else "slow" if any(u.slow for u in group) else "ok",
            down_since=utc_iso(since) if since is not None else None,
            down_for_s=round(max(0.0, now - since), 1) if since is not None else None, down_workers=down_workers,
            in_flight=sum(u.in_flight for u in group), window=None if window is None else int(window),
            max_running_requests=max(capacities) if capacities else None,
            tokens_per_s=None if tok_s is None else round(tok_s, 1),
            last_error=latest.last_error if latest else None,
            last_error_age_s=latest.error_age_s if latest else None))
    return rows


@dataclass(frozen=True)
class ServersView:
    """Everything ``produce servers`` shows: who listens on the queue, and each server."""

    rq_workers: list[str]  # RQ worker names registered on budgetq's queue
    rq_hosts: list[str]
    uses: list[ServerUse]
    rows: list[ServerRow]

    def as_dict(self) -> dict[str, Any]:
        return {"queue": keys.QUEUE_NAME, "rq_workers": self.rq_workers, "rq_hosts": self.rq_hosts,
                "servers": [r.as_dict() for r in self.rows]}


def listening_workers(client: "redis.Redis") -> list[Any]:
    """The RQ workers registered on budgetq's queue (RQ's worker registry, through RQ's API)."""
    return sorted(Worker.all(queue=Queue(keys.QUEUE_NAME, connection=client)), key=lambda w: str(w.name))


def read_view(client: "redis.Redis") -> ServersView:
    """Read the view from Redis (raises redis.RedisError)."""
    now = redis_now(client)
    listening = listening_workers(client)
    uses = server_uses(serverinfo.read_load(client), serverinfo.read_down(client), now)
    return ServersView(rq_workers=[str(w.name) for w in listening],
                       rq_hosts=sorted({str(w.hostname) for w in listening if w.hostname}),
                       uses=uses, rows=server_rows(uses, now))


def _ago(seconds: float) -> str:
    s = int(seconds)
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s" if s >= 60 else f"{s}s"


def state_text(row: ServerRow) -> str:
    if row.state != "down":
        return row.state
    since = (row.down_since or "")[11:] or "?"
    share = "" if len(row.down_workers) == len(row.workers) else f", {len(row.down_workers)} of {len(row.workers)} workers"
    return f"down since {since} ({_ago(row.down_for_s or 0.0)}{share})"


def workers_line(view: ServersView) -> str:
    n, hosts = len(view.rq_workers), view.rq_hosts
    if not n:
        return f"no rq worker listens on queue {keys.QUEUE_NAME}"
    return (f"{n} rq worker{'s' if n != 1 else ''} listen{'s' if n == 1 else ''} on queue {keys.QUEUE_NAME}, on "
            f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} ({', '.join(hosts)})")


def _names(workers: list[str], most: int = 3) -> str:
    """The workers by name while they are few, else how many (--json lists them all)."""
    return ",".join(workers) if len(workers) <= most else f"{len(workers)} ({','.join(workers[:2])},...)"


def servers_table(view: ServersView) -> str:
    """The first line says who listens on the queue; then one row per server, or a line saying none is recorded."""
    head = ("server", "hosts", "workers", "state", "in flight", "window", "max running", "tok/s", "last error")
    body = [(r.server, ",".join(r.hosts), _names(r.workers), state_text(r), f"{r.in_flight:,}",
             "-" if r.window is None else f"{r.window:,}",
             "-" if r.max_running_requests is None else f"{r.max_running_requests:,}",
             "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
             "-" if r.last_error is None else f"{r.last_error} ({_ago(r.last_error_age_s or 0.0)} ago)")
            for r in view.rows]
    first = workers_line(view)
    if not body:
        return first + "\nno worker has recorded an SGLang server (none runs, or none started in the last 30 s)"
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return first + "\n" + "\n".join(lines)


def preflight(client: "redis.Redis", *, echo: Callable[[str], None], warn: Callable[[str], None],
              to_enqueue: int) -> None:
    """What ``produce run`` says before it enqueues: one line of who listens and how the recorded servers are; a
    warning when no worker listens (the work waits queued: a warning, workers may start later) and one when every
    recorded server is down. Both only when there is work for the workers (``to_enqueue`` samples, or chunks in
    the queue): a rerun of a finished run needs none. Best effort: a Redis error here is the run's to report."""
    try:
        view = read_view(client)
        waiting = to_enqueue > 0 or Queue(keys.QUEUE_NAME, connection=client).count > 0
    except redis.RedisError:
        return
    counts: dict[str, int] = {}
    for row in view.rows:
        counts[row.state] = counts.get(row.state, 0) + 1
    servers = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none recorded yet"
    if view.rq_workers or not waiting:
        echo(f"{workers_line(view)}; SGLang servers as the workers record them: {servers}")
    else:
        warn(f"warning: no rq worker listens on queue {keys.QUEUE_NAME}: start one with `{WORKER_COMMAND}` "
             "(REDIS_URL and SGLANG_URL set); the work waits queued")
    if waiting and view.rows and all(r.state == "down" for r in view.rows):
        named = "; ".join(f"{r.server} on {','.join(r.hosts)} ({r.last_error})" for r in view.rows)
        warn(f"warning: every SGLang server the workers recorded is down: {named}; their workers take no chunk "
             "until one answers /health (produce servers)")
