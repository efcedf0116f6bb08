"""What the SGLang servers say about themselves (``GET /get_server_info``), kept for the datasets' manifests.

A manifest should say which engine and model produced a dataset. SGLang answers ``/get_server_info`` with every
server argument, ``api_key`` included, so only SERVER_INFO_KEYS (scalar values) are ever kept, and a URL is kept
without user, password, query or fragment.

Who writes and who reads:

- each worker fetches it from each of its servers when it starts, in a background thread that never delays or
  fails the worker, and again every REFRESH_S while it runs (worker/serverinfo.py), into the hash
  ``bq:server_info`` (budget/keys.py): field ``"<worker host> <url>"`` (so that ``http://127.0.0.1:30000`` on
  two GPU hosts stays two servers), value JSON of the kept keys plus ``url``, ``host`` and ``fetched`` (UTC,
  from Redis' clock);
- ``produce`` reads it when it writes the manifests at the end of a run, and ``produce export --redis-url``;
  ``produce export --server-url`` fetches directly with `fetch`.

Freshness: readers ignore entries older than MAX_AGE_S (two missed refreshes: their workers are gone or their
server is down), a worker's write prunes them, and the hash expires MAX_AGE_S after the last write, so once every
worker has stopped it disappears by itself.

Behind SGLang's router (SGLang Model Gateway, ``sglang-router``) ``/get_server_info`` answers the router's own
statistics (``{"router_manager": true, "routers_count": 1, "workers_count": 2}``): no version, no model. That answer
is never recorded as a server's: `discover` asks the router for its servers (``GET /workers``) and each of them
for its own ``/get_server_info``; those entries carry ``via`` (the router's URL). When the router lists none that
answer, the one entry kept is the router's URL with ``router: true`` and nothing else: version and model unknown,
and the manifest says so (``server_unknown``).

This module is shared by the producer and the workers, so it uses the standard library's HTTP client only.

Beside it, what each live worker reports of its SGLang servers: which it finds down (``bq:server_health``) and what it
does with each (``bq:server_load``), for ``produce``, ``produce status``, ``produce servers`` and ``produce
metrics``.

Both keys (budget/keys.py) are one Redis hash of one JSON entry per live worker: field = the RQ worker's name,
value = a JSON object with ``worker``, ``host``, ``pid`` and ``at``, the Redis time of its last write (so the hosts'
clocks never matter). A worker rewrites its entry while it has something to say and deletes it when it stops; one
killed meanwhile writes no more: its entry is stale TTL_S after ``at``, readers leave it out, writers prune it, and
the hash itself expires TTL_S after the last write, so nothing outlives the workers. An entry that is not JSON, or
lacks the object field its key requires (``down``, ``servers``), counts as stale.

- ``bq:server_health``: a worker whose servers stop answering (worker/health.py decides what "down" is) writes
  ``{..., "down": {url: reason}, "since"}`` (``since``: Redis time when the first of them went down), every
  DOWN_REFRESH_S while any is down, and deletes it when all answer again.
- ``bq:server_load``: every worker writes ``{..., "concurrency", "window", "servers": {url: {...}}}`` every
  LOAD_REFRESH_S (worker/loadreport.py): which servers it uses, how much of its window is in flight there, how fast
  they answer, what neither the health entry nor ``bq:server_info`` (what each server said of itself, above)
  says. ``concurrency``: BUDGETQ_CONCURRENCY, null for the automatic window; ``window``: the requests it keeps in
  flight in all. Each server's object holds SERVER_FIELDS. Ages are the worker's own (monotonic) seconds
  as of ``at``.

Last, the model's vocabulary (``vocab_size``, which the servers say of themselves too): token ids the served model
cannot take are refused before any request carries them. SGLang does not validate ``input_ids`` against the model: an id past its embedding (``vocab_size`` padded to a
multiple of 64 rows) raises ``IndexError: index out of range in self``, and the scheduler's death takes the whole
server down (SIGQUIT, kill_process_tree; the port refuses connections afterwards; recorded from sglang 0.5.23 on
CPU: tests/fixtures/sglang_real/out_of_vocab.json). Ids in the padding are served, meaninglessly. So one tokenizer
that does not match the served model would take every server of a run down, one after the other, as the chunks
are retried. Every id at or above ``vocab_size`` is refused:

- ``produce`` (producer/launch.py) checks every rendered prompt id against the model's vocabulary before Redis is
  touched (the tokenizer directory's config.json ``vocab_size``, `config_vocab`), and again at attach against
  what the servers say of themselves (``vocab_size`` in the /server_info the workers recorded, `servers_vocab`;
  SGLang 0.5.23 reports none, the simulator does with --vocab-size): exit 2 naming the dataset, the sample, the
  id and the sizes;
- workers check each later turn's prompt they render (worker/turns.py) against the ``vocab_size`` the producer put
  in the chunk's conversation block: the sample fails with that reason and nothing is sent.

Negative ids are refused the same way (the embedding cannot take them either).
"""
from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final, Iterable, Mapping, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

import redis

from budget import keys
from budget.runtime import redis_now

#: What is kept of /get_server_info: what identifies the model and the engine, never the whole dict.
#: ``context_length`` (a server argument: null unless set) and the scheduler's ``max_total_num_tokens`` (KV cache
#: size) and ``max_req_input_len`` are the limits SGLang enforces per request (producer/launch.py server_context).
SERVER_INFO_KEYS: Final = (
    "version", "model_path", "served_model_name", "tokenizer_path", "revision", "dtype", "quantization",
    "kv_cache_dtype", "context_length", "max_total_num_tokens", "max_req_input_len", "tp_size", "dp_size",
    "pp_size", "ep_size", "random_seed", "speculative_algorithm", "reasoning_parser", "tool_call_parser",
    # SGLang honours sampling_seed only with --enable-deterministic-inference (sampling_batch_info.py)
    "enable_deterministic_inference",
    # the model's vocabulary, when a server says (budget/serverinfo.py: an id past it kills SGLang; 0.5.23 says nothing)
    "vocab_size",
)
#: Each entry's own fields besides SERVER_INFO_KEYS: ``via`` (the router it was found behind) and ``router``
#: (true: this URL is a router whose servers could not be asked) only when they apply.
ENTRY_KEYS: Final = ("url", "host", "fetched", "via", "router")
#: What SGLang's router (sglang-router 0.3.x) times a request out after unless started with
#: --request-timeout-secs; it does not report its setting anywhere.
ROUTER_DEFAULT_TIMEOUT_S: Final = 1800.0
REFRESH_S: Final = 3600.0
MAX_AGE_S: Final = 2 * 3600 + 600
FETCH_TIMEOUT_S: Final = 10.0
_MAX_BODY: Final = 4 << 20  # /get_server_info is a few KB; never read an unbounded body


class ServerInfoError(Exception):
    """The server could not be asked, or did not answer with a JSON object. The message holds no secret."""


def seed_honoured(entries: Sequence[Mapping[str, Any]]) -> bool | None:
    """Whether these servers honour ``sampling_seed``: True when every one runs with
    ``--enable-deterministic-inference``, False when one says it does not, None when none says (no entries, or
    servers too old to report it)."""
    said = [e.get("enable_deterministic_inference") for e in entries]
    if any(v is False for v in said):
        return False
    if said and all(v is True for v in said):
        return True
    return None


def pick(info: Mapping[str, Any]) -> dict[str, Any]:
    """The SERVER_INFO_KEYS of `info` whose values are plain scalars (null values left out)."""
    return {k: info[k] for k in SERVER_INFO_KEYS
            if k in info and isinstance(info[k], (str, int, float, bool))}


def public_url(url: str) -> str:
    """``url`` without user, password, query and fragment, and without a trailing slash."""
    parts = urlsplit(url.strip())
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host + (f":{port}" if port else "")
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def fetch(url: str, *, api_key: str | None = None, timeout: float = FETCH_TIMEOUT_S) -> dict[str, Any]:
    """GET ``url``/get_server_info and return its SERVER_INFO_KEYS (`pick`). Sends ``Authorization: Bearer
    api_key`` when given (SGLang's ``--api-key``), else basic auth from the URL's user and password if it has
    them. Proxies from the environment are not used (the workers' requests do not use them either).
    Raises ServerInfoError, also when ``url`` is SGLang's router (use `discover` for URLs that may be one)."""
    body = _get_json(url, "/get_server_info", api_key=api_key, timeout=timeout)
    if is_router(body):
        raise ServerInfoError(f"{public_url(url)}/get_server_info: an SGLang router's statistics, not a server's")
    return pick(body)


def is_router(body: Mapping[str, Any]) -> bool:
    """Whether a /get_server_info answer is SGLang's router's (its own counts, no version or model)."""
    return "version" not in body and "model_path" not in body and (
        "router_manager" in body or "workers_count" in body)


@dataclass(frozen=True)
class Found:
    """One server found at (or behind) a configured URL, with what it said of itself."""

    url: str  # public URL of the server (or of the router, when ``router``)
    info: dict[str, Any]  # its SERVER_INFO_KEYS; empty when ``router``
    via: str | None = None  # the router it was found behind
    router: bool = False  # a router whose servers could not be asked: version and model unknown

    def entry(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.via:
            extra["via"] = self.via
        if self.router:
            extra["router"] = True
        return {"url": self.url, **extra, **self.info}


def discover(url: str, *, api_key: str | None = None, timeout: float = FETCH_TIMEOUT_S) -> list[Found]:
    """The server at ``url``; or, when ``url`` is SGLang's router, each server it lists (``GET /workers``) that
    answers its own /get_server_info; or, when none does, the router itself marked ``router`` (nothing about
    version or model). Raises ServerInfoError when ``url`` itself cannot be asked."""
    body = _get_json(url, "/get_server_info", api_key=api_key, timeout=timeout)
    if not is_router(body):
        return [Found(public_url(url), pick(body))]
    via = public_url(url)
    try:
        listed = _get_json(url, "/workers", api_key=api_key, timeout=timeout)
    except ServerInfoError:
        listed = {}
    workers = listed.get("workers")
    urls = [w["url"] for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)] \
        if isinstance(workers, list) else []
    found = []
    for server in urls:
        try:
            found.append(Found(public_url(server), fetch(server, api_key=api_key, timeout=timeout), via=via))
        except ServerInfoError:
            continue  # not reachable from here (the router's view of the network), or down: not a fact
    return found or [Found(via, {}, router=True)]


def _get_json(url: str, path: str, *, api_key: str | None, timeout: float) -> dict[str, Any]:
    parts = urlsplit(url.strip())
    base = public_url(url)
    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    elif parts.username or parts.password:
        pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    where = f"{base}{path}"
    try:
        request = urllib.request.Request(where, headers=headers)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=timeout) as resp:
            raw = resp.read(_MAX_BODY)
    except urllib.error.HTTPError as exc:
        raise ServerInfoError(f"{where}: HTTP {exc.code}" + (" (wrong or missing SGLANG_API_KEY?)"
                                                              if exc.code in (401, 403) else "")) from None
    except (OSError, ValueError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ServerInfoError(f"{where}: {type(exc).__name__}: {reason}") from None
    try:
        body = json.loads(raw)
    except ValueError:
        raise ServerInfoError(f"{where}: the answer is not JSON") from None
    if not isinstance(body, dict):
        raise ServerInfoError(f"{where}: the answer is not a JSON object")
    return body


def field(url: str, host: str) -> str:
    return f"{host} {public_url(url)}"


def utc_iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _age(entry: Mapping[str, Any], now: float) -> float | None:
    try:
        fetched = datetime.fromisoformat(str(entry["fetched"]).replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return now - fetched.timestamp()


def _fresh(entry: Mapping[str, Any] | None, now: float, max_age: float) -> bool:
    if entry is None:
        return False
    age = _age(entry, now)
    return age is not None and age <= max_age


def clean(entry: Mapping[str, Any]) -> dict[str, Any]:
    """An entry as it may be stored or written to a manifest: ``url`` (credentials stripped), ``host``,
    ``fetched`` when present, and the SERVER_INFO_KEYS. Anything else is dropped."""
    out: dict[str, Any] = {}
    if isinstance(entry.get("url"), str):
        out["url"] = public_url(entry["url"])
    for k in ("host", "fetched"):
        if isinstance(entry.get(k), str):
            out[k] = entry[k]
    if isinstance(entry.get("via"), str):
        out["via"] = public_url(entry["via"])
    if entry.get("router") is True:
        out["router"] = True
        return out  # a router's own answer is never a server's
    out.update(pick(entry))
    return out


def store(r: "redis.Redis", url: str, host: str, info: Mapping[str, Any], *, via: str | None = None,
          router: bool = False) -> dict[str, Any]:
    """Record what server ``url``, as used by a worker on ``host`` (through router ``via``), said; or, with
    ``router``, that ``url`` is a router whose servers could not be asked. Prunes entries too old to trust.
    Returns the stored entry."""
    now = redis_now(r)
    entry = clean({**Found(url, pick(info), via=via, router=router).entry(), "host": host, "fetched": utc_iso(now)})
    pipe = r.pipeline(transaction=True)
    pipe.hset(keys.SERVER_INFO, field(url, host), json.dumps(entry, sort_keys=True))
    pipe.expire(keys.SERVER_INFO, MAX_AGE_S)
    pipe.execute()
    stale = [f for f, e in _entries(r).items() if not _fresh(e, now, MAX_AGE_S)]
    if stale:
        r.hdel(keys.SERVER_INFO, *stale)
    return entry


def _entries(r: "redis.Redis") -> dict[bytes, dict[str, Any] | None]:
    out: dict[bytes, dict[str, Any] | None] = {}
    raw: Any = r.hgetall(keys.SERVER_INFO)
    for f, v in raw.items():
        try:
            entry = json.loads(v)
        except ValueError:
            entry = None
        out[f] = entry if isinstance(entry, dict) else None
    return out


def load(r: "redis.Redis", max_age: float = MAX_AGE_S) -> list[dict[str, Any]]:
    """The entries fetched within ``max_age`` seconds (Redis' clock), cleaned, sorted by url and host."""
    now = redis_now(r)
    out = []
    for entry in _entries(r).values():
        if entry is not None and _fresh(entry, now, max_age):
            out.append(clean(entry))
    return sorted(out, key=lambda e: (e.get("url", ""), e.get("host", "")))


def unknown(entries: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the manifest cannot name the version and model: some configured URL is a router whose servers could
    not be asked. None when every entry is a server's."""
    routers = sorted({str(e.get("url")) for e in entries if e.get("router") is True})
    if not routers:
        return None
    return (f"SGLang version and model unknown: {', '.join(routers)} "
            f"{'is an SGLang router' if len(routers) == 1 else 'are SGLang routers'} whose servers could not be "
            "asked (GET /workers listed none that answered /get_server_info)")


def common(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The SERVER_INFO_KEYS every entry reports, with the same value: the manifest's ``server``."""
    if not entries:
        return {}
    first = entries[0]
    return {k: first[k] for k in SERVER_INFO_KEYS
            if k in first and all(k in e and e[k] == first[k] for e in entries[1:])}


#: An entry older than this is its worker's last word before it died: not shown, pruned.
TTL_S: Final = 30.0
#: Seconds between a down worker's rewrites of its ``bq:server_health`` entry.
DOWN_REFRESH_S: Final = 10.0
#: Seconds between a worker's rewrites of its ``bq:server_load`` entry.
LOAD_REFRESH_S: Final = 5.0
#: A worker prunes dead workers' load entries once in this many writes (once a minute): readers skip them meanwhile.
PRUNE_EVERY: Final = 12
#: A server that timed out, or answered 5xx or 429, within this long is "slow" (unless down).
SLOW_S: Final = 60.0
#: Each server's fields in a load entry. ``window``, ``capacity`` (the server's max_running_requests, all DP
#: ranks) and ``peers`` (live workers sharing it) are the automatic window's (worker/window.py), null with a fixed
#: BUDGETQ_CONCURRENCY (then ``window`` is that number when the worker has one server); ``tokens`` counts the
#: completion tokens it answered this worker since the worker started, ``tok_s`` over the last LOAD_REFRESH_S;
#: ``error_age_s`` / ``unavailable_age_s``: seconds since its last failed request / its last timeout, 5xx, 429 or
#: lost connection (null: none yet).
SERVER_FIELDS: Final = ("in_flight", "window", "capacity", "peers", "tokens", "tok_s", "last_error", "error_age_s",
                        "unavailable_age_s")
_LOOPBACK: Final = ("localhost", "127.0.0.1", "::1", "0.0.0.0")


def _write(r: "redis.Redis", key: str, worker: str, entry: dict[str, Any]) -> None:
    """Set ``worker``'s entry and push the hash's expiry TTL_S ahead, in one transaction."""
    pipe = r.pipeline(transaction=True)
    pipe.hset(key, worker, json.dumps(entry, sort_keys=True))
    pipe.expire(key, int(TTL_S))
    pipe.execute()


def _report_entries(r: "redis.Redis", key: str, shape: str) -> dict[bytes, dict[str, Any] | None]:
    out: dict[bytes, dict[str, Any] | None] = {}
    raw: Any = r.hgetall(key)
    for f, v in raw.items():
        try:
            entry = json.loads(v)
        except ValueError:
            entry = None
        out[f] = entry if isinstance(entry, dict) and isinstance(entry.get(shape), dict) else None
    return out


def _stale(entry: dict[str, Any] | None, now: float) -> bool:
    return entry is None or now - float(entry.get("at", 0)) > TTL_S


def _fresh_reports(r: "redis.Redis", key: str, shape: str, now: float) -> list[dict[str, Any]]:
    """The entries written within TTL_S of ``now``."""
    return [e for e in _report_entries(r, key, shape).values() if e is not None and not _stale(e, now)]


def _prune(r: "redis.Redis", key: str, shape: str, now: float) -> None:
    """Delete the stale entries (it reads the whole hash)."""
    stale = [f for f, e in _report_entries(r, key, shape).items() if _stale(e, now)]
    if stale:
        r.hdel(key, *stale)


def store_down(r: "redis.Redis", worker: str, host: str, pid: int, down: Mapping[str, str],
               since: float | None = None) -> float:
    """Record that ``worker`` (on ``host``) finds the servers ``down`` (url -> why) down; returns ``since`` (the
    Redis time they went down, kept across rewrites by passing it back). An empty ``down`` deletes the entry."""
    if not down:
        clear_down(r, worker)
        return 0.0
    now = redis_now(r)
    since = since or now
    entry = {"worker": worker, "host": host, "pid": pid, "since": since, "at": now,
             "down": {public_url(url): str(why)[:300] for url, why in sorted(down.items())}}
    _write(r, keys.SERVER_HEALTH, worker, entry)
    _prune(r, keys.SERVER_HEALTH, "down", now)
    return since


def clear_down(r: "redis.Redis", worker: str) -> None:
    r.hdel(keys.SERVER_HEALTH, worker)


def read_down(r: "redis.Redis") -> list[dict[str, Any]]:
    """The fresh health entries, oldest outage first; each gains ``for_s``, seconds since its servers went down."""
    now = redis_now(r)
    out = [{**e, "for_s": max(0.0, now - float(e.get("since", now)))}
           for e in _fresh_reports(r, keys.SERVER_HEALTH, "down", now)]
    return sorted(out, key=lambda e: (-e["for_s"], str(e.get("worker"))))


def describe_down(entries: list[dict[str, Any]]) -> list[str]:
    """One line per worker whose servers are down: who, where, which servers and why, for how long."""
    lines = []
    for e in entries:
        servers = "; ".join(f"{url} ({why})" for url, why in sorted(e["down"].items()))
        lines.append(f"SGLang down for worker {e.get('worker')} on host {e.get('host')} (pid {e.get('pid')}), "
                     f"{e['for_s']:.0f} s: {servers}; it gives its chunks back and takes none until a server "
                     f"answers /health")
    return lines


def server_name(url: str, host: str) -> str:
    """What names a server among workers: its public URL, prefixed with the worker's host when it is a loopback one
    (``http://127.0.0.1:30000`` on two GPU hosts is two servers)."""
    public = public_url(url)
    return f"{host} {public}" if (urlsplit(public).hostname or "") in _LOOPBACK else public


def store_load(r: "redis.Redis", worker: str, host: str, pid: int, servers: Mapping[str, Mapping[str, Any]], *,
               concurrency: int | None, window: int, prune: bool = True) -> None:
    """Record what ``worker`` (on ``host``) does with each of ``servers`` (url -> SERVER_FIELDS); with ``prune``,
    delete dead workers' entries (it reads the whole hash: a worker prunes once in PRUNE_EVERY writes)."""
    now = redis_now(r)
    kept: dict[str, dict[str, Any]] = {}
    for url, fields in sorted(servers.items()):
        kept[public_url(url)] = {k: fields.get(k) for k in SERVER_FIELDS}
        if isinstance(fields.get("last_error"), str):
            kept[public_url(url)]["last_error"] = str(fields["last_error"])[:300]
    entry = {"worker": worker, "host": host, "pid": pid, "at": now, "concurrency": concurrency, "window": window,
             "servers": kept}
    _write(r, keys.SERVER_LOAD, worker, entry)
    if prune:
        _prune(r, keys.SERVER_LOAD, "servers", now)


def clear_load(r: "redis.Redis", worker: str) -> None:
    r.hdel(keys.SERVER_LOAD, worker)


def read_load(r: "redis.Redis") -> list[dict[str, Any]]:
    """The fresh load entries, by worker name; each gains ``age_s``, seconds since it was written (Redis' clock)."""
    now = redis_now(r)
    out = [{**e, "age_s": max(0.0, now - float(e.get("at", now)))}
           for e in _fresh_reports(r, keys.SERVER_LOAD, "servers", now)]
    return sorted(out, key=lambda e: str(e.get("worker")))


@dataclass(frozen=True)
class Vocab:
    """The model's vocabulary size and who said it (for messages)."""

    size: int
    source: str


def _sane(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def info_vocab(info: Mapping[str, Any]) -> int | None:
    """``vocab_size`` of a config.json or a server's self-description (top level, or a multimodal model's
    ``text_config``)."""
    size = _sane(info.get("vocab_size"))
    if size is None and isinstance(info.get("text_config"), Mapping):
        size = _sane(info["text_config"].get("vocab_size"))
    return size


def config_vocab(tokenizer_dir: str | Path) -> Vocab | None:
    """The model's ``vocab_size`` from ``config.json`` in the tokenizer directory; None when there is none (a hub
    id, a tokenizer-only folder) or it states none."""
    path = Path(tokenizer_dir) / "config.json"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    size = info_vocab(info) if isinstance(info, Mapping) else None
    return Vocab(size, f"{path}: vocab_size") if size is not None else None


def servers_vocab(servers: Sequence[Mapping[str, Any]]) -> Vocab | None:
    """The smallest ``vocab_size`` any recorded server states (a chunk may run on any of them)."""
    best: Vocab | None = None
    for entry in servers:
        size = info_vocab(entry)
        if size is not None and (best is None or size < best.size):
            where = str(entry.get("url", "?")) + (f" on {entry['host']}" if entry.get("host") else "")
            best = Vocab(size, f"SGLang server {where}: vocab_size")
    return best


def smallest(*vocabs: Vocab | None) -> Vocab | None:
    known = [v for v in vocabs if v is not None]
    return min(known, key=lambda v: v.size) if known else None


def first_outside(ids: Sequence[int], size: int) -> tuple[int, int] | None:
    """(position, id) of the first id the model cannot take (< 0 or >= ``size``), or None. ``min``/``max`` run in
    C over an ``array``: a run's hundreds of millions of prompt ids take seconds, not minutes."""
    if not ids or (min(ids) >= 0 and max(ids) < size):
        return None
    for pos, token in enumerate(ids):
        if token < 0 or token >= size:
            return pos, token
    return None  # pragma: no cover (min/max said otherwise)


def refusal(dataset: str, sample: str, pos: int, token: int, vocab: Vocab) -> str:
    return (f"dataset {dataset}: sample {sample}: prompt token {pos} is id {token}, outside the model's vocabulary "
            f"of {vocab.size:,} ids (0..{vocab.size - 1:,}; {vocab.source}): SGLang's embedding would fail on it "
            "and take the whole server down. The tokenizer does not match the served model: give the model's own "
            "--tokenizer")


def check_prompts(datasets: Iterable[tuple[str, Iterable[Mapping[str, Sequence[int]]]]],
                  vocab: Vocab | None) -> str | None:
    """The refusal for the first prompt holding an id outside ``vocab`` (datasets: name -> its {sample: ids}
    maps, e.g. a Prepared's ``input_ids`` and each template variant's), or None when all fit or none is known."""
    if vocab is None:
        return None
    for name, maps in datasets:
        for ids_by_sample in maps:
            for sample, ids in ids_by_sample.items():
                bad = first_outside(ids, vocab.size)
                if bad is not None:
                    return refusal(name, sample, bad[0], bad[1], vocab)
    return None


def turn_refusal(ids: Sequence[int], conversation: Mapping[str, Any], turn: int) -> str | None:
    """A worker's check of a later turn's prompt it rendered (worker/turns.py): the failed reason, or None."""
    size = _sane(conversation.get("vocab_size"))
    bad = first_outside(ids, size) if size is not None else None
    if bad is None or size is None:
        return None
    return (f"turn {turn}: prompt token {bad[0]} is id {bad[1]}, outside the model's vocabulary of {size:,} ids "
            "(the tokenizer does not match the served model); not sent: SGLang would fail on it and shut down")
