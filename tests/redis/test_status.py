"""``produce status`` tells the truth: a finished dataset reads ``complete`` (not ``open`` with a stale eta), its
eta ends where its samples run out when that comes before the budget, an unknown name is an error, a malformed
Redis URL is one ``Error:`` line, and ``--watch`` outlives a Redis that goes away (issue 29, Medium and Low)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
import redis
from click.testing import CliRunner

from budget import keys
from budget.ledger import Ledger
from budget.runstate import RunState
from demo.stack import RedisServer
from producer.cli import main
from producer.ops.status import all_status, eta_seconds, status_table, tokens_per_second
from tests.procs import produce_cmd


def status(args: list[str], redis_url: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["status", *args, "--redis-url", redis_url], catch_exceptions=False)
    return res.exit_code, res.output


def dataset(r: "redis.Redis", name: str, budget: int | None, selected: int, todo: int) -> None:
    """A dataset as an attached produce leaves it: registered, its budget set, ``todo`` samples not yet in a
    chunk; no chunk queued or running."""
    RunState(r).register(name, "{}", time.time())
    Ledger(r).set_budget(name, budget)
    RunState(r).set_progress(name, selected=selected, todo=todo)


def test_finished_dataset_reads_complete_with_no_eta(r: "redis.Redis") -> None:
    dataset(r, "finished", None, selected=3, todo=0)  # every sample handed out; nothing left anywhere
    dataset(r, "waiting", 1000, selected=3, todo=2)
    dataset(r, "spent", 0, selected=3, todo=0)  # closed by its budget: it stays closed, never "complete"
    r.hset(keys.DatasetKeys("finished").stats, f"t:{int(time.time() // 10) - 2}", 600)
    rows = {row.name: row for row in all_status(r)}
    assert rows["finished"].status == "complete" and rows["finished"].eta_s is None
    assert rows["waiting"].status == "open" and rows["spent"].status == "closed"
    table = status_table(list(rows.values()))
    assert "complete" in table and "not run" in table.splitlines()[0]


def test_eta_ends_where_the_samples_run_out() -> None:
    # 10,000 tokens of budget left, but the samples left are worth 2,000 at 100 tok/s: 20 s, not 100 s.
    assert eta_seconds(20_000, 10_000, "open", 100.0, left_tokens=2_000) == 20.0
    assert eta_seconds(20_000, 10_000, "open", 100.0, left_tokens=50_000) == 100.0
    assert eta_seconds(None, 10_000, "open", 100.0, left_tokens=2_000) == 20.0  # unlimited: the samples' end
    assert eta_seconds(None, 10_000, "open", 100.0) is None  # nothing to price the rest with yet
    assert eta_seconds(20_000, 10_000, "complete", 100.0, left_tokens=0) is None
    assert eta_seconds(20_000, 10_000, "open", 0.0, left_tokens=2_000) is None


def test_tok_s_of_a_run_younger_than_a_minute_is_its_rate_not_a_minutes_average() -> None:
    now = 100_005.0  # bucket 10,000 is running, 9,994-9,999 are the last minute's full ones
    def buckets(**by_age: int) -> dict[str, str]:
        return {f"t:{10_000 - int(age[1:])}": str(v) for age, v in by_age.items()}
    # Started (or resumed) 20 s ago at 100 tok/s: 100, not the 33 a minute's average read ("0 tok/s" while
    # working, an eta three times too long after a resume); the run before the resume is not counted.
    assert tokens_per_second(buckets(a2=1_000, a1=1_000, a0=700, a90=50_000), now) == 100.0
    assert tokens_per_second(buckets(**{f"a{i}": 600 for i in range(1, 7)}), now) == 60.0  # a full minute
    assert tokens_per_second(buckets(a6=1_200), now) == 20.0  # one burst a minute ago, nothing since
    assert tokens_per_second(buckets(a0=500), now) == 0.0  # only the running bucket: trails by up to 10 s
    assert tokens_per_second({}, now) == 0.0


def test_unknown_dataset_is_an_error(r: "redis.Redis", redis_url: str) -> None:
    dataset(r, "known", 10, selected=1, todo=1)
    code, out = status(["nope"], redis_url)
    assert code == 2 and "no dataset 'nope' in this Redis" in out and "known" in out


@pytest.mark.parametrize("url", ["localhost:46379", "redis//127.0.0.1:6379", "redis://127.0.0.1:notaport/0"])
@pytest.mark.parametrize("command", [["status"], ["budget", "ds", "10k"], ["metrics"]])
def test_malformed_redis_url_is_one_error_line(command: list[str], url: str) -> None:
    res = CliRunner().invoke(main, [*command, "--redis-url", url], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert "Invalid value for '--redis-url'" in res.output and "Traceback" not in res.output


def test_malformed_redis_url_refused_before_anything(tmp_path: object) -> None:
    res = subprocess.run([*produce_cmd(), "nothing.jsonl", "--tokenizer", "nowhere", "--max-tokens", "10",
                          "--redis-url", "localhost:46379"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "--redis-url" in res.stderr


def test_watch_outlives_a_redis_that_goes_away(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Its own redis-server, stopped under a ``status --watch``: the watch says Redis is unreachable and goes on
    (it is still running a few refreshes later) instead of dying with a traceback."""
    server = RedisServer(tmp_path_factory.mktemp("watched"))
    server.start()
    try:
        dataset(redis.Redis.from_url(server.url), "ds", 100, selected=1, todo=1)
        proc = subprocess.Popen([*produce_cmd(), "status", "--watch", "--interval", "0.2", "--redis-url",
                                 server.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        try:
            assert _read_until(proc, "ds")
            server.stop()
            assert _read_until(proc, "Redis unreachable")
            assert _read_until(proc, "Redis unreachable")  # a later refresh: still watching
            assert proc.poll() is None
        finally:
            proc.terminate()
            _, err = proc.communicate(timeout=30)
        assert "Traceback" not in err
    finally:
        server.stop()


def _read_until(proc: "subprocess.Popen[str]", text: str) -> bool:
    """Read the watch's output line by line until one holds ``text`` (True) or it ends (False)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if text in line:
            return True
    return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
