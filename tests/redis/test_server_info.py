"""SGLang's /get_server_info in the manifests: workers record it in Redis (bq:server_info), the end of a run and
``produce export`` write it to ``manifest.json``, ``produce export --server-url`` asks the servers directly.

All against the bundled simulator (which serves /get_server_info like SGLang, behind ``--api-key`` when given),
the session's redis-server and real ``rq worker`` processes. Secrets checked for: the API key and URL passwords
never reach Redis, a manifest or a log.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis

from budget import keys, serverinfo
from budget.serverinfo import MAX_AGE_S
from demo.stack import free_port
from sglang_sim.launch import SimProcess
from sglang_sim.responses import MODEL_PATH, VERSION
from tests import replies
from tests.demo_data import GLAIVE
from tests.procs import produce, produce_cmd, wait_for
from worker.config import WorkerConfig
from worker.serverinfo import ServerInfoReporter

API_KEY = "sk-server-info-test-key"
# What the simulator's /get_server_info gives of SERVER_INFO_KEYS (the keys 0.5.23 has, tests/unit/test_sim_contract_real.py)
SIM_INFO = {"version": VERSION, "model_path": MODEL_PATH, "served_model_name": MODEL_PATH, "context_length": 32768,
            "max_total_num_tokens": 32768 * 256, "max_req_input_len": 32768 - 6, "tp_size": 1, "dp_size": 1,
            "random_seed": 0, "enable_deterministic_inference": False}
HOST = socket.gethostname()


def entry_keys(entry: dict[str, Any]) -> set[str]:
    return set(entry) - set(serverinfo.ENTRY_KEYS)


# -- the pieces ------------------------------------------------------------------------------------------------

def test_only_the_listed_keys_and_credential_free_urls_are_kept() -> None:
    info = {"version": "0.5.4", "model_path": "Qwen/Qwen3-8B", "tp_size": 2, "api_key": "sk-secret",
            "tokenizer_path": None, "dtype": {"not": "a scalar"}, "admin_api_key": "sk-2", "ssl_keyfile": "/k"}
    assert serverinfo.pick(info) == {"version": "0.5.4", "model_path": "Qwen/Qwen3-8B", "tp_size": 2}
    assert serverinfo.public_url("http://user:pa%40ss@10.0.0.5:30000/?token=t#frag") == "http://10.0.0.5:30000"
    assert serverinfo.public_url("https://[::1]:8443/sglang/") == "https://[::1]:8443/sglang"
    entry = serverinfo.clean({"url": "http://u:p@h:1", "host": "gpu-a", "fetched": "2026-01-01T00:00:00Z",
                              "extra": "dropped", **info})
    assert entry == {"url": "http://h:1", "host": "gpu-a", "fetched": "2026-01-01T00:00:00Z", "version": "0.5.4",
                     "model_path": "Qwen/Qwen3-8B", "tp_size": 2}
    assert serverinfo.common([{"version": "1", "tp_size": 2}, {"version": "1", "tp_size": 4}, {"version": "1"}]) \
        == {"version": "1"}
    assert serverinfo.common([]) == {}


def test_fetch_from_the_simulator_sends_the_api_key(sim_factory: Any) -> None:
    sim = sim_factory("--api-key", API_KEY)
    assert serverinfo.fetch(sim.url, api_key=API_KEY) == SIM_INFO
    with pytest.raises(serverinfo.ServerInfoError, match="HTTP 401") as refused:
        serverinfo.fetch(sim.url)
    assert sim.url in str(refused.value)
    with pytest.raises(serverinfo.ServerInfoError, match="HTTP 401") as wrong:
        serverinfo.fetch(sim.url.replace("http://", "http://user:url-password@"), api_key="wrong-key")
    assert "url-password" not in str(wrong.value) and "wrong-key" not in str(wrong.value)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(serverinfo.ServerInfoError, match="get_server_info"):
        serverinfo.fetch(dead, timeout=2)


def test_store_keeps_a_clean_entry_with_a_ttl_and_old_entries_are_ignored_then_pruned(r: "redis.Redis") -> None:
    old = {"url": "http://10.0.0.9:30000", "host": "gone", "fetched": "2020-01-01T00:00:00Z", "version": "0.1"}
    r.hset(keys.SERVER_INFO, mapping={"gone http://10.0.0.9:30000": json.dumps(old), "junk": "not json"})
    assert serverinfo.load(r) == []
    entry = serverinfo.store(r, "http://user:url-secret@10.0.0.5:30000/?token=t", "gpu-a",
                             {"version": "0.5.4", "api_key": "sk-secret", "tp_size": 2})
    assert entry_keys(entry) == {"version", "tp_size"}
    assert (entry["url"], entry["host"]) == ("http://10.0.0.5:30000", "gpu-a")
    assert r.hkeys(keys.SERVER_INFO) == [b"gpu-a http://10.0.0.5:30000"], "old and unreadable entries pruned"
    assert serverinfo.load(r) == [entry]
    assert 0 < r.ttl(keys.SERVER_INFO) <= MAX_AGE_S
    raw = b"".join(replies.raw(v) for v in r.hgetall(keys.SERVER_INFO).values())
    assert b"secret" not in raw and b"token" not in raw and b"user" not in raw
    # "fetched" is Redis' clock; an entry just past MAX_AGE_S is ignored by readers.
    now = r.time()[0]
    aged = {**entry, "host": "gpu-b", "url": "http://10.0.0.6:30000",
            "fetched": serverinfo.utc_iso(now - MAX_AGE_S - 5)}
    r.hset(keys.SERVER_INFO, "gpu-b http://10.0.0.6:30000", json.dumps(aged))
    assert serverinfo.load(r) == [entry]
    assert serverinfo.load(r, max_age=MAX_AGE_S + 60)[1]["host"] == "gpu-b"


def test_the_reporter_retries_until_the_server_answers_then_refreshes(r: "redis.Redis") -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = WorkerConfig(servers=(url,), api_key=API_KEY)
    reporter = ServerInfoReporter(r, config, host="gpu-t", refresh_s=0.3, first_retry_s=0.2).start()
    sim = SimProcess(["--api-key", API_KEY], port=port)
    try:
        assert not r.exists(keys.SERVER_INFO)  # nothing listens on the port yet: nothing could be stored
        sim.start()
        wait_for(lambda: r.hexists(keys.SERVER_INFO, f"gpu-t {url}"), 30, "the entry, once the server is up")
        assert entry_keys(json.loads(r.hget(keys.SERVER_INFO, f"gpu-t {url}") or b"{}")) == set(SIM_INFO)
        first = reporter.reported
        wait_for(lambda: reporter.reported >= first + 2, 30, "two refreshes")
    finally:
        reporter.stop()
        sim.stop()
    reporter.thread.join(15)
    assert not reporter.thread.is_alive()


class SilentServer:
    """A TCP listener that accepts connections and never answers: a server that hangs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.accepted = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.set()

    def still_waiting(self) -> bool:
        """Some client sent its request and still waits for the answer (has not closed its side)."""
        for conn in self.conns:
            conn.setblocking(False)
            try:
                while data := conn.recv(65536):
                    pass
                if data == b"":
                    continue  # the client gave up
            except BlockingIOError:
                return True
        return False

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def silent() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


@pytest.mark.e2e
def test_a_server_that_never_answers_delays_and_fails_nothing(r: "redis.Redis", workers: Any,
                                                             silent: SilentServer) -> None:
    pool = workers(silent.url, BUDGETQ_CONNECT_TIMEOUT="300")
    proc = pool.start("w0")
    wait_for(lambda: silent.accepted.is_set() and bool(r.sismember("rq:workers", "rq:worker:w0")), 60,
             "the worker registered while its /get_server_info request hangs")
    assert silent.still_waiting(), "the request had already given up: this proves nothing about blocking"
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, pool.log("w0")
    assert not r.exists(keys.SERVER_INFO)
    assert "Traceback" not in pool.log("w0", partial=True)


# -- end to end ------------------------------------------------------------------------------------------------

def export(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("BUDGETQ_") and k != "SGLANG_API_KEY"}
    # --for: glaive_fc's conversations have several turns (spliced tool results), whose rows the trainer decides
    return subprocess.run([*produce_cmd(), "export", *args, "--for", "speculators"], capture_output=True, text=True,
                          timeout=120, env={**base, **(env or {})})


@pytest.mark.e2e
def test_workers_record_their_servers_and_the_manifests_carry_them(redis_url: str, r: "redis.Redis",
                                                                   tokenizer_dir: Path, tmp_path: Path,
                                                                   sim_factory: Any, workers: Any) -> None:
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "100", "--seed", "0", "--api-key", API_KEY)
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="8", SGLANG_API_KEY=API_KEY)
    pool.start("w0")
    field = f"{HOST} {sim.url}"
    wait_for(lambda: r.hexists(keys.SERVER_INFO, field), 30, "the worker's record of its server")
    stored = json.loads(r.hget(keys.SERVER_INFO, field) or b"{}")
    assert {k: stored[k] for k in entry_keys(stored)} == SIM_INFO
    assert (stored["url"], stored["host"]) == (sim.url, HOST) and stored["fetched"].endswith("Z")
    assert 0 < r.ttl(keys.SERVER_INFO) <= MAX_AGE_S

    out = tmp_path / "out"
    res = produce([str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "200", "--max-samples", "16",
                   "--chunk-size", "8", "--budget", "100k", "--out", str(out)], redis_url)
    assert res.returncode == 0, res.stderr
    path = out / "glaive_fc" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["server"] == SIM_INFO
    assert manifest["servers"] == [stored]
    assert manifest["counts"]["samples"] == 16
    extra = dict(manifest["extra"])
    assert extra.pop("request_seconds") > 0  # the requests' time, summed (docs/mix.md)
    assert 0 < extra.pop("server_seconds") <= manifest["extra"]["request_seconds"]  # their share of the server's
    assert extra == {"budget": 100_000, "budget_mode": "predict", "status": "open",
                     "used": manifest["tokens"]["completion"]}
    assert f"glaive_fc: manifest {path} (SGLang: version {VERSION}, model_path {MODEL_PATH}; 1 server)" \
        in res.stderr
    pool.stop_all()
    for text in (path.read_text(), pool.log("w0", partial=True), res.stdout + res.stderr,
                 json.dumps({replies.text(k): replies.text(v) for k, v in r.hgetall(keys.SERVER_INFO).items()})):
        assert API_KEY not in text and "api_key" not in text

    # Redis now also knows another server (another model serves now): an export keeps what the run recorded.
    serverinfo.store(r, "http://10.0.0.7:30000", "gpu-b", {"version": "9.9.9", "model_path": MODEL_PATH})
    res = export(["glaive_fc", "--out", str(out), "--redis-url", redis_url])
    assert res.returncode == 0, res.stderr
    assert json.loads(path.read_text())["servers"] == [stored]
    # A manifest without servers (a run whose workers recorded nothing) gets what Redis holds.
    path.unlink()
    res = export(["glaive_fc", "--out", str(out), "--redis-url", redis_url])
    assert res.returncode == 0, res.stderr
    manifest = json.loads(path.read_text())
    assert [e["url"] for e in manifest["servers"]] == ["http://10.0.0.7:30000", sim.url]
    assert manifest["server"] == {"model_path": MODEL_PATH}, "only what both report alike"
    assert manifest["extra"]["budget"] == 100_000

    # --server-url asks the server itself, with SGLANG_API_KEY, and replaces what the manifest had.
    res = export(["glaive_fc", "--out", str(out), "--server-url", sim.url])
    assert res.returncode == 1 and "HTTP 401" in res.stderr, res.stderr
    assert json.loads(path.read_text())["servers"] == manifest["servers"], "a failed export changes nothing"
    res = export(["glaive_fc", "--out", str(out)], env={"BUDGETQ_SERVER_URL": sim.url, "SGLANG_API_KEY": API_KEY})
    assert res.returncode == 0, res.stderr
    fetched = json.loads(path.read_text())
    assert fetched["server"] == SIM_INFO
    assert [(e["url"], "host" in e) for e in fetched["servers"]] == [(sim.url, False)]
    assert fetched["extra"] == manifest["extra"], "kept: this export had no --redis-url"
    assert API_KEY not in path.read_text() + res.stderr + res.stdout
