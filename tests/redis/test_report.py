"""What ``produce`` says of its datasets (producer/ops/status.py): one tok/s and eta, the ones ``produce status`` shows,
read from the commit scripts' 10-second token buckets in Redis (docs/cli.md, "Status columns")."""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import redis

from budget import keys
from producer.ops.status import all_status, deadline_lines, deadline_total
from producer.prepare import load_inputs
from producer.session.attach import RunOptions
from producer.session.loop import Producer
from tests.demo_data import CODE, GLAIVE
from tests.producers import code_inputs, run_settings

DS = "code_instruct"


def test_the_progress_line_shows_the_tok_s_and_eta_of_produce_status(r: "redis.Redis", tokenizer_dir: Path,
                                                                      tmp_path: Path) -> None:
    inputs, options = code_inputs(tokenizer_dir, tmp_path / "out", budget=30_000)
    producer = Producer(r, inputs.prepared, options, echo=lambda msg: None)
    producer.attach()
    try:
        # 1,200 tokens committed in the last full 10-second bucket (what commit's HINCRBY writes), none collected:
        # 120 tok/s over that bucket, whoever reads it. Both read at one pinned moment: the buckets move with the clock.
        now = time.time()
        r.hincrby(keys.DatasetKeys(DS).stats, f"t:{int(now // 10) - 1}", 1200)
        producer.step()
        [row] = all_status(r, [DS], now=now)
        assert row.tokens_per_s == 120.0 and row.eta_s == 30_000 / 120.0
        line = producer.progress_line(now)
        assert f" {row.tokens_per_s:.0f} tok/s eta {int(row.eta_s)}s" in line, line
    finally:
        producer.release()


def test_the_progress_line_shows_the_deadline_projection_of_produce_status(r: "redis.Redis", tokenizer_dir: Path,
                                                                          tmp_path: Path) -> None:
    now = float(int(time.time()))  # pinned, whole seconds: the deadline is stored in ms, exactly now + 100
    inputs, options = code_inputs(tokenizer_dir, tmp_path / "out", budget=30_000)
    options = dataclasses.replace(options, deadline=now + 100)
    producer = Producer(r, inputs.prepared, options, echo=lambda msg: None)
    producer.attach()
    meta = keys.DatasetKeys(DS).meta
    try:
        # 120 tok/s (1,200 tokens in the last full bucket): 12,000 tokens by a deadline 100 s away, short of 30,000.
        r.hincrby(keys.DatasetKeys(DS).stats, f"t:{int(now // 10) - 1}", 1200)
        producer.step()
        rows = all_status(r, [DS], now=now)
        said = deadline_lines(r, rows, now=now)
        assert "(in 1m40s): projected 12,000 tokens by then at 120 tok/s; warning: short of its budget 30,000" in said
        line = producer.progress_line(now)
        assert line.endswith(" 120 tok/s eta 250s deadline in 1m40s projected 12000 WARNING short of the budget "
                             "30000 at this rate"), line
        # A deadline 1,000 s away: 120,000 at this rate, capped at the budget, and no warning.
        r.hset(meta, "deadline", round((now + 1_000) * 1000))
        producer.step()
        assert "(in 16m40s): projected 30,000 tokens by then at 120 tok/s" in deadline_lines(r, rows, now=now)
        assert producer.progress_line(now).endswith(" deadline in 16m40s projected 30000"), producer.progress_line(now)
        assert "WARNING" not in producer.progress_line(now)
        # Passed while what runs finishes; then the admit script's close by deadline.
        r.hset(meta, "deadline", round((now - 1) * 1000))
        producer.step()
        assert producer.progress_line(now).endswith(" deadline passed"), producer.progress_line(now)
        r.hset(meta, mapping={"status": "closed", "closed_by": "deadline"})
        producer.step()
        assert producer.progress_line(now).endswith(" deadline reached"), producer.progress_line(now)
    finally:
        producer.release()


def test_status_and_the_progress_line_sum_the_datasets_projections_by_the_deadline(
        r: "redis.Redis", tokenizer_dir: Path, tmp_path: Path) -> None:
    """Issue 27 §3: per dataset and in total. Two datasets at 120 and 30 tok/s, 100 s before their deadline."""
    now = float(int(time.time()))
    settings = run_settings(str(CODE), str(GLAIVE), "--tokenizer", str(tokenizer_dir), "--max-tokens", "64",
                            "--order", "file", "--turns", "last", terminal=False)
    inputs = load_inputs(settings, echo=lambda msg: None, warn=lambda msg: None)
    options = RunOptions(out_dir=tmp_path / "out", budgets={DS: 30_000, "glaive_fc": 5_000}, chunk_size=8,
                         show_progress=False, deadline=now + 100)
    producer = Producer(r, inputs.prepared, options, echo=lambda msg: None)
    producer.attach()
    try:
        r.hincrby(keys.DatasetKeys(DS).stats, f"t:{int(now // 10) - 1}", 1200)
        r.hincrby(keys.DatasetKeys("glaive_fc").stats, f"t:{int(now // 10) - 1}", 300)
        producer.step()
        said = deadline_lines(r, all_status(r, [DS, "glaive_fc"], now=now), now=now)
        # 12,000 (short of 30,000) + 3,000 (short of 5,000)
        assert said.endswith("\ntotal: projected 15,000 tokens by the deadline over 2 datasets; warning: short of "
                             "their budgets' 35,000"), said
        line = producer.progress_line(now)
        assert line.endswith(" | total: projected 15,000 tokens by the deadline over 2 datasets; warning: short of "
                             "their budgets' 35,000"), line
    finally:
        producer.release()


def test_one_dataset_has_no_total_and_unlimited_ones_have_no_budget_to_fall_short_of() -> None:
    assert deadline_total([(5, 10)]) == ""
    assert deadline_total([(5, 10), (7, None)]) == "total: projected 12 tokens by the deadline over 2 datasets"
    assert deadline_total([(10, 10), (7, 7)]) == "total: projected 17 tokens by the deadline over 2 datasets of 17"
