"""The promise checked on a finished run: each id once in a dataset's file, and its Redis counter equal to the file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import redis

from budget import keys
from tests.procs import read_jsonl


def check_exact(r: "redis.Redis", out: Path, name: str) -> list[dict[str, Any]]:
    """The promise: no id twice, and the counter equals Sum(completion_tokens) in the file."""
    recs = read_jsonl(out / name / "raw_responses.jsonl")
    ids = [x["id"] for x in recs]
    assert len(ids) == len(set(ids)), f"{name}: duplicate ids in the output"
    used = int(r.get(keys.DatasetKeys(name).used) or 0)
    assert used == sum(x["completion_tokens"] for x in recs), f"{name}: counter drift"
    assert r.hlen(keys.DatasetKeys(name).done) == len(recs)
    return recs
