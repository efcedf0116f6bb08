"""Rendering shared by producer and worker (docs/multiturn.md, "Where rendering happens"): the producer stores the
tokenizer files in Redis, a worker loads them in a directory of its own and renders exactly the producer's ids;
files that give another fingerprint are a configuration fault; and a single-turn run's worker never imports
transformers."""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis

from budget import keys, runstate
from demo.tokenizer import build_tokenizer
from producer.errors import UsageError
from producer.session.attach import share_tokenizer
from render import tokfiles
from render.chat import Renderer, load_tokenizer
from tests.families import build_family_tokenizer
from tests.procs import produce_cmd, read_jsonl
from tests.replies import raw
from worker import turns
from worker.turns import TokenizerFault, TokenizerMismatch, renderer_for

ROOT = Path(__file__).resolve().parents[2]
#: A 3-turn conversation, rendered before its third user turn: system, three user turns, two answers, a tool call.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp_c\": 14}"},
    {"role": "assistant", "content": "14 degrees in Paris."},
    {"role": "user", "content": "And in Tokyo?"},
    {"role": "assistant", "content": "I would need to look that up."},
    {"role": "user", "content": "Please do, then compare the two."},
]


@pytest.fixture(autouse=True)
def fresh_cache() -> Iterator[None]:
    turns.forget()
    yield
    turns.forget()


def _store(client: "redis.Redis", directory: Path, kwargs: dict[str, Any] | None = None) -> Renderer:
    renderer = Renderer(load_tokenizer(directory), chat_template_kwargs=kwargs)
    assert share_tokenizer(client, directory, renderer.fingerprint()) >= 2
    return renderer


@pytest.mark.parametrize("variant", ["open", "hybrid"])
def test_worker_renders_the_producers_ids_from_redis(r: "redis.Redis", tmp_path: Path, variant: str) -> None:
    directory = build_tokenizer(tmp_path / "producer-tok", thinking=variant)
    kwargs = {"enable_thinking": False} if variant == "hybrid" else None
    producer = _store(r, directory, kwargs)
    worker = renderer_for(r, producer.fingerprint(), chat_template_kwargs=kwargs, root=tmp_path / "worker-cache")
    assert worker.fingerprint() == producer.fingerprint()
    for turn in (2, 6, len(CONVERSATION)):  # before the 1st, 2nd and 3rd user turn's answer
        assert worker.render(CONVERSATION[:turn]) == producer.render(CONVERSATION[:turn])
    cached = tmp_path / "worker-cache" / producer.fingerprint()
    assert sorted(p.name for p in cached.iterdir()) == sorted(p.name for p in directory.iterdir())
    assert renderer_for(r, producer.fingerprint(), chat_template_kwargs=kwargs) is worker  # once per process


@pytest.mark.parametrize("family", ["qwen3", "deepseek-r1", "glm45", "kimi", "gpt-oss"])
def test_model_families_render_alike_on_both_sides(r: "redis.Redis", tmp_path: Path, family: str) -> None:
    from producer.settings import PARSER_MARKERS
    directory = build_family_tokenizer(tmp_path / family, family)
    markers = PARSER_MARKERS[family]  # kimi's ◁think▷: opens_think looks for the parser's markers, as produce does
    producer = Renderer(load_tokenizer(directory), opens_markers=markers)
    assert share_tokenizer(r, directory, producer.fingerprint()) >= 2
    worker = renderer_for(r, producer.fingerprint(), opens_markers=markers, root=tmp_path / "worker-cache")
    for turn in (2, 6, len(CONVERSATION)):
        assert worker.render(CONVERSATION[:turn]) == producer.render(CONVERSATION[:turn])


def test_a_chat_template_file_travels(r: "redis.Redis", tmp_path: Path) -> None:
    """Newer repositories keep the template in chat_template.jinja, not in tokenizer_config.json."""
    directory = build_tokenizer(tmp_path / "tok", thinking="open")
    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    (directory / "chat_template.jinja").write_text(config.pop("chat_template"), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    producer = _store(r, directory)
    assert set(r.hkeys(keys.tokenizer_files(producer.fingerprint()))) == {
        b"tokenizer.json", b"tokenizer_config.json", b"chat_template.jinja"}
    worker = renderer_for(r, producer.fingerprint(), root=tmp_path / "worker-cache")
    assert worker.render(CONVERSATION) == producer.render(CONVERSATION)


def test_the_cache_is_under_tmpdir_and_private(r: "redis.Redis", tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    directory = build_tokenizer(tmp_path / "tok", thinking="open")
    fp = _store(r, directory).fingerprint()
    renderer_for(r, fp)
    root = tmp_path / turns.CACHE_DIR_NAME
    assert (root / fp / "tokenizer.json").is_file() and root.stat().st_mode & 0o777 == 0o700
    turns.forget()
    root.chmod(0o777)  # what another user's directory in a shared /tmp would look like
    with pytest.raises(TokenizerFault, match="not a directory this worker owns"):
        renderer_for(r, fp)


def test_a_second_store_changes_nothing(r: "redis.Redis", tmp_path: Path) -> None:
    directory = build_tokenizer(tmp_path / "tok", thinking="open")
    fp = _store(r, directory).fingerprint()
    before = r.hgetall(keys.tokenizer_files(fp))
    (directory / "tokenizer_config.json").write_text("{}", encoding="utf-8")  # same fingerprint claimed
    assert share_tokenizer(r, directory, fp) == 0  # HSETNX: the first copy stays
    assert r.hgetall(keys.tokenizer_files(fp)) == before


def test_tampered_files_are_a_mismatch(r: "redis.Redis", tmp_path: Path) -> None:
    directory = build_tokenizer(tmp_path / "tok", thinking="open")
    fp = _store(r, directory).fingerprint()
    key = keys.tokenizer_files(fp)
    config = json.loads(zlib.decompress(raw(r.hget(key, "tokenizer_config.json"))))
    config["chat_template"] = config["chat_template"].replace("<|im_start|>assistant", "<|im_start|>bot")
    r.hset(key, "tokenizer_config.json", zlib.compress(json.dumps(config).encode()))
    with pytest.raises(TokenizerMismatch, match=f"not the run's {fp[:12]}"):
        renderer_for(r, fp, root=tmp_path / "cache")
    # Another template's kwargs are another fingerprint too, and a fault of the same kind.
    turns.forget()
    r.delete(key)
    _store(r, directory)
    with pytest.raises(TokenizerMismatch):
        renderer_for(r, fp, chat_template_kwargs={"enable_thinking": False}, root=tmp_path / "cache2")


def test_a_damaged_local_copy_is_fetched_again(r: "redis.Redis", tmp_path: Path) -> None:
    directory = build_tokenizer(tmp_path / "tok", thinking="open")
    producer = _store(r, directory)
    root = tmp_path / "cache"
    renderer_for(r, producer.fingerprint(), root=root)
    turns.forget()  # a new worker process, same machine
    (root / producer.fingerprint() / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    again = renderer_for(r, producer.fingerprint(), root=root)
    assert again.render(CONVERSATION) == producer.render(CONVERSATION)


def test_faults_name_what_is_wrong(r: "redis.Redis", tmp_path: Path) -> None:
    fp = "ab" * 32
    with pytest.raises(TokenizerFault, match="holds no tokenizer files"):
        renderer_for(r, fp, root=tmp_path / "cache")
    r.hset(keys.tokenizer_files(fp), mapping={"tokenizer.json": zlib.compress(b"{}"),
                                              "tokenizer_config.json": zlib.compress(b"{}"),
                                              "../escape.json": zlib.compress(b"{}")})
    with pytest.raises(TokenizerFault, match="not tokenizer file names: '../escape.json'"):
        renderer_for(r, fp, root=tmp_path / "cache")
    assert not (tmp_path / "escape.json").exists()
    with pytest.raises(TokenizerFault, match="64 lowercase hex digits"):
        renderer_for(r, "bq:ds:{x}", root=tmp_path / "cache")


def test_size_limits(r: "redis.Redis", tmp_path: Path) -> None:
    directory = build_tokenizer(tmp_path / "tok", thinking="open")
    total = sum(p.stat().st_size for p in directory.iterdir())
    with pytest.raises(tokfiles.TokenizerFilesError, match=f"hold {total:,} bytes .* more than the 1,000 bytes"):
        tokfiles.pack(directory, limit=1000)
    assert tokfiles.MAX_BYTES == 64 * 1024 * 1024
    with pytest.raises(runstate.TokenizerStoreError, match="more than the 67,108,864"):
        runstate.store_files(r, "cd" * 32, {"tokenizer.json": bytes(tokfiles.MAX_BYTES + 1)})
    assert not r.exists(keys.tokenizer_files("cd" * 32))
    # A zip bomb edited into Redis is refused while inflating, not after.
    bomb = {"tokenizer.json": zlib.compress(bytes(2_000_000)), "tokenizer_config.json": zlib.compress(b"{}")}
    with pytest.raises(tokfiles.TokenizerFilesError, match="more than 1,000,000 bytes uncompressed"):
        tokfiles.unpack(bomb, tmp_path / "out", limit=1_000_000)
    assert not (tmp_path / "out").exists()
    (directory / "tokenizer.json").unlink()
    with pytest.raises(UsageError, match="no tokenizer.json"):
        share_tokenizer(r, directory, "ef" * 32)


#: A sitecustomize for the worker: at exit, the names of every module it imported, to $BUDGETQ_TEST_MODULES.
SITECUSTOMIZE = """\
import atexit, json, os, sys
if os.environ.get("BUDGETQ_TEST_MODULES"):
    def _dump(path=os.environ["BUDGETQ_TEST_MODULES"], pid=os.getpid()):
        if os.getpid() == pid:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(sorted(sys.modules), fh)
    atexit.register(_dump)
"""


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_single_turn_run_never_imports_transformers_in_the_worker(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    import subprocess
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    modules = tmp_path / "worker-modules.json"
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "100", "--seed", "5")
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="8", BUDGETQ_TEST_MODULES=str(modules),
                   PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    pool.start("w0")
    out = tmp_path / "out"
    # The default --turns all on a dataset of one user turn per sample (code_instruct): a single-turn run.
    res = subprocess.run([*produce_cmd(), "run", str(ROOT / "demo" / "data" / "code_instruct.jsonl"), "--tokenizer",
                          str(tokenizer_dir), "--max-tokens", "200", "--max-samples", "8", "--chunk-size", "4",
                          "--out", str(out), "--redis-url", redis_url, "--quiet"],
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(read_jsonl(out / "code_instruct" / "raw_responses.jsonl")) == 8
    pool.stop_all()  # SIGTERM: a warm shutdown, so the interpreter exits normally and runs atexit
    loaded = json.loads(modules.read_text(encoding="utf-8"))  # missing: the hook never ran, the check proves nothing
    assert "worker.dispatch" in loaded and "rq.worker" in loaded  # it is the worker that served the run
    assert not [m for m in loaded if m == "transformers" or m.startswith("transformers.")]
    assert "render.chat" not in loaded and "render.tokfiles" not in loaded
    assert not r.keys("bq:tok:*")  # a single-turn run stores no tokenizer files
