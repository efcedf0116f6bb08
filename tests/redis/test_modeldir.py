"""Model directories as they are on disk: an unset model_max_length, config.json (plain and multimodal), hub ids
in the local Hugging Face cache, and the SGLang servers' own limit winning at attach.

The directories are built here as real repositories lay them out: a tokenizer made by demo/tokenizer.py's builder
with ``model_max_length`` left out of tokenizer_config.json (transformers then reports int(1e30)), a config.json
beside it, and a fake hub cache (``models--ORG--NAME/blobs/`` holding the files, ``snapshots/<commit>/`` of
symlinks into it, ``refs/main``). ``produce`` runs as a subprocess (``--dry-run`` and a real run against real
``rq worker`` processes and the simulator) with HF_HUB_CACHE/HF_HOME pointing at the fake cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from render.modeldir import Context, ModelDirError, config_context, hub_cache_dir, hub_snapshot, resolve_tokenizer
from tests.procs import produce_cmd, read_jsonl, sim_stats, wait_for

REPO = "Qwen/Qwen3-8B"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHORT = "Say hi."
LONG = " ".join(["Explain the function call below, and every one of its arguments, in detail."] * 30)


@pytest.fixture(scope="module")
def unset_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer directory whose tokenizer_config.json has no model_max_length, and no config.json."""
    from demo.tokenizer import build_tokenizer
    return build_tokenizer(tmp_path_factory.mktemp("unset-tok"), thinking="open", model_max_length=None)


def model_dir(base: Path, tokenizer: Path, config: dict[str, Any] | None) -> Path:
    """A model directory: the tokenizer's files plus config.json (if given)."""
    base.mkdir(parents=True, exist_ok=True)
    for f in tokenizer.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    if config is not None:
        (base / "config.json").write_text(json.dumps(config))
    return base


def hub_cache(cache: Path, repo: str, source: Path, *, with_ref: bool = True) -> Path:
    """``source``'s files laid out as the hub cache keeps a snapshot of ``repo``; returns the snapshot."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True)
    snapshot = root / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        data = f.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (root / "blobs" / blob).write_bytes(data)
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    if with_ref:
        (root / "refs").mkdir()
        (root / "refs" / "main").write_text(COMMIT)
    return snapshot


def write_input(path: Path) -> Path:
    rows = [{"id": f"s{i}", "messages": [{"role": "user", "content": SHORT if i % 2 == 0 else LONG}]}
            for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def produce(args: list[str], *, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **(env or {})}
    return subprocess.run([*produce_cmd(), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=full)


def dry_run_plan(res: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


# ------------------------------------------------------------------------------------------ config.json

@pytest.mark.parametrize("config, expected", [
    ({"max_position_embeddings": 40960}, Context(40960, "config.json max_position_embeddings")),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {"image_size": 896},
      "text_config": {"max_position_embeddings": 131072}},
     Context(131072, "config.json text_config.max_position_embeddings")),
    ({"max_position_embeddings": 32768, "seq_length": 8192}, Context(8192, "config.json seq_length")),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}},
     Context(8192, "config.json max_position_embeddings x rope_scaling factor 2")),
    ({"max_position_embeddings": 40960,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     Context(40960, "config.json max_position_embeddings")),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     Context(131072, "config.json max_position_embeddings")),
    ({"thinker_config": {"text_config": {"max_position_embeddings": 32768}}},
     Context(32768, "config.json thinker_config.text_config.max_position_embeddings")),
    ({"hidden_size": 8}, None),
])
def test_config_context_reads_like_sglang(tmp_path: Path, config: dict[str, Any], expected: Context | None) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert config_context(tmp_path) == expected


def test_config_context_without_or_with_a_broken_config(tmp_path: Path) -> None:
    assert config_context(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match=f"{tmp_path / 'config.json'}: cannot read it as JSON"):
        config_context(tmp_path)


# ------------------------------------------------------------------------------------------- hub cache

def test_hub_cache_location_follows_huggingface_hub(tmp_path: Path) -> None:
    home = str(tmp_path)
    assert hub_cache_dir({"HOME": home}) == tmp_path / ".cache" / "huggingface" / "hub"
    assert hub_cache_dir({"HOME": home, "XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert hub_cache_dir({"HOME": home, "HF_HOME": "/h"}) == Path("/h/hub")
    assert hub_cache_dir({"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/old"}) == Path("/old")
    assert hub_cache_dir({"HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/old", "HF_HUB_CACHE": "/c"}) == Path("/c")


def test_hub_id_resolves_to_its_cached_snapshot(tmp_path: Path, unset_tokenizer: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    env = {"HF_HUB_CACHE": str(cache)}
    with pytest.raises(ModelDirError, match=f"not in the Hugging Face cache {cache} .*nothing is downloaded"):
        resolve_tokenizer(REPO, env)
    snapshot = hub_cache(cache, REPO, unset_tokenizer)
    assert resolve_tokenizer(REPO, env) == snapshot
    assert (snapshot / "tokenizer.json").is_symlink() and (snapshot / "tokenizer.json").is_file()
    (cache / "models--Qwen--Qwen3-8B" / "refs" / "main").unlink()
    assert hub_snapshot(REPO, environ=env) == snapshot  # no ref: the only snapshot there is
    (cache / "models--Qwen--Qwen3-8B" / "snapshots" / ("f" * 40)).mkdir()
    with pytest.raises(ModelDirError, match="2 snapshots and no refs/main"):
        hub_snapshot(REPO, environ=env)
    monkeypatch.chdir(tmp_path)
    local = tmp_path / "Qwen" / "Qwen3-8B"
    local.mkdir(parents=True)
    assert resolve_tokenizer(REPO, env) == Path(REPO), "a local directory of that name wins"
    with pytest.raises(ModelDirError, match="tokenizer directory not found: ./missing"):
        resolve_tokenizer("./missing", env)


# ------------------------------------------------------------------------------- produce --dry-run

@pytest.mark.e2e
def test_dry_run_takes_the_context_from_config_json_and_says_so(tmp_path: Path, unset_tokenizer: Path) -> None:
    data = write_input(tmp_path / "ds.jsonl")
    base = ["run", str(data), "--max-tokens", "50", "--dry-run", "--out", str(tmp_path / "out")]

    refused = produce([*base, "--tokenizer", str(unset_tokenizer)], cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert (f"the tokenizer's model_max_length is unset and there is no config.json in {unset_tokenizer}: "
            "give --max-context") in refused.stderr

    plain = model_dir(tmp_path / "plain", unset_tokenizer, {"max_position_embeddings": 32768})
    res = produce([*base, "--tokenizer", str(plain)], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "context: 32,768 tokens, from config.json max_position_embeddings" in res.stdout
    plan = dry_run_plan(produce([*base, "--tokenizer", str(plain), "--json"], cwd=tmp_path))
    assert plan["context"] == {"tokens": 32768, "source": "config.json max_position_embeddings"}
    assert plan["datasets"][0]["valid"] == 10 and plan["datasets"][0]["over_context"] == 0

    # a multimodal model: the language model's text_config; small enough that the long prompts do not fit
    multi = model_dir(tmp_path / "multi", unset_tokenizer, {
        "architectures": ["Gemma3ForConditionalGeneration"], "max_position_embeddings": 32768,
        "text_config": {"max_position_embeddings": 250}, "vision_config": {"image_size": 896}})
    plan = dry_run_plan(produce([*base, "--tokenizer", str(multi), "--json"], cwd=tmp_path))
    assert plan["context"] == {"tokens": 250, "source": "config.json text_config.max_position_embeddings"}
    assert (plan["datasets"][0]["valid"], plan["datasets"][0]["over_context"]) == (5, 5)
    res = produce([*base, "--tokenizer", str(multi)], cwd=tmp_path)
    assert ("exceeds the context of 250 (config.json text_config.max_position_embeddings)" in res.stderr)

    # the tokenizer's own model_max_length comes first, --max-context before both
    tok = tmp_path / "with-length"
    model_dir(tok, unset_tokenizer, {"max_position_embeddings": 250})
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 4096}))
    plan = dry_run_plan(produce([*base, "--tokenizer", str(tok), "--json"], cwd=tmp_path))
    assert plan["context"] == {"tokens": 4096, "source": "tokenizer model_max_length"}
    plan = dry_run_plan(produce([*base, "--tokenizer", str(tok), "--json", "--max-context", "1000"], cwd=tmp_path))
    assert plan["context"] == {"tokens": 1000, "source": "--max-context"}


def test_dry_run_with_a_hub_id_reads_the_local_cache_offline(tmp_path: Path, unset_tokenizer: Path) -> None:
    data = write_input(tmp_path / "ds.jsonl")
    hf_home = tmp_path / "hf"
    args = ["run", str(data), "--tokenizer", REPO, "--max-tokens", "50", "--dry-run", "--json"]
    env = {"HF_HOME": str(hf_home), "HF_HUB_CACHE": "", "HUGGINGFACE_HUB_CACHE": ""}

    missing = produce(args, cwd=tmp_path, env=env)
    assert missing.returncode == 2
    assert f"not in the Hugging Face cache {hf_home / 'hub'}" in missing.stderr and "Traceback" not in missing.stderr

    source = model_dir(tmp_path / "download", unset_tokenizer, {"max_position_embeddings": 40960})
    hub_cache(hf_home / "hub", REPO, source)
    plan = dry_run_plan(produce(args, cwd=tmp_path, env=env))
    assert plan["context"] == {"tokens": 40960, "source": "config.json max_position_embeddings"}
    assert plan["datasets"][0]["valid"] == 10


# ----------------------------------------------------------------------------- the servers' limit wins

@pytest.mark.e2e
def test_a_real_run_skips_what_the_servers_context_cannot_hold(redis_url: str, r: "redis.Redis", tmp_path: Path,
                                                               unset_tokenizer: Path, sim_factory: Any,
                                                               workers: Any) -> None:
    """config.json says 32,768; the server was started with --context-length 300. The workers record that, and
    produce skips the long prompts at attach instead of sending them to be refused one by one."""
    model = model_dir(tmp_path / "model", unset_tokenizer, {"max_position_embeddings": 32768})
    data = write_input(tmp_path / "ds.jsonl")
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "20", "--context-length", "300")
    workers(sim.url).start("w0")
    wait_for(lambda: r.hlen(keys.SERVER_INFO) > 0, 60, "the worker recorded its server's info")
    out = tmp_path / "out"
    res = produce(["run", str(data), "--tokenizer", str(model), "--max-tokens", "50", "--out", str(out),
                   "--redis-url", redis_url], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "context: 32,768 tokens (config.json max_position_embeddings)" in res.stderr
    assert ("ds: 5 samples skipped, not enqueued: prompt + --max-tokens 50 exceeds the SGLang servers' context "
            "of 300") in res.stderr
    assert "context_length, recorded by its workers in Redis" in res.stderr
    recs = read_jsonl(out / "ds" / "raw_responses.jsonl")
    assert sorted(x["id"] for x in recs) == [f"s{i}" for i in range(0, 10, 2)]
    assert not (out / "ds" / "failed.jsonl").exists(), "no prompt was sent to be refused (a 400 is a failure)"
    stats = sim_stats(sim.url)
    assert stats["submitted"] == stats["completed"] == 5, stats
    assert int(r.get(keys.DatasetKeys("ds").used) or 0) == sum(x["completion_tokens"] for x in recs)
    lines = res.stdout.splitlines()
    head = re.split(r"\s{2,}", lines[0].strip())  # the summary's columns ("over ctx", "server time": two words)
    row = next(re.split(r"\s{2,}", line.strip()) for line in lines if line.split()[:1] == ["ds"])
    assert row[head.index("over ctx")] == "5", res.stdout
