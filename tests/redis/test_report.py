"""What ``produce`` says of its datasets (producer/session/report.py): one tok/s and eta, the ones ``produce status`` shows,
read from the commit scripts' 10-second token buckets in Redis (docs/cli.md, "Status columns")."""
from __future__ import annotations

import time
from pathlib import Path

import redis

from budget import keys
from producer.ops.status import all_status
from producer.session.loop import Producer
from tests.producers import code_inputs

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
