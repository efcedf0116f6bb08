"""Ids the served model cannot take are refused before any request carries them (budget/serverinfo.py).

The real engine dies on an input id >= its vocabulary size (IndexError in the embedding, then the whole server
shuts down: /work/shared/reference/sglang-cpu.md), and so does the simulator with --oov-crash. End to end:
real redis-server, real `rq worker`s, `produce` as a user runs it."""
from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys, serverinfo
from budget.serverinfo import Vocab, check_prompts, config_vocab, first_outside, servers_vocab, turn_refusal
from tests.procs import produce, read_jsonl, sim_stats, wait_for

DATA = Path(__file__).resolve().parents[2] / "demo" / "data"


def test_first_outside_finds_the_first_id_at_or_past_the_vocabulary_and_negatives() -> None:
    assert first_outside([0, 5, 9], 10) is None
    assert first_outside([], 10) is None
    assert first_outside([1, 10, 11], 10) == (1, 10)
    assert first_outside([3, -1], 10) == (1, -1)


def test_vocab_sources(tmp_path: Path) -> None:
    assert config_vocab(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert config_vocab(tmp_path) == Vocab(151936, f"{tmp_path / 'config.json'}: vocab_size")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 262144}}))
    nested = config_vocab(tmp_path)
    assert nested is not None and nested.size == 262144
    (tmp_path / "config.json").write_text("{not json")
    assert config_vocab(tmp_path) is None
    servers: list[dict[str, Any]] = [{"url": "http://a:1", "vocab_size": 500}, {"url": "http://b:1", "vocab_size": 300},
                                     {"url": "http://c:1", "vocab_size": None}, {"url": "http://d:1"}]
    assert servers_vocab(servers) == Vocab(300, "SGLang server http://b:1: vocab_size")
    assert servers_vocab([{"url": "x"}]) is None
    assert check_prompts([("ds", [{"s1": [1, 2], "s2": [1, 300]}])], Vocab(300, "here")) == (
        "dataset ds: sample s2: prompt token 1 is id 300, outside the model's vocabulary of 300 ids (0..299; here): "
        "SGLang's embedding would fail on it and take the whole server down. The tokenizer does not match the "
        "served model: give the model's own --tokenizer")
    assert check_prompts([("ds", [{"s1": [1, 2]}])], None) is None
    assert turn_refusal([1, 2, 7], {"vocab_size": 7}, 2) is not None
    assert turn_refusal([1, 2, 7], {}, 2) is None


def _post(url: str, body: dict[str, Any], timeout: float = 10) -> tuple[int, Any]:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read())


def test_the_simulator_dies_like_sglang_on_an_id_past_its_vocabulary(sim_factory: Any) -> None:
    sim = sim_factory("--vocab-size", "100", "--oov-crash", "--zero-latency")
    info = json.loads(urllib.request.urlopen(sim.url + "/server_info", timeout=5).read())
    assert info["vocab_size"] == 100
    status, body = _post(sim.url, {"input_ids": [1, 99], "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and body["meta_info"]["prompt_tokens"] == 2
    # as the engine: an id in the embedding's padding (100 rows padded to 128) is served, meaninglessly
    status, body = _post(sim.url, {"input_ids": [1, 127], "sampling_params": {"max_new_tokens": 4}})
    assert status == 200
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # past it: dropped without an answer
        _post(sim.url, {"input_ids": [1, 128], "sampling_params": {"max_new_tokens": 4}})
    assert sim.proc is not None and sim.proc.wait(10) == 1  # the whole server is gone
    assert "IndexError: index out of range in self" in sim._read_stderr()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(sim.url + "/health", timeout=2)


SYSTEM = ('You can call this function -\n{\n  "name": "get_weather",\n  "description": "the weather of a city",\n'
          '  "parameters": {"city": "string"}\n}')


def _tool_conversations(path: Path, n: int) -> Path:
    """Conversations with a tool call: their turn 1 keeps turn 0's reasoning (the template keeps it after the last
    user query), so it holds ``</think>``, an id no turn 0 prompt holds (they end with an open ``<think>``)."""
    with path.open("w") as f:
        for i in range(n):
            city = ["Paris", "Tokyo", "Lima", "Oslo"][i % 4]
            f.write(json.dumps({"id": f"tc-{i}", "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
                {"role": "tool", "content": json.dumps({"temp": 20 + i})},
                {"role": "assistant", "content": f"It is {20 + i} degrees in {city}."}]}) + "\n")
    return path


def _max_turn0_id(tokenizer_dir: Path, path: Path) -> int:
    from render.chat import Renderer, load_tokenizer
    renderer = Renderer(load_tokenizer(str(tokenizer_dir)))
    return max(max(renderer.render(json.loads(line)["messages"][:2]).input_ids)
               for line in path.read_text().splitlines())


def _tokenizer_with_config(tokenizer_dir: Path, tmp_path: Path, vocab_size: int) -> Path:
    tok = tmp_path / "model"
    shutil.copytree(tokenizer_dir, tok)
    (tok / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": vocab_size}))
    return tok


def test_produce_refuses_prompts_past_config_json_vocab_size_before_any_request(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    tok = _tokenizer_with_config(tokenizer_dir, tmp_path, 300)  # the demo tokenizer has 2,000 ids
    sim = sim_factory("--vocab-size", "300", "--oov-crash", "--zero-latency")
    workers(sim.url).start("w1")
    done = produce([str(DATA / "code_instruct.jsonl"), "--tokenizer", str(tok), "--max-tokens", "32",
                    "--out", str(tmp_path / "out")], redis_url)
    assert done.returncode == 2, done.stderr
    assert "dataset code_instruct: sample " in done.stderr
    assert "outside the model's vocabulary of 300 ids (0..299; " in done.stderr
    assert f"{tok / 'config.json'}: vocab_size" in done.stderr
    assert sim_stats(sim.url)["requests_total"] == 0 and sim.proc.poll() is None  # alive, never asked
    assert not r.keys("*code_instruct*"), "refused before Redis was touched"
    # --dry-run is refused the same way (the check runs right after rendering)
    dry = produce([str(DATA / "code_instruct.jsonl"), "--tokenizer", str(tok), "--max-tokens", "32", "--dry-run",
                   "--out", str(tmp_path / "out")], redis_url)
    assert dry.returncode == 2 and "outside the model's vocabulary" in dry.stderr


def test_produce_refuses_at_attach_what_the_servers_say_of_their_vocabulary(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    sim = sim_factory("--vocab-size", "300", "--oov-crash", "--zero-latency")  # no config.json: only it says
    workers(sim.url).start("w1")
    wait_for(lambda: any(e.get("vocab_size") == 300 for e in serverinfo.load(r)), 30, "the worker's server info")
    done = produce([str(DATA / "code_instruct.jsonl"), "--tokenizer", str(tokenizer_dir), "--max-tokens", "32",
                    "--out", str(tmp_path / "out")], redis_url)
    assert done.returncode == 2, done.stderr
    assert f"of 300 ids (0..299; SGLang server {sim.url}" in done.stderr
    assert sim_stats(sim.url)["requests_total"] == 0 and sim.proc.poll() is None


@pytest.mark.e2e
def test_a_worker_fails_a_later_turn_it_renders_past_the_vocabulary_and_never_sends_it(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    convs = _tool_conversations(tmp_path / "tools.jsonl", 8)
    vocab = _max_turn0_id(tokenizer_dir, convs) + 1  # every turn 0 fits; turn 1 holds </think>, past it
    tok = _tokenizer_with_config(tokenizer_dir, tmp_path, vocab)
    log = tmp_path / "requests.jsonl"
    sim = sim_factory("--vocab-size", str(vocab), "--oov-crash", "--zero-latency", "--tokenizer", str(tok),
                      "--reasoning-style", "qwen3-thinking", "--mean-tokens", "40", "--request-log", str(log))
    workers(sim.url).start("w1")
    out = tmp_path / "out"
    done = produce([str(convs), "--tokenizer", str(tok), "--max-tokens", "64", "--out", str(out)], redis_url)
    assert done.returncode == 0, done.stderr
    assert sim.proc.poll() is None, "the server was sent an id past its vocabulary"
    sent = read_jsonl(log)
    assert sent and all(max(x["input_ids"]) < vocab for x in sent)
    recs = read_jsonl(out / "tools" / "raw_responses.jsonl")
    failed = [x for x in recs if "outside the model's vocabulary" in json.dumps(x)]
    assert failed, "no later turn went past the vocabulary: the test proves nothing"
    assert all(len(x["turns"]) == 1 for x in failed), "the refused turn was never answered"
    assert int(r.get(keys.DatasetKeys("tools").used) or 0) == sum(x["completion_tokens"] for x in recs)
