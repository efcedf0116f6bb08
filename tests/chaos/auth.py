"""Chaos scenario: workers started with a wrong SGLANG_API_KEY against a server that requires one.

What a deployment gets wrong on day one (a key rotated on the server, a typo in the .env file). Each wrong-key
worker is restarted whenever it exits, as a supervisor does (compose ``restart: unless-stopped``), for
FAULT_S; then workers with the right key join and must finish the run with every sample exactly once. The
figures: requests the server refused (401), worker starts and their exit codes, samples failed (must be 0),
tokens counted while the key was wrong (must be 0)."""
from __future__ import annotations

import time

from tests.chaos.audit import Result, audit, log_files, sample_ids
from tests.chaos.run import KEYS, Ctx

KEY, WRONG = "sk-chaos-right-4d1f", "sk-chaos-wrong-70aa"
FAULT_S = 20.0
EXIT_CONFIG = 78  # worker/rqworker.py
LINE = "refused this worker's credentials"


def wrong_key(ctx: Ctx) -> Result:
    s = ctx.scale
    res = Result("wrong-key", s.name)
    with ctx.stack("wrong-key", sim_extra=("--api-key", KEY), env={"SGLANG_API_KEY": WRONG}) as st:
        r = st.client()
        prod = ctx.produce(st, "1")
        names = [f"w{i}" for i in range(s.workers)]
        starts = {name: 1 for name in names}
        codes: list[int | None] = []
        t0 = time.monotonic()
        live = dict(st.by_name)
        while live:
            for name, proc in list(live.items()):
                if proc.poll() is None:
                    continue
                codes.append(proc.returncode)
                if time.monotonic() - t0 < FAULT_S:
                    live[name] = st.add_worker(f"{name}-r{starts[name]}")  # the supervisor restarts it
                    starts[name] += 1
                else:
                    del live[name]
            if time.monotonic() - t0 > FAULT_S + 120:
                res.check("every wrong-key worker exited", False, f"{len(live)} still running")
                break
            time.sleep(0.05)  # polling other processes' exits: there is no event to await across them
        fault_s = time.monotonic() - t0
        refused = st.sim_stats()["unauthorized"]
        failed_during = int(r.hlen(KEYS.failed))
        used_during = int(r.get(KEYS.used) or 0)
        logs = "".join(p.read_text(errors="replace") for p in st.workdir.glob("w*.log"))
        res.check("samples failed while the key was wrong = 0", failed_during == 0, failed_during)
        res.check("tokens counted while the key was wrong = 0", used_during == 0, used_during)
        res.check(f"every wrong-key worker exited with {EXIT_CONFIG}", all(c == EXIT_CONFIG for c in codes), codes)
        res.check("one error line per wrong-key worker start", logs.count(LINE) == len(codes),
                  f"{logs.count(LINE)} lines for {len(codes)} starts")
        res.check("the key is never logged", WRONG not in logs and KEY not in logs)
        res.check("produce still running", prod.proc.poll() is None, prod.stderr[-300:])

        t_right = time.monotonic()
        for i in range(s.workers):
            st.add_worker(f"right{i}", env={"SGLANG_API_KEY": KEY})
        rc = prod.finish(st, 300 + s.prompts / 10, res=res)
        res.check("produce exit 0", rc == 0, f"rc {rc}: {prod.stderr[-300:]}")
        audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir))
        res.check("no request refused once the key was right", st.sim_stats()["unauthorized"] == refused,
                  st.sim_stats()["unauthorized"] - refused)
        res.figures.update(
            fault_s=round(fault_s, 1), wrong_key_worker_starts=len(codes), exit_codes=sorted(set(codes), key=str),
            requests_refused=refused, samples_failed_during_fault=failed_during,
            tokens_counted_during_fault=used_during,
            finish_after_right_key_s=round((prod.ended or time.monotonic()) - t_right, 1))
    return res
