"""Record the contract as the real SGLang engine speaks it (bench/sglang_cpu_smoke.py --record-fixtures DIR).

One JSON file per exchange in DIR (the repository's: tests/fixtures/sglang_real/), each
``{"name", "request": {"method", "path", "headers", "body"}, "status", "content_type", "body"}`` (``body`` parsed
when it is JSON, else text; a stream adds ``events``, the parsed ``data:`` lines), plus ``server.json`` (what
served them: version, model, context, vocabulary). tests/unit/test_sim_contract_real.py replays each request to the
simulator and holds its answer to the recorded one, field by field.
"""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from bench.sglang_cpu_env import log
from bench.sglang_cpu_smoke import http_call

JSON = {"Content-Type": "application/json"}


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class Recorder:
    def __init__(self, url: str, out: Path) -> None:
        self.url = url
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.names: list[str] = []

    def save(self, name: str, doc: dict[str, Any]) -> dict[str, Any]:
        doc = {"name": name, **doc}
        (self.out / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        self.names.append(name)
        return doc

    def call(self, name: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
             raw: bytes | None = None, note: str | None = None) -> dict[str, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = JSON if headers is None and data is not None else (headers or {})
        status, rh, answer = http_call(self.url + path, method, data, hdrs, timeout=120)
        doc: dict[str, Any] = {"request": {"method": method, "path": path, "headers": hdrs,
                                           "body": body if raw is None else raw.decode()},
                               "status": status, "content_type": rh.get("content-type"), "body": _parse(answer)}
        if note:
            doc["note"] = note
        return self.save(name, doc)

    def stream(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        status, rh, answer = http_call(self.url + "/generate", "POST", json.dumps(body).encode(), JSON, timeout=120)
        events = [line[len("data: "):] for line in answer.decode().split("\n") if line.startswith("data: ")]
        return self.save(name, {"request": {"method": "POST", "path": "/generate", "headers": JSON, "body": body},
                                "status": status, "content_type": rh.get("content-type"),
                                "events": [e if e == "[DONE]" else json.loads(e) for e in events]})


def _raw_request(url: str, body: dict[str, Any]) -> socket.socket:
    u = urllib.parse.urlsplit(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=60)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def record_all(url: str, out: Path, starting: dict[str, Any], model: Path, context: int) -> None:
    rec = Recorder(url, out)
    cfg = json.loads((model / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    prompt = [(37 * i) % (vocab - 10) + 5 for i in range(12)]
    greedy = {"max_new_tokens": 8, "temperature": 0}

    for path, answers in starting.items():
        rec.save(f"starting{path.replace('/', '_')}", {
            "request": {"method": "GET", "path": path}, "answers": answers,
            "note": "every distinct answer while the server started, in order (status None: no connection)"})
    length = rec.call("generate_length", "POST", "/generate", {"input_ids": prompt, "sampling_params": greedy})
    out_ids = length["body"]["output_ids"]
    stop_id = out_ids[2]
    rec.call("generate_stop", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {**greedy, "stop_token_ids": [stop_id]}},
             note="a stop on a token: stop_token_ids, since a random model rarely draws its EOS")
    rec.call("generate_repeat", "POST", "/generate", {"input_ids": prompt, "sampling_params": greedy},
             note="the same greedy request again: same output, prompt cached but its last token")
    rec.call("generate_text", "POST", "/generate", {"text": "Hello there.", "sampling_params": greedy})
    rec.call("generate_ignore_eos", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    # abort: a long request, then /abort_request for its rid
    holder: dict[str, Any] = {}
    body = {"input_ids": prompt, "rid": "fixture-abort-0001",
            "sampling_params": {"max_new_tokens": context - len(prompt) - 10, "ignore_eos": True}}

    def long_request() -> None:
        holder["answer"] = http_call(url + "/generate", "POST", json.dumps(body).encode(), JSON, timeout=300)
    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)  # the request must be running when the abort comes: nothing to await from outside
    rec.call("abort_request", "POST", "/abort_request", {"rid": "fixture-abort-0001"})
    t.join(300)
    status, rh, answer = holder["answer"]
    rec.save("generate_abort", {"request": {"method": "POST", "path": "/generate", "headers": JSON, "body": body},
                                "status": status, "content_type": rh.get("content-type"), "body": _parse(answer)})
    # errors
    rec.call("over_context", "POST", "/generate",
             {"input_ids": [(i % (vocab - 10)) + 5 for i in range(context + 952)], "sampling_params": greedy})
    rec.call("no_room", "POST", "/generate",
             {"input_ids": [(i % (vocab - 10)) + 5 for i in range(context - 8)],
              "sampling_params": {"max_new_tokens": 100}})
    rec.call("empty_prompt", "POST", "/generate", {"input_ids": [], "sampling_params": greedy})
    rec.call("no_prompt", "POST", "/generate", {"sampling_params": greedy})
    rec.call("bad_temperature", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": -1}})
    rec.call("bad_top_p", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "top_p": 0.0}})
    rec.call("unknown_sampling_key", "POST", "/generate",
             {"input_ids": prompt, "sampling_params": {"max_tokens": 8}})
    rec.call("wrong_type", "POST", "/generate", {"input_ids": "not ids", "sampling_params": greedy})
    rec.call("no_content_type", "POST", "/generate", headers={},
             raw=json.dumps({"input_ids": prompt, "sampling_params": greedy}).encode())
    rec.call("form_content_type", "POST", "/generate", headers={"Content-Type": "application/x-www-form-urlencoded"},
             raw=json.dumps({"input_ids": prompt, "sampling_params": greedy}).encode(),
             note="what urllib sends when no Content-Type is given")
    rec.call("invalid_json", "POST", "/generate", raw=b'{"input_ids": [1, 2', headers=JSON)
    rec.stream("stream", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                          "stream": True})
    # a client hanging up mid-stream, and one that gives up on a non-streaming request
    sock = _raw_request(url, {"input_ids": prompt, "stream": True,
                              "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}})
    first = sock.recv(4096)
    sock.close()
    sock = _raw_request(url, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}})
    time.sleep(0.5)
    sock.close()
    time.sleep(5.0)  # SGLang checks for a vanished client about every 4 s
    status_h, _, _ = http_call(url + "/health", timeout=60)
    after = rec.call("generate_after_hangups", "POST", "/generate",
                     {"input_ids": prompt, "sampling_params": greedy})
    rec.save("client_hangup", {"request": {"note": "stream hung up after its first bytes; a non-streaming request "
                                                   "hung up after 0.5 s"},
                               "first_bytes": first.decode(errors="replace").split("\r\n")[0],
                               "health_after": status_h, "generate_after": after["status"]})
    for path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info", "/health",
                 "/health_generate", "/v1/models"):
        rec.call(path.strip("/").replace("/", "_"), "GET", path)
    info = json.loads(http_call(url + "/server_info")[2])
    rec.save("server", {"version": info.get("version"), "context_length": context, "vocab_size": vocab,
                        "model": {k: cfg.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers",
                                                           "vocab_size", "max_position_embeddings",
                                                           "eos_token_id")},
                        "server_info_keys": len(info), "device": info.get("device"),
                        "attention_backend": info.get("attention_backend")})
    log(f"recorded {len(rec.names)} fixtures in {out}")


def record_crash(url: str, out: Path, vocab: int, server: Any, server_log: Path) -> None:
    """Last: an id == vocab_size, which kills the server (budget/serverinfo.py exists because of it)."""
    rec = Recorder(url, out)
    # An id at vocab_size itself is served: SGLang pads its embedding (to a multiple of 64 rows), and the padding
    # rows take it, meaninglessly. Past the padding, the embedding fails and the server dies.
    rec.call("id_at_vocab_size", "POST", "/generate", {"input_ids": [5, 6, vocab], "sampling_params": {
        "max_new_tokens": 4}}, note="an id in the embedding's padding: answered, meaninglessly")
    body = {"input_ids": [5, 6, vocab * 64], "sampling_params": {"max_new_tokens": 4}}
    try:
        status, rh, answer = http_call(url + "/generate", "POST", json.dumps(body).encode(), JSON, timeout=120)
        client: dict[str, Any] = {"status": status, "body": _parse(answer)}
    except OSError as exc:
        client = {"status": None, "error": type(exc).__name__}
    try:
        code = server.wait(60)
    except Exception:  # noqa: BLE001 - still running: record that
        code = None
    try:
        http_call(url + "/health", timeout=5)
        port = "answers"
    except OSError as exc:
        port = type(exc).__name__
    lines = [ln for ln in server_log.read_text(errors="replace").splitlines()
             if "IndexError" in ln or "SIGQUIT" in ln or "kill_process_tree" in ln][:6]
    rec.save("out_of_vocab", {"request": {"method": "POST", "path": "/generate", "headers": JSON, "body": body},
                              "client": client, "server_exit": code, "port_after": port, "log": lines})
    log(f"out-of-vocabulary id: client saw {client}, server exit {code}, port after: {port}")
