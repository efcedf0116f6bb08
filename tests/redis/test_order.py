"""--order: the subset a budget keeps is the first prompts of a seeded random order, stable across reruns;
and the chunks that shrink at a dataset's tail (--chunk-size as a maximum)."""
from __future__ import annotations

import json
import math
import os
import random as stdlib_random
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from budget import keys
from producer.session.loop import ASSUMED_WORKERS, MIN_CHUNK, TAIL_SPREAD, chunk_size_for
from producer.settings import FILE, RANDOM, Order, permute, rank
from tests.exactly_once import check_exact
from tests.procs import produce, produce_cmd, read_jsonl, wait_for
from tests.rq_jobs import job_payloads

HALF = 100  # topic A: ids a-0..a-99 (the file's first half), topic B: b-0..b-99


class _S:
    def __init__(self, sid: str) -> None:
        self.id = sid


def _ids(items: list[_S]) -> list[str]:
    return [x.id for x in items]


def perm(ids: list[str], seed: int = 0) -> list[str]:
    return _ids(permute([_S(i) for i in ids], Order(RANDOM, seed)))


# -- the permutation ---------------------------------------------------------------------------------------
def test_order_depends_only_on_ids_and_seed() -> None:
    ids = [f"id-{i}" for i in range(500)]
    shuffled = list(ids)
    stdlib_random.Random(1).shuffle(shuffled)
    assert perm(ids) == perm(shuffled)  # not on the file's order
    assert perm(ids) != ids and sorted(perm(ids)) == sorted(ids)
    assert perm(ids, 1) != perm(ids, 0)
    assert _ids(permute([_S(i) for i in ids], Order(FILE))) == ids


def test_adding_or_removing_other_ids_keeps_the_rest_in_order() -> None:
    ids = [f"id-{i}" for i in range(400)]
    full = perm(ids)
    fewer = perm(ids[::2])
    more = perm(ids + [f"new-{i}" for i in range(100)])
    assert fewer == [x for x in full if x in set(ids[::2])]
    assert [x for x in more if x in set(ids)] == full
    # The first N of the order are the same N prompts whatever N: a larger --max-samples or budget extends them.
    for n in (1, 10, 100):
        assert perm(ids)[:n] == full[:n]
    assert rank(0, "x") == rank(0, "x") != rank(1, "x")
    assert perm(["é", "a\tb", "\ud800"]) == perm(["\ud800", "a\tb", "é"])  # any id, even a lone surrogate


# -- chunk sizes at the tail -------------------------------------------------------------------------------
def test_chunks_shrink_as_the_todo_list_runs_out() -> None:
    assert chunk_size_for(100_000, 256, 4) == 256
    assert chunk_size_for(TAIL_SPREAD * 4 * 256, 256, 4) == 256
    assert chunk_size_for(1000, 256, 4) == math.ceil(1000 / (TAIL_SPREAD * 4))
    assert chunk_size_for(10, 256, 4) == MIN_CHUNK
    assert chunk_size_for(3, 256, 4) == MIN_CHUNK  # the caller takes min(size, what is left)
    assert chunk_size_for(1000, 4, 4) == 4  # --chunk-size below the minimum wins
    assert chunk_size_for(1000, 256, 0) == chunk_size_for(1000, 256, ASSUMED_WORKERS)  # none registered yet
    # A whole dataset chunked this way: every sample once, the last chunks small.
    todo, sizes = 3000, []
    while todo:
        n = min(chunk_size_for(todo, 256, 4), todo)
        sizes.append(n)
        todo -= n
    assert sum(sizes) == 3000 and sizes[0] == 256 and max(sizes[-8:]) <= MIN_CHUNK
    assert sizes == sorted(sizes, reverse=True) and len(sizes) < 60


# -- end to end --------------------------------------------------------------------------------------------
def topic_file(path: Path) -> Path:
    """The file's first half is topic A, its second half topic B: file order under a budget keeps only A."""
    lines = [json.dumps({"id": f"a-{i}", "prompt": f"Question {i} about arithmetic."}) for i in range(HALF)]
    lines += [json.dumps({"id": f"b-{i}", "prompt": f"Question {i} about poetry."}) for i in range(HALF)]
    path.write_text("\n".join(lines) + "\n")
    return path


ALL_IDS = [f"a-{i}" for i in range(HALF)] + [f"b-{i}" for i in range(HALF)]


def done_ids(out: Path, name: str = "topics") -> list[str]:
    return [x["id"] for x in read_jsonl(out / name / "raw_responses.jsonl")]


def assert_prefix(ids: list[str], order: list[str]) -> None:
    """With one worker, samples are admitted in enqueue order: what a budget kept is a prefix of the order."""
    assert set(ids) == set(order[:len(ids)]), "not the first prompts of the order"


@pytest.mark.e2e
def test_budget_keeps_an_unbiased_prefix_stable_across_reattach_and_rerun(
        redis_url: str, r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path, sim_factory: Any,
        workers: Any) -> None:
    sim = sim_factory("--time-scale", "50", "--mean-tokens", "100", "--seed", "11")
    workers(sim.url, BUDGETQ_CONCURRENCY="8").start("w0")  # one worker: admitted in enqueue order
    data = topic_file(tmp_path / "topics.jsonl")
    out = tmp_path / "out"
    budget = 8_000  # ~80 of the 200 prompts at a mean of 100
    common = [str(data), "--tokenizer", str(tokenizer_dir), "--max-tokens", "300", "--chunk-size", "8",
              "--budget-mode", "drain", "--out", str(out)]
    base = [*common, "--budget", str(budget)]
    order = perm(ALL_IDS)

    # Reattach: kill -9 the attached produce mid-run, run the same command again.
    proc = subprocess.Popen([*produce_cmd(), *base, "--redis-url", redis_url], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: r.hlen(keys.DatasetKeys("topics").done) >= 20, 120, "some responses committed")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
    again = produce(base, redis_url)
    assert again.returncode == 0, again.stderr
    first = done_ids(out)
    check_exact(r, out, "topics")
    assert_prefix(first, order)
    n = len(first)
    a = sum(1 for x in first if x.startswith("a-"))
    assert 40 <= n <= 120, n
    assert abs(a - n / 2) <= 4 * math.sqrt(n / 4), (a, n)  # binomial(n, 1/2) within 4 sigma
    manifest = json.loads((out / "topics" / "manifest.json").read_text())
    assert manifest["order"] == {"mode": "random", "seed": 0}
    assert json.loads((out / "topics" / "run.json").read_text())["order"] == {"mode": "random", "seed": 0}

    # A budget raised later extends the same selection.
    more = produce([*common, "--budget", str(2 * budget)], redis_url)
    assert more.returncode == 0, more.stderr
    extended = done_ids(out)
    assert extended[:n] == first and len(extended) > n
    assert_prefix(extended, order)

    # A rerun from scratch (--new-run) selects the same prompts again.
    rerun = produce([*base, "--new-run"], redis_url)
    assert rerun.returncode == 0, rerun.stderr
    again_ids = done_ids(out)
    assert_prefix(again_ids, order)
    # The simulator's lengths differ on a rerun (its n-th request gets its n-th length), so the budget ends a few
    # prompts earlier or later: the smaller selection is part of the larger, both the first prompts of the order.
    small, large = sorted((set(first), set(again_ids)), key=len)
    assert small <= large

    # --order file: the file's first prompts, all topic A.
    filed = produce([*base, "--order", "file", "--new-run"], redis_url)
    assert filed.returncode == 0, filed.stderr
    kept = done_ids(out)
    assert kept and all(x.startswith("a-") for x in kept)
    assert_prefix(kept, ALL_IDS)


@pytest.mark.e2e
def test_max_samples_takes_the_first_n_of_the_order(redis_url: str, r: "redis.Redis", tokenizer_dir: Path,
                                                    tmp_path: Path) -> None:
    data = topic_file(tmp_path / "topics.jsonl")
    out = tmp_path / "out"
    base = [str(data), "--tokenizer", str(tokenizer_dir), "--max-tokens", "64", "--chunk-size", "8", "--out",
            str(out)]
    plan = produce([*base, "--max-samples", "30", "--dry-run", "--json", "--order-seed", "5"], redis_url)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["datasets"][0]["order"] == "random (seed 5)"
    text = produce([*base, "--dry-run", "--order", "file"], redis_url)
    assert text.returncode == 0 and "order: file" in text.stdout, text.stderr

    # No worker: the chunks stay queued, in enqueue order.
    res = produce([*base, "--max-samples", "30", "--order-seed", "5", "--detach"], redis_url)
    assert res.returncode == 0, res.stderr
    sent = [s["id"] for p in job_payloads(r) for s in p["samples"]]
    assert sent == perm(ALL_IDS, 5)[:30]
    res = produce([*base, "--max-samples", "50", "--order-seed", "5", "--detach"], redis_url)
    assert res.returncode == 0, res.stderr  # a larger --max-samples: the same 30 and 20 more
    sent = [s["id"] for p in job_payloads(r) for s in p["samples"]]
    assert sent == perm(ALL_IDS, 5)[:50]
    changed = produce([*base, "--max-samples", "50", "--detach"], redis_url)  # seed 0 now: another selection
    assert changed.returncode == 2 and "order: stored" in changed.stderr, changed.stderr
