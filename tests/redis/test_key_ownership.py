"""budget/ owns every ``bq:`` key, for real (docs/architecture.md, "Who touches the keys").

Two checks. The source: no module of producer/, render/, worker/ or demo/ names a key (a ``budget.keys`` name
other than the queue name and the chunk-id builder, or a ``bq:`` string) or calls a Redis command method, so every
command they cause goes through a budget/ call. A run: ``produce`` in-process and a real ``rq worker`` subprocess, both
recording, for each command on a ``bq:`` key, which module sent it (tests/key_senders.py): every one must come
from budget/.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Iterator

import pytest
import redis

from budget import keys
from tests import key_senders
from tests.procs import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("producer", "render", "worker", "demo")
#: What of budget/keys.py a module outside budget/ may use: they name no key (the queue, a chunk id, the separator of
#: composite names, the dataset-name alphabet).
NOT_KEYS = {"QUEUE_NAME", "chunk_id", "SEP", "DATASET_NAME_RULE", "valid_dataset_name"}
#: Redis command methods of redis-py clients and pipelines. Outside budget/ none is called on anything (RQ's
#: keys go through RQ's API). ``get``/``set``/``delete``/``exists``/``keys``/``unlink``/``rename`` are left out: dicts,
#: paths and jobs have those too; the run below catches a call of them on a key.
REDIS_COMMANDS = {
    "hset", "hsetnx", "hget", "hgetall", "hmget", "hmset", "hdel", "hlen", "hvals", "hkeys", "hexists", "hincrby",
    "zadd", "zrem", "zscore", "zrange", "zrangebyscore", "zrevrange", "zcard", "zcount", "zincrby",
    "sadd", "srem", "smembers", "sismember", "scard", "xadd", "xrange", "xrevrange", "xread", "xdel", "xlen",
    "xtrim", "incr", "incrby", "decr", "decrby", "llen", "lrange", "lpush", "rpush", "lpop", "rpop", "lrem", "ltrim",
    "expire", "pexpire", "persist", "scan_iter", "mget", "mset", "setnx", "getset", "eval", "evalsha",
    "register_script",
}


def _modules() -> list[Path]:
    return sorted(p for pkg in CHECKED for p in (ROOT / pkg).rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def violations(path: Path) -> list[str]:
    """What in ``path`` names a key or sends a Redis command itself: "file:line: what"."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    docs = _docstrings(tree)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    aliases = set()  # local names bound to the budget.keys module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "budget":
            aliases |= {a.asname or a.name for a in node.names if a.name == "keys"}
        elif isinstance(node, ast.ImportFrom) and node.module == "budget.keys":
            found += [f"{where}:{node.lineno}: imports budget.keys.{a.name}" for a in node.names
                      if a.name not in NOT_KEYS]
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: imports budget.keys" for a in node.names if a.name == "budget.keys"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr not in NOT_KEYS:
            found.append(f"{where}:{node.lineno}: uses keys.{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "bq:" in node.value \
                and id(node) not in docs:
            found.append(f"{where}:{node.lineno}: names a bq: key in {node.value[:40]!r}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in REDIS_COMMANDS:
            found.append(f"{where}:{node.lineno}: calls the Redis command {node.func.attr}()")
    return found


def test_no_module_outside_budget_names_a_key_or_sends_a_command() -> None:
    assert len(_modules()) > 30
    found = [v for path in _modules() for v in violations(path)]
    assert not found, "move these behind budget/ (a Ledger or RunState method, or a script):\n" + "\n".join(found)


def test_the_source_check_catches_what_it_is_for(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('from budget import keys\nfrom budget.keys import DatasetKeys, QUEUE_NAME\n\n\n'
                     'def f(r):\n    """bq:ds:{n} in a docstring is fine."""\n'
                     '    r.hset(keys.DatasetKeys("a").meta, "status", "closed")\n'
                     '    r.get(f"bq:ds:{{a}}:used")\n    return keys.QUEUE_NAME, keys.chunk_id("a", 1)\n')
    assert sorted(v.split(": ", 1)[1] for v in violations(probe)) == [
        "calls the Redis command hset()", "imports budget.keys.DatasetKeys", "names a bq: key in 'bq:ds:{a}:used'",
        "uses keys.DatasetKeys"]


def test_every_field_of_the_dataset_hash_is_documented() -> None:
    """In budget/keys.py's field table, the one place the fields are described (docs/architecture.md points there)."""
    keys_doc = keys.__doc__ or ""
    for name in keys.META_FIELDS:
        assert f"``{name}``" in keys_doc, f"budget/keys.py does not document field {name}"


DATA = ROOT / "demo" / "data"


@pytest.fixture
def senders() -> Iterator[dict[str, int]]:
    """file -> commands on bq: keys it sent, for every redis-py client of this process while the test runs."""
    counts: dict[str, int] = {}

    def note(who: str, args: tuple[Any, ...]) -> None:
        counts[who] = counts.get(who, 0) + 1

    undo = key_senders.install(note)
    yield counts
    undo()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_run_sends_every_command_on_a_bq_key_from_budget(redis_url: str, tokenizer_dir: Path, tmp_path: Path,
                                                           sim_factory: Any, workers: Any,
                                                           senders: dict[str, int]) -> None:
    from click.testing import CliRunner

    from producer.cli import main
    from producer.ops.metrics import render_metrics
    sim = sim_factory("--time-scale", "20", "--mean-tokens", "200", "--seed", "3")
    sink = tmp_path / "worker-senders.tsv"
    pool = workers(sim.url, BUDGETQ_CONCURRENCY="8",
                   **key_senders.env_for_sink(sink, key_senders.sitecustomize_dir(tmp_path / "site")))
    pool.start("w0")
    out = tmp_path / "out"
    run = ["run", str(DATA / "glaive_fc.jsonl"), "--tokenizer", str(tokenizer_dir), "--max-tokens", "400",
           "--chunk-size", "4", "--queue-depth", "2", "--out", str(out), "--redis-url", redis_url, "--quiet"]
    cli = CliRunner()
    steps = [
        [*run, "--max-samples", "12", "--budget", "1M", "--budget-mode", "strict"],  # attach, enqueue, collect
        ["status", "glaive_fc", "--json", "--redis-url", redis_url],
        ["budget", "glaive_fc", "1", "--redis-url", redis_url],  # closes it: discard
        [*run, "--max-samples", "6", "--new-run"],  # close, discard, forget, start again
    ]
    for args in steps:
        res = cli.invoke(main, args, catch_exceptions=False)
        assert res.exit_code == 0, (args, res.output)
    assert "budgetq_dataset_info" in render_metrics(redis.Redis.from_url(redis_url))

    pool.stop_all()  # warm: its last commands are in the sink
    for who, counts in (("produce", senders), ("the worker", key_senders.read_sink(sink))):
        foreign = {f: n for f, n in counts.items() if not f.startswith("budget/")}
        assert not foreign, f"commands on bq: keys that {who} sent from outside budget/: {foreign}"
        # The recorder saw the ledger's traffic: its scripts go out from budget/ledger.py, its reads from ledger.py.
        assert counts.get("budget/ledger.py", 0) + counts.get("budget/ledger.py", 0) > 20, (who, counts)
    assert senders.get("budget/runstate.py", 0) > 10
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    fields = set(r.hgetall(keys.DatasetKeys("glaive_fc").meta))
    assert fields <= set(keys.META_FIELDS), f"undocumented fields of bq:ds:{{n}}: {fields - set(keys.META_FIELDS)}"
    assert len(read_jsonl(out / "glaive_fc" / "raw_responses.jsonl")) == 6
