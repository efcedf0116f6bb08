"""Chaos scenarios on SGLang (the simulator's fault injection, driven live through /sim/faults): errors, 429
with Retry-After, resets, hangs past the client timeout, 400s, a full outage; and malformed bodies.

The workers talk to the simulator through tests/chaos/recorder.py, whose per-request log (rid, arrival, answer,
status, Retry-After) shows what the server cannot: when each sample was retried."""
from __future__ import annotations

import re
import time
from collections import Counter, defaultdict
from typing import Any

from demo.appending import read_jsonl
from demo.stack import wait_until
from tests.chaos.audit import DATASET, Result, audit, log_files, sample_ids
from tests.chaos.audit import rounded as _r
from tests.chaos.run import KEYS, Ctx

RETRY_AFTER = 2.0
SETTLE_S = 6.0  # after the mixed faults, before the outage: backoffs run out, the rate is steady again
#: Mixed faults while they last: fractions of /generate requests.
FAULTS: dict[str, Any] = {"error_rates": {"503": 0.05, "429": 0.05, "500": 0.05, "400": 0.005},
                          "retry_after": RETRY_AFTER, "reset_rate": 0.03, "hang_rate": 0.04}


def sglang_faults(ctx: Ctx) -> Result:
    """Mixed faults for a while (FAULTS), a few steady seconds, then a full outage; every request logged by the
    recorder. Checks Retry-After, 400s, hangs, the request rate during the outage and the recovery after it."""
    s = ctx.scale
    res = Result("sglang-faults", s.name)
    timeout = s.request_s + 2  # longer than any healthy request, so only hangs time out
    env = {"BUDGETQ_REQUEST_TIMEOUT": str(timeout)}
    with ctx.stack("sglang-faults", recorder=True, env=env, sim_extra=("--retry-after", str(RETRY_AFTER))) as st:
        r = st.client()
        n = s.faults_prompts
        prod = ctx.produce(st, "1", data=ctx.prompts(n))
        wait_until(lambda: r.hlen(KEYS.done) >= n // 10, 120, "10% committed")
        t_faults = time.time()
        st.set_faults(FAULTS)
        time.sleep(s.fault_s)
        st.set_faults({"clear": True, "retry_after": RETRY_AFTER})
        t_clear = time.time()
        res.check("work was left after the fault phase", r.hlen(KEYS.done) < n, "the run ended too soon")
        if s.outage_s:
            time.sleep(SETTLE_S)  # steady again: the rate "just before" the outage
            t_out = time.time()
            st.set_faults({"outage_for": s.outage_s})
            time.sleep(s.outage_s)
            t_back = time.time()
            left = n - r.hlen(KEYS.done)
        rc = prod.finish(st, 300 + n / 10, res=res)
        log = st.recorder_log()
        stats = st.sim_stats()
        res.check("produce exit 0", rc == 0, f"rc {rc}: {prod.stderr[-300:]}")
        audit(res, st, st.workdir / "out", sample_ids(n), log_files(st.workdir), failures_allowed=r"^400: ")
        failed = read_jsonl(st.workdir / "out" / DATASET / "failed.jsonl")
        res.check("failed samples are the injected 400s", all(f.get("status") == 400 for f in failed),
                  [f for f in failed if f.get("status") != 400][:3])
        _retry_checks(res, log, timeout)
        res.figures.update(
            fault_s=s.fault_s, request_timeout_s=timeout,
            injected={k: v for k, v in stats.items() if k in ("injected_errors", "resets", "hangs")},
            fault_phase_requests=sum(1 for e in log if t_faults <= e["t0"] < t_clear))
        res.check("hangs were injected and timed out", stats["hangs"] > 0 and res.figures["timeouts"] > 0,
                  f"{stats['hangs']} hangs, {res.figures['timeouts']} client timeouts")
        if s.outage_s:
            _outage_checks(res, log, stats, t_out, t_back, left)
    return res


def _outage_checks(res: Result, log: list[dict[str, Any]], stats: dict[str, Any], t_out: float, t_back: float,
                   left: int) -> None:
    before = _rate(log, t_out - 5, t_out)
    during = _rate(log, t_out + 1, t_back)
    ok_before = _rate(log, t_out - 5, t_out, ok_only=True)
    recovery = _back_after(log, t_back, 0.8 * ok_before)
    res.figures.update(
        outage_s=round(t_back - t_out, 1), outage_rejected=stats["outage_rejected"], outage_cut=stats["outage_cut"],
        samples_left_after_outage=left, requests_per_s_before_outage=round(before, 1),
        requests_per_s_during_outage=round(during, 2), ok_per_s_before_outage=round(ok_before, 1),
        recovery_s=_r(recovery))
    res.check("requests during the outage < 20% of the rate before", during < 0.2 * before,
              f"{during:.2f}/s vs {before:.1f}/s")
    res.check("throughput back (80% of before) within 30 s of the outage's end",
              recovery is not None and recovery <= 30, f"{_r(recovery)} s")


def _retry_checks(res: Result, log: list[dict[str, Any]], timeout: float) -> None:
    """Per sample (the rid without its 4-digit attempt number): no request before the previous answer's
    Retry-After, and none after a final 400."""
    by_sample: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in log:
        if e.get("rid"):
            by_sample[e["rid"][:-4]].append(e)
    early, after_400, waits = [], [], []
    for reqs in by_sample.values():
        reqs.sort(key=lambda e: e["t0"])
        for a, b in zip(reqs, reqs[1:], strict=False):
            if a.get("retry_after") and a.get("status") in (429, 503):
                gap = b["t0"] - a["t1"]
                waits.append(gap)
                if gap < a["retry_after"] - 0.01:
                    early.append(round(gap, 3))
            if a.get("status") == 400 and "Duplicate request ID" not in a.get("message", ""):
                after_400.append(a["rid"])
    timeouts = [e for e in log if e.get("outcome") == "client gave up"]
    res.figures.update(retry_after_answers=len(waits), shortest_wait_after_retry_after_s=_r(min(waits, default=None)),
                       final_400s=sum(1 for e in log if e.get("status") == 400), timeouts=len(timeouts),
                       resets_seen=sum(1 for e in log if str(e.get("outcome", "")).startswith("upstream")))
    res.check("no retry before Retry-After", bool(waits) and not early,
              f"{len(early)} early of {len(waits)}: {early[:5]}")
    res.check("400s never retried", not after_400, f"{len(after_400)} retried: {after_400[:3]}")
    res.check("timeouts only for hangs (after the client timeout)",
              all(e["t1"] - e["t0"] >= timeout - 0.5 for e in timeouts),
              [round(e["t1"] - e["t0"], 2) for e in timeouts if e["t1"] - e["t0"] < timeout - 0.5][:5])


def _rate(log: list[dict[str, Any]], a: float, b: float, ok_only: bool = False) -> float:
    n = sum(1 for e in log if a <= e["t0"] < b and (not ok_only or e.get("status") == 200))
    return n / max(b - a, 1e-9)


def _back_after(log: list[dict[str, Any]], t: float, target: float, window: float = 3.0) -> float | None:
    """Seconds after t until the rate of successful answers over a sliding window reaches target."""
    ends = sorted(e["t1"] for e in log if e.get("status") == 200 and e["t1"] >= t)
    j = 0
    for i, end in enumerate(ends):
        while ends[j] < end - window:
            j += 1
        if (i - j + 1) / window >= target:
            return float(end - t)
    return None


def malformed(ctx: Ctx) -> Result:
    """Half the answers break the contract (every kind the simulator has): nothing invalid is written or
    counted; a sample that got only broken answers ends failed with the reason."""
    s = ctx.scale
    res = Result("malformed", s.name)
    with ctx.stack("malformed", sim_extra=("--malformed-rate", "0.5")) as st:
        prod = ctx.produce(st, "1")
        rc = prod.finish(st, 300 + s.prompts / 10, res=res)
        res.check("produce exit 0", rc == 0, f"rc {rc}: {prod.stderr[-300:]}")
        audit(res, st, st.workdir / "out", sample_ids(s.prompts), log_files(st.workdir),
              failures_allowed=r"malformed response")
        recs = read_jsonl(st.workdir / "out" / DATASET / "raw_responses.jsonl")
        bad = [x["id"] for x in recs if not _valid(x, s.max_tokens)]
        res.check("every record is valid (types, ranges, text matches its token count)", not bad, bad[:5])
        failed = read_jsonl(st.workdir / "out" / DATASET / "failed.jsonl")
        done = st.client().hgetall(KEYS.done)
        res.check("failed samples were never counted",
                  not [f for f in failed if f["id"].encode() in done], "a failed sample is in done")
        stats = st.sim_stats()
        reasons = Counter(re.sub(r"'?-?\d+'?", "N", f["reason"]) for f in failed)
        res.figures.update(malformed_by_kind=stats["malformed"], malformed_answers=sum(stats["malformed"].values()),
                           failed_reasons=dict(reasons.most_common()))
        res.check("every malformed kind was injected", len(stats["malformed"]) >= 8, stats["malformed"])
    return res


def _valid(rec: dict[str, Any], max_tokens: int) -> bool:
    """The simulator's own invariant: its text has one word per token, the EOS of a stopped answer excepted."""
    x = rec["turns"][0]
    n = x.get("completion_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= max_tokens:
        return False
    if x.get("finish_reason") not in ("stop", "length") or not isinstance(x.get("response"), str):
        return False
    if not isinstance(x.get("prompt_tokens"), int) or x["prompt_tokens"] <= 0:
        return False
    return len(x["response"].split()) == n - (1 if x["finish_reason"] == "stop" else 0)
