"""``produce export`` as its command line: where it reads Redis from, what it says of a dataset still running, and
which tokenizer it uses (issue 29). The export itself is tests/test_export.py's."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result

from budget.ledger import Ledger
from producer.cli import main
from render.chat import load_tokenizer
from tests.test_export import standard_records, write_dataset


@pytest.fixture(scope="session")
def tok(tokenizer_dir: Path) -> Any:
    return load_tokenizer(tokenizer_dir)


@pytest.fixture
def ds(tmp_path: Path, tok: Any) -> Path:
    return write_dataset(tmp_path, tok, standard_records(tok, 2))


def export(ds: Path, *args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, ["export", ds.name, "--out", str(ds.parent), *args],
                              env={"REDIS_URL": None, **(env or {})}, catch_exceptions=False)


def manifest(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def test_export_reads_redis_url_like_every_command(ds: Path, r: redis.Redis, redis_url: str) -> None:
    Ledger(r).set_budget(ds.name, 1234)
    res = export(ds, env={"REDIS_URL": redis_url})
    assert res.exit_code == 0, res.output
    assert manifest(ds / "manifest.json")["extra"]["budget"] == 1234
    (ds / "manifest.json").unlink()
    res = export(ds)  # neither --redis-url nor REDIS_URL: no Redis is read
    assert res.exit_code == 0, res.output
    assert "extra" not in manifest(ds / "manifest.json")
