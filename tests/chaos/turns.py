"""Chaos on multi-turn runs (issue 14, bench 4): kill -9 a worker every few seconds while ``produce --turns all``
carries 3-turn conversations, a replacement started at once, and check the promise per turn.

    python -m tests.chaos --scenario worker-kill-turns          # no budget: every conversation to its end
    python -m tests.chaos --scenario worker-kill-turns-budget   # a budget of 30% of the run: kills go on for 60 s past the close

Checks, beyond tests/chaos/audit.py's (every conversation once, none lost, no traceback):
- the invariant (docs/multiturn.md): Redis ``used`` = Σ completion_tokens in the file + Σ committed turns not yet
  written (``Ledger.unwritten_turn_tokens``), drift 0; each record's ``completion_tokens`` = Σ of its turns;
- 0 turns counted twice: the dataset's ``stats.turns`` (one HINCRBY per committed turn in ``commit_turn``) = the
  turns on disk, and no record holds more turns than its conversation plans;
- 0 committed turns regenerated, from the server's side: the simulator's request log (``--request-log``) names
  each answer's (sample, turn) by its rid (budget/record.py ``turn_request_key``, ``request_id``); a turn's
  committed answer is the logged answer whose ``output_ids`` are the record's, and no answer to that turn may
  follow it. Answers before it were answered but never committed (the killed worker's): wasted, not wrong.
- the budget form also counts conversations ended ``stopped_by: "budget"``: those whose worker died after the
  dataset closed (a closed dataset resumes nothing; produce ends them with the turns they have,
  budget/record.py ``end_as_is``), beside those the budget stopped in a live worker.
"""
from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from budget.record import request_id, turn_request_key
from demo.appending import read_jsonl
from demo.stack import wait_until
from demo.synthetic import CONVERSATIONS_PARSER as PARSER
from demo.synthetic import write_conversations
from tests.chaos.audit import DATASET, Result, audit, log_files
from tests.chaos.audit import rounded as _r
from tests.chaos.run import KEYS, ChaosStack, Ctx, Produce, Watch, produce_argv
from tests.replies import texts

TURNS = 3
#: Conversations per scale: about as many requests as the scale's prompts (3 turns each), ~1 min of work.
CONVERSATIONS = {"ci": 140, "short": 300, "full": 3_000}
#: The kill phase's longest stretch (seconds): on the shared machine 700 conversations under kills every 5 s wrote
#: 11 in 3 minutes (2026-12-02, load average 15-19), so "until 70% written" alone would not end.
KILL_PHASE_S = 60.0
PREFIX = 28  # the rid's characters that name the (sample, turn); the last 4 count attempts


def conv_ids(n: int) -> list[str]:
    """The ids demo.synthetic.write_conversations gives its n conversations."""
    return [f"c{c:05d}" for c in range(n)]


def server_log(path: Path) -> dict[str, list[tuple[int, list[int]]]]:
    """rid prefix (one (sample, turn)) -> [(log line, output_ids), ...] in the order the server answered."""
    out: dict[str, list[tuple[int, list[int]]]] = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text().split("\n")[:-1], 1):  # a torn last line is left out
        entry = json.loads(line)
        out.setdefault(entry["rid"][:PREFIX], []).append((n, list(entry["output_ids"])))
    return out


def turn_audit(res: Result, st: ChaosStack, out: Path, log: Path, n: int) -> dict[str, Any]:
    """The per-turn checks of the module docstring; adds them to ``res`` and returns the figures."""
    r = st.client()
    recs = read_jsonl(out / DATASET / "raw_responses.jsonl")
    used = int(r.get(KEYS.used) or 0)
    unwritten = sum(int(v) for v in r.hvals(KEYS.turns))
    file_tokens = sum(int(x["completion_tokens"]) for x in recs)
    stats_turns = int(r.hget(KEYS.stats, "turns") or 0)
    unwritten_turns = int(r.hlen(KEYS.turns))
    stranded = texts(r.hkeys(KEYS.convs))
    disk_turns = sum(len(x.get("turns") or []) for x in recs)
    bad_sums = [x["id"] for x in recs if int(x["completion_tokens"]) != sum(int(t["completion_tokens"])
                                                                             for t in x.get("turns") or [])]
    too_many = [x["id"] for x in recs if len(x.get("turns") or []) > TURNS]
    answers = server_log(log)
    regenerated, redone, missing, beyond = [], 0, [], 0
    per_turn: Counter[int] = Counter()
    for x in recs:
        turns = x.get("turns") or []
        for i in range(TURNS):
            got = answers.get(request_id(DATASET, turn_request_key(str(x["id"]), i), 0)[:PREFIX], [])
            per_turn[len(got)] += 1
            if i >= len(turns):
                beyond += len(got)  # answered, never committed: the conversation ended before (budget form)
                continue
            at = [k for k, (_, ids) in enumerate(got) if ids == turns[i].get("output_ids")]
            if not at:
                missing.append((x["id"], i))
                continue
            redone += at[0]
            if len(got) > at[0] + 1:
                regenerated.append((x["id"], i, len(got) - at[0] - 1))
    stopped = Counter(str(x.get("stopped_by")) for x in recs)
    figures = {
        "conversations": n, "turns_on_disk": disk_turns, "stats_turns": stats_turns,
        "redis_used": used, "unwritten_turn_tokens": unwritten, "turn_drift": used - file_tokens - unwritten,
        "open_conversations": int(r.hlen(KEYS.convs)),
        "log_answers": sum(len(v) for v in answers.values()), "answers_per_turn": dict(sorted(per_turn.items())),
        "committed_turns_regenerated": len(regenerated), "answered_not_committed_then_redone": redone,
        "answered_after_the_conversation_ended": beyond, "committed_turns_missing_from_log": len(missing),
        "turns_counted_twice": stats_turns - disk_turns - unwritten_turns, "unwritten_turns": unwritten_turns,
        "conversations_with_committed_turns_not_written": len(stranded), "stopped_by": dict(stopped),
    }
    res.figures.update(figures)
    res.check("drift 0: used = Σ file + Σ unwritten turns", figures["turn_drift"] == 0,
              f"used {used}, file {file_tokens}, unwritten {unwritten}")
    res.check("each record's completion_tokens = Σ its turns", not bad_sums, bad_sums[:5])
    res.check("0 turns counted twice (stats.turns = turns on disk + turns still in Redis, none beyond the plan)",
              stats_turns == disk_turns + unwritten_turns and not too_many,
              f"stats {stats_turns}, disk {disk_turns}, in Redis {unwritten_turns}, {too_many[:5]}")
    res.check("0 lost turns: no committed turn left unwritten when produce exits", not stranded and not unwritten,
              f"{len(stranded)} conversations ({unwritten_turns} turns, {unwritten} tokens) still in Redis, "
              f"e.g. {stranded[:5]}")
    res.check("0 committed turns regenerated (server's log)", not regenerated, regenerated[:5])
    res.check("every committed turn is in the server's log", not missing, missing[:5])
    return figures


#: Workers and chunk size here: a chunk that loses its worker 3 times fails its samples (producer/session/loop.py), and
#: with 2 workers killed in turn every 5 s on the loaded 2-core machine each lived ~10 s, about a chunk of
#: 3-turn conversations' time: every chunk failed (ci form, 2026-12-02: 140 of 140). 4 workers live ~20 s each.
WORKERS, CHUNK = 4, 10


def _kill_run(ctx: Ctx, scenario: str, budget_share: float | None) -> Result:
    ctx = replace(ctx, scale=replace(ctx.scale, workers=max(WORKERS, ctx.scale.workers),
                                     chunk=min(CHUNK, ctx.scale.chunk)))
    s = ctx.scale
    res = Result(scenario, s.name)
    n = CONVERSATIONS[s.name]
    data = ctx.workdir / f"convs-{n}.jsonl"
    if not data.exists():
        write_conversations(data, n)
    tag = scenario
    with ctx.stack(tag, sim_extra=["--request-log", str(ctx.workdir / tag / "requests.jsonl")]) as st:
        log = st.workdir / "requests.jsonl"
        r = st.client()
        watch = Watch(st.redis_url)
        watch.start()
        extra = ["--turns", "all", "--reasoning-parser", PARSER, "--max-context", "65536"]
        budget = None
        if budget_share is not None:  # the mean answer x the turns, x the share: the close lands mid-run
            mean = float(s.sim[s.sim.index("--mean-tokens") + 1])
            budget = int(budget_share * n * TURNS * mean)
            extra += ["--budget", str(budget), "--budget-mode", "predict"]
        prod = Produce(st.workdir, "1", produce_argv(s, data, ctx.tokenizer, st.workdir / "out", st.redis_url,
                                                     *extra))
        # Kills start once conversations are between turns. With a budget, predict reserves max_new_tokens per
        # request until its model has lengths (docs/budget.md, "Before the first lengths"), so fewer than half the
        # window may ever be admitted at once: one conversation between turns is enough there.
        between = s.in_flight // 2 if budget is None else 1
        wait_until(lambda: r.hlen(KEYS.convs) >= between, 120, "conversations between turns")
        names = list(st.by_name)
        kills, kills_after_close, t_last = 0, 0, 0.0
        loads = [os.getloadavg()[0]]
        t_first = time.monotonic()
        t_closed: float | None = None

        def going() -> bool:
            if prod.proc.poll() is not None:
                return False
            now = time.monotonic()
            if budget is not None:  # through the close: until KILL_PHASE_S after it (at most 3 x KILL_PHASE_S)
                nonlocal t_closed
                if t_closed is None and r.hget(KEYS.meta, "status") != b"open":
                    t_closed = now
                return now - t_first < 3 * KILL_PHASE_S and (t_closed is None or now - t_closed < KILL_PHASE_S)
            return now - t_first < KILL_PHASE_S and r.hlen(KEYS.done) < 0.7 * n

        while going():
            slot = kills % len(names)
            victim = st.by_name[names[slot]]
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            t_last = time.monotonic()
            kills += 1
            kills_after_close += r.hget(KEYS.meta, "status") == b"closed"
            names[slot] = f"w{slot}-k{kills}"  # rq refuses the dead worker's name for a while
            st.add_worker(names[slot])
            loads.append(os.getloadavg()[0])
            time.sleep(s.kill_every)
        rc = prod.finish(st, 240 + n / 5, res=res)
        watch.stop()
        t_end = time.monotonic()
        # With a budget, a conversation never sent, or whose first turn was never committed, is not lost: the
        # audit's ids are those with a committed turn (on disk, or still in Redis' convs: stranded).
        on_disk = {str(x["id"]) for x in read_jsonl(st.workdir / "out" / DATASET / "raw_responses.jsonl")}
        ids = conv_ids(n) if budget is None else sorted(on_disk | set(texts(r.hkeys(KEYS.convs))))
        figures = audit(res, st, st.workdir / "out", ids, log_files(st.workdir))
        turn_audit(res, st, st.workdir / "out", log, n)
        res.figures.pop("wasted", None)  # audit's is per sample; per turn below
        res.figures.update(
            kills=kills, kills_after_close=kills_after_close, reclaimed_chunks=prod.stderr.count("lost its worker"),
            budget=budget, recovery_s=_r(t_end - t_last if t_last else None), run_s=_r(t_end - prod.started),
            wasted_answers=res.figures["log_answers"] - res.figures["turns_on_disk"],
            loadavg_1min_during=[round(x, 2) for x in (min(loads), max(loads))])
        res.check("produce exit 0", rc == 0, f"rc {rc}: {prod.stderr[-300:]}")
        res.check("kills happened", kills >= 2, kills)
        if budget is None:
            res.check("every conversation ran (no budget stop)", "budget" not in res.figures["stopped_by"],
                      res.figures["stopped_by"])
        del figures
    return res


def worker_kill_turns(ctx: Ctx) -> Result:
    """kill -9 a worker every kill_every seconds (round robin, replaced at once) until 70% of the
    conversations are written, no budget."""
    return _kill_run(ctx, "worker-kill-turns", None)


def worker_kill_turns_budget(ctx: Ctx) -> Result:
    """The same with a budget of 30% of the run (predict): the dataset closes mid-run and the kills go on, so some
    conversations lose their worker after the close and are ended by produce with stopped_by budget."""
    return _kill_run(ctx, "worker-kill-turns-budget", 0.3)
