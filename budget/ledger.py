"""Typed Python calls for the budget scripts: the only way the rest of budgetq changes budget state.

The ledger is policy-free mechanism: it answers "is this sample admitted", "was this commit new", "did this
commit close the dataset" (the answers' types: budget/outcomes.py). Workers and the producer decide what to do with
the answers. How a worker sends many calls in one round trip is budget/pipeline.py's.
"""
from __future__ import annotations

import functools
import json
from typing import Any, Sequence

import orjson
import redis
from redis.commands.core import Script

from budget import keys, scripts
from budget.outcomes import (
    Admission,
    CommitOutcome,
    DatasetState,
    EndOutcome,
    LengthSample,
    TurnAdmission,
    TurnOutcome,
    parse_admissions,
    parse_commit,
    parse_end,
    parse_length_sample,
    parse_turn_admission,
    parse_turn_commit,
    text,
)
from budget.pipeline import Call, run

#: How long a running chunk's lease lasts without a refresh. Workers refresh every LEASE_MS / 4, so a lease
#: expires only when its worker stopped refreshing (killed, frozen, cut off from Redis) for this long.
LEASE_MS = 20_000

#: How long a discarded (canceled) chunk stays visible in rq-dashboard before its job hash expires.
DISCARDED_TTL_S = 7 * 24 * 3600
#: Discarded jobs marked canceled per mark_discarded call: ~25 ms of Redis time each on the 2-core bench machine.
MARK_BATCH = 1000


MODES = ("drain", "predict", "strict")

#: The errors that mean "Redis is not answering right now" (as opposed to a refused command): worth waiting out.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def default_prior_mean(max_new_tokens: int) -> float:
    """The producer's guess of a completion's length before a dataset has results or an --expect-mean, for sizing
    what it enqueues just in time (producer/session/loop.py): a quarter of the cap, at most 1024. Short is safe
    there (it enqueues more). Predict does not price with it: it was 3.7x short of the reference lengths, and the
    first waves of a small budget overshot by it; an uninformed worker model reserves max_new_tokens until it has
    seen lengths (worker/estimate.py MIN_OBSERVED, docs/budget.md "Before the first lengths")."""
    return min(max_new_tokens / 4, 1024.0)


class Ledger:
    """Budget state of every dataset in one Redis database. Pass it the client; it registers the scripts.

    Each script has a plain method (``commit``: sent at once, for tests and the producer) and a ``*_call`` form
    (``commit_call``: a budget/pipeline.py ``Call``, for the worker, whose batcher sends many in one round trip)."""

    def __init__(self, client: "redis.Redis") -> None:
        self.r = client
        self._set_budget = client.register_script(scripts.SET_BUDGET)
        self._start = client.register_script(scripts.START_CHUNK)
        self._finish = client.register_script(scripts.FINISH_CHUNK)
        self._refresh = client.register_script(scripts.REFRESH_CHUNK)
        self._job_meta = client.register_script(scripts.JOB_META)
        self._length_sample = client.register_script(scripts.LENGTH_SAMPLE)
        self._admit = client.register_script(scripts.ADMIT)
        self._commit = client.register_script(scripts.COMMIT)
        self._fail = client.register_script(scripts.FAIL)
        self._discard = client.register_script(scripts.DISCARD)
        self._mark_discarded = client.register_script(scripts.MARK_DISCARDED)
        self._reclaim = client.register_script(scripts.RECLAIM)
        self._reclaim_queued = client.register_script(scripts.RECLAIM_QUEUED)
        self._reconcile = client.register_script(scripts.RECONCILE)
        self._uncommit = client.register_script(scripts.UNCOMMIT)
        self._close = client.register_script(scripts.CLOSE)

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def _keys(name: str) -> keys.DatasetKeys:
        return keys.DatasetKeys(name)

    # -- the producer's side -------------------------------------------------------------------------
    def set_budget(self, name: str, budget: int | None) -> str:
        k = keys.DatasetKeys(name)
        status, _used = self._set_budget(keys=[k.meta, k.used], args=["" if budget is None else budget])
        return text(status)

    def reconcile(self, name: str, records: Sequence[tuple[str, int]], batch: int = 2000) -> tuple[int, int]:
        """Count on-disk responses Redis does not know. Returns (samples added, tokens added)."""
        k = keys.DatasetKeys(name)
        added = tokens = 0
        for i in range(0, len(records), batch):
            args: list[Any] = []
            for sid, n in records[i:i + batch]:
                args += [sid, n]
            a, t, _ = self._reconcile(keys=[k.meta, k.used, k.done], args=args)
            added += int(a)
            tokens += int(t)
        return added, tokens

    def uncommit(self, name: str, ids: Sequence[str]) -> tuple[int, int]:
        k = keys.DatasetKeys(name)
        if not ids:
            return 0, 0
        removed, tokens, _ = self._uncommit(keys=[k.meta, k.used, k.done], args=list(ids))
        return int(removed), int(tokens)

    def set_mode(self, name: str, mode: str, max_new_tokens: int) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown budget mode {mode!r} (expected one of {', '.join(MODES)})")
        self.r.hset(keys.DatasetKeys(name).meta, mapping={"mode": mode, "max_new_tokens": max_new_tokens})

    def set_deadline(self, name: str, deadline_ms: int | None) -> None:
        """Set (or, None, remove) the time, unix ms, by which the dataset's requests must end (docs/mix.md)."""
        meta = keys.DatasetKeys(name).meta
        if deadline_ms is None:
            self.r.hdel(meta, "deadline")
        else:
            self.r.hset(meta, "deadline", int(deadline_ms))

    def set_prior(self, name: str, mean_tokens: float) -> None:
        """The expected completion length before the dataset has results of its own (predict mode)."""
        self.r.hset(keys.DatasetKeys(name).meta, "prior_mean", str(round(mean_tokens, 1)))

    def reclaim(self, name: str) -> list[str]:
        k = keys.DatasetKeys(name)
        return [text(x) for x in self._reclaim(keys=[k.chunks, k.resv, k.inflight, k.progress])]

    def reclaim_queued(self, name: str, overdue: Sequence[str] = ()) -> tuple[list[str], list[str]]:
        """Take back the dataset's queued chunks whose RQ job is gone or ended without starting them, and those
        of ``overdue`` a worker popped long ago and still has not started; one script, so a chunk a worker
        starts meanwhile is never taken (budget/scripts.py RECLAIM_QUEUED). Returns (reclaimed chunk ids, ids
        still queued whose job a worker has popped: the caller times them and passes them back as overdue)."""
        k = keys.DatasetKeys(name)
        stale, popped = self._reclaim_queued(keys=[k.chunks, keys.RQ_INTERMEDIATE], args=[keys.RQ_JOB_PREFIX, *overdue])
        return [text(x) for x in stale], [text(x) for x in popped]

    def discard(self, name: str, reason: str, keep_s: int = DISCARDED_TTL_S, mark_batch: int = MARK_BATCH) -> int:
        """Take a closed dataset's queued chunks out of the queue (one script: from its return no worker can
        start them), then mark their RQ jobs canceled ``mark_batch`` at a time, so Redis serves the workers'
        commits between the calls. Idempotent: run again, it finishes marking what an interrupted call left.
        Returns how many chunks this call took out of the queue."""
        k = keys.DatasetKeys(name)
        n = int(self._discard(keys=[k.meta, k.chunks, keys.RQ_QUEUE, k.discarded]))
        while int(self._mark_discarded(keys=[k.discarded, keys.RQ_CANCELED],
                                       args=[keys.RQ_JOB_PREFIX, reason, keep_s, mark_batch])) > 0:
            pass
        return n

    def close(self, name: str) -> bool:
        """Close the dataset whatever its budget (--new-run starts it over). Returns True if it was open."""
        return bool(self._close(keys=[keys.DatasetKeys(name).meta]))

    # -- the worker's side ---------------------------------------------------------------------------
    def start_chunk(self, name: str, chunk: str, lease_ms: int = LEASE_MS) -> str:
        return run(self.start_chunk_call(name, chunk, lease_ms))

    def start_chunk_call(self, name: str, chunk: str, lease_ms: int = LEASE_MS) -> Call[str]:
        k = self._keys(name)
        return Call(self._start, [k.meta, k.chunks, k.resv, k.inflight], [chunk, lease_ms], text)

    def refresh_chunk(self, name: str, chunk: str, lease_ms: int = LEASE_MS, reserved: int | None = None,
                      progress: list[int] | None = None) -> bool:
        return run(self.refresh_chunk_call(name, chunk, lease_ms, reserved, progress))

    def refresh_chunk_call(self, name: str, chunk: str, lease_ms: int = LEASE_MS, reserved: int | None = None,
                           progress: list[int] | None = None,
                           turn_progress: Sequence[Sequence[int]] | None = None) -> Call[bool]:
        """Extend ``chunk``'s lease; in predict, restate what it reserves and how far its requests have got:
        ``progress`` its one-turn requests', ``turn_progress`` its conversations' running turns by turn bucket
        (predict's per-turn models count them as "at least this long")."""
        k = self._keys(name)
        extra = [json.dumps(list(p)) for p in turn_progress] if progress is not None and turn_progress else []
        return Call(self._refresh, [k.chunks, k.resv, k.progress],
                    [chunk, lease_ms, "" if reserved is None else int(reserved),
                     "" if progress is None else json.dumps(progress), *extra], bool)

    def finish_chunk(self, name: str, chunk: str, request_ms: int = 0, server_ms: int = 0) -> None:
        run(self.finish_chunk_call(name, chunk, request_ms, server_ms))

    def finish_chunk_call(self, name: str, chunk: str, request_ms: int = 0, server_ms: int = 0) -> Call[bool]:
        """End a chunk. ``request_ms``: the time its requests ran, summed; ``server_ms``: their share of the
        servers' busy time (the GPU time they cost, docs/mix.md); each added to the dataset's stats once."""
        k = self._keys(name)
        return Call(self._finish, [k.chunks, k.resv, k.inflight, k.progress, k.stats],
                    [chunk, max(0, int(request_ms)), max(0, int(server_ms))], bool)

    def job_meta_call(self, job_id: str, meta: str | bytes) -> Call[bool]:
        """Write a chunk's progress into its RQ job's meta, if the job hash still exists (budget/scripts.py)."""
        return Call(self._job_meta, [keys.rq_job_key(job_id)], [meta], bool)

    def admit(self, name: str, sample: str, chunk: str, expected: int = 0, margin: float = 0.0,
              taper: float = 0.0, duration_ms: int = 0) -> Admission:
        return run(self.admit_call(name, [sample], chunk, expected, margin, taper, duration_ms))[0]

    def admit_call(self, name: str, samples: Sequence[str], chunk: str, expected: int = 0,
                   margin: float = 0.0, taper: float = 0.0, duration_ms: int = 0) -> Call[list[Admission]]:
        """Admit ``samples`` of ``chunk`` in order, in one script run: one verdict per sample. Those after
        the first refusal that stops the chunk (closed, revoked, full) get that refusal too. ``duration_ms``: how
        long a request is expected to take; one that could not end by the dataset's deadline closes it."""
        if isinstance(samples, str):
            raise TypeError("admit_call takes a list of sample ids")
        k = self._keys(name)
        n = len(samples)
        return Call(self._admit, [k.meta, k.chunks, k.pending, k.done, k.used, k.resv, k.inflight],
                    [chunk, int(expected), round(margin, 1), round(taper, 1), max(0, int(duration_ms)), *samples],
                    lambda reply: parse_admissions(reply, n))

    def commit(self, name: str, sample: str, completion_tokens: int, result: dict[str, Any], *,
               chunk: str = "", reserved: int = 0, finish_reason: str | None = None) -> CommitOutcome:
        return run(self.commit_call(name, sample, completion_tokens, result, chunk=chunk, reserved=reserved,
                                         finish_reason=finish_reason))

    def commit_call(self, name: str, sample: str, completion_tokens: int, result: dict[str, Any], *,
                    chunk: str = "", reserved: int = 0, finish_reason: str | None = None) -> Call[CommitOutcome]:
        k = self._keys(name)
        body = orjson.dumps(result)  # compact UTF-8, as json.dumps(ensure_ascii=False) but ~10x faster
        reason = finish_reason or str(result.get("finish_reason", "unknown"))
        return Call(self._commit,
                    [k.meta, k.used, k.done, k.pending, k.results, k.failed, k.resv, k.inflight, k.lengths, k.stats],
                    [sample, completion_tokens, body, chunk, reserved, reason], parse_commit, merge=4)

    def fail(self, name: str, sample: str, chunk: str, reason: dict[str, Any], reserved: int = 0) -> bool:
        return run(self.fail_call(name, sample, chunk, reason, reserved))

    def fail_call(self, name: str, sample: str, chunk: str, reason: dict[str, Any],
                  reserved: int = 0) -> Call[bool]:
        k = self._keys(name)
        return Call(self._fail, [k.done, k.pending, k.failed, k.resv, k.inflight],
                    [sample, chunk, json.dumps(reason, ensure_ascii=False), reserved], bool)

    # -- multi-turn conversations (docs/multiturn.md; worker/turns.py and producer/session/loop.py call them) --------
    @functools.cached_property
    def _commit_turn(self) -> Script:
        # Registered on first use, not in __init__: single-turn runs never load it.
        return self.r.register_script(scripts.COMMIT_TURN)

    def commit_turn(self, name: str, sample: str, turn: int, completion_tokens: int, record: dict[str, Any], *,
                    chunk: str = "", reserved: int = 0, finish_reason: str | None = None) -> TurnOutcome:
        return run(self.commit_turn_call(name, sample, turn, completion_tokens, record, chunk=chunk,
                                              reserved=reserved, finish_reason=finish_reason))

    def commit_turn_call(self, name: str, sample: str, turn: int, completion_tokens: int, record: dict[str, Any],
                         *, chunk: str = "", reserved: int = 0,
                         finish_reason: str | None = None) -> Call[TurnOutcome]:
        """Commit the ``turn``-th turn (0-based) of conversation ``sample`` once: a resend, an RQ retry or a
        zombie's copy is a DUPLICATE and changes nothing; a turn that is not the conversation's next is
        OUT_OF_ORDER. The turn's tokens count in ``used`` at once; its record stays in Redis until the
        conversation is written. Merges with other commit_turn calls of the dataset in ``run_many``."""
        keys.turn_field(sample, turn)  # refuses a turn index that is not an int >= 0
        if isinstance(completion_tokens, bool) or not isinstance(completion_tokens, int) or completion_tokens < 0:
            raise ValueError(f"completion_tokens is an int >= 0, not {completion_tokens!r}")
        k = self._keys(name)
        reason = finish_reason or str(record.get("finish_reason", "unknown"))
        return Call(self._commit_turn,
                    [k.meta, k.used, k.done, k.turns, k.turnrec, k.convs, k.resv, k.inflight, k.lengths, k.stats,
                     *k.turn_lengths],
                    [sample, turn, completion_tokens, orjson.dumps(record), chunk, reserved, reason],
                    parse_turn_commit, merge=4)

    @functools.cached_property
    def _admit_turn(self) -> Script:
        return self.r.register_script(scripts.ADMIT_TURN)

    @functools.cached_property
    def _end_conversation(self) -> Script:
        return self.r.register_script(scripts.END_CONVERSATION)

    @functools.cached_property
    def _reconcile_turns(self) -> Script:
        return self.r.register_script(scripts.RECONCILE_TURNS)

    @functools.cached_property
    def _reopen(self) -> Script:
        return self.r.register_script(scripts.REOPEN)

    def admit_turn(self, name: str, sample: str, turn: int, chunk: str, reservation: int = 0,
                   duration_ms: int = 0) -> TurnAdmission:
        return run(self.admit_turn_call(name, sample, turn, chunk, reservation, duration_ms))

    def admit_turn_call(self, name: str, sample: str, turn: int, chunk: str,
                        reservation: int = 0, duration_ms: int = 0) -> Call[TurnAdmission]:
        """May turn ``turn`` (>= 1) of conversation ``sample``, held by ``chunk``, start now? Started ones go on
        while the dataset is closed (drain, predict; strict while the turn fits); ``reservation`` is what the
        turn reserves in predict mode. A START is settled by the turn's commit_turn (pass it its ``reserved``).
        ``duration_ms`` as for ``admit_call``: a turn that could not end by the deadline stops the conversation."""
        keys.turn_field(sample, turn)
        if turn < 1:
            raise ValueError("admit_turn admits turns >= 1; turn 0 is a new conversation: admit")
        k = self._keys(name)
        return Call(self._admit_turn, [k.meta, k.chunks, k.pending, k.done, k.convs, k.used, k.resv, k.inflight],
                    [chunk, sample, turn, int(reservation), max(0, int(duration_ms))], parse_turn_admission)

    def end_conversation(self, name: str, sample: str, turns: int, header: dict[str, Any],
                         planned: int = 0) -> EndOutcome:
        return run(self.end_conversation_call(name, sample, turns, header, planned))

    def end_conversation_call(self, name: str, sample: str, turns: int, header: dict[str, Any],
                              planned: int = 0) -> Call[EndOutcome]:
        """End conversation ``sample`` with its ``turns`` committed turns: once, its record (``header``: every
        record field but the turns, which Redis adds verbatim) goes to the results stream and its tokens to
        done. A resend or a racing copy is a DUPLICATE; a turn count that is not Redis' is a MISMATCH.
        ``planned``: the turns it planned, given when it ended for a reason of the data, so that predict learns
        how far conversations go (``offered``/``reached`` in the stats); 0 says nothing."""
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"a conversation ends with an int >= 1 of turns, not {turns!r}")
        if "turns" in header:
            raise ValueError("the header of end_conversation holds no turns: Redis adds the committed ones")
        k = self._keys(name)
        return Call(self._end_conversation,
                    [k.meta, k.done, k.turns, k.turnrec, k.convs, k.pending, k.results, k.stats],
                    [sample, turns, orjson.dumps(header), int(planned)], parse_end)

    def reconcile_turns(self, name: str, on_disk: Sequence[str], batch: int = 2000) -> tuple[int, int]:
        """Drop the committed turns Redis still holds of conversations written to disk (Redis restored from
        before the write), after ``reconcile`` counted the file. Returns (conversations cleaned, tokens)."""
        k = self._keys(name)
        cleaned = tokens = 0
        for i in range(0, len(on_disk), batch):
            c, t, _ = self._reconcile_turns(keys=[k.meta, k.used, k.done, k.turns, k.turnrec, k.convs],
                                            args=list(on_disk[i:i + batch]))
            cleaned += int(c)
            tokens += int(t)
        return cleaned, tokens

    def reopen(self, name: str, sample: str, turns: Sequence[dict[str, Any]]) -> int:
        """Make a ``failed`` conversation's on-disk ``turns`` (its record's, in order) committed and unwritten
        again, so a rerun resumes it at the failed turn. Returns 1 reopened, 0 nothing to do (not in done, or
        reopened already), -1 refused: the turns' tokens are not what done counted for it."""
        if not turns:
            raise ValueError("reopen takes the record's turns (at least one)")
        args: list[Any] = [sample]
        for t in turns:
            args += [int(t["completion_tokens"]), orjson.dumps(t)]
        k = self._keys(name)
        verdict, _n = self._reopen(keys=[k.used, k.done, k.turns, k.turnrec, k.convs], args=args)
        return int(verdict)

    def committed_turns(self, name: str, sample: str) -> list[dict[str, Any]]:
        """The committed, not yet written turns of a conversation, in order (what a resumed conversation's
        history is rendered from). Empty once the conversation is written, or before its first turn."""
        k = self._keys(name)
        n = int(self.r.hget(k.convs, sample) or 0)
        if n == 0:
            return []
        rows = self.r.hmget(k.turnrec, [keys.turn_field(sample, t) for t in range(n)])
        out: list[dict[str, Any]] = []
        for row in rows:
            if row is None:  # written meanwhile: its turns left with its record
                break
            out.append(json.loads(row))
        return out

    def conversation_turns(self, name: str, samples: Sequence[str]) -> dict[str, int]:
        """sample -> turns committed, for the ``samples`` that are started conversations (a worker taking a chunk
        resumes those at their next turn instead of starting them anew)."""
        if not samples:
            return {}
        counts = self.r.hmget(self._keys(name).convs, list(samples))
        return {sid: int(n) for sid, n in zip(samples, counts, strict=True) if n is not None and int(n) > 0}

    def open_conversations(self, name: str) -> int:
        """How many conversations are started and not ended (``convs``' size)."""
        return int(self.r.hlen(self._keys(name).convs))

    def unwritten_turn_tokens(self, name: str) -> int:
        """Σ of committed turns not yet in a record: with Σ done, what ``used`` must equal."""
        return sum(int(v) for v in self.r.hvals(self._keys(name).turns))

    def length_sample(self, name: str) -> LengthSample:
        """What predict's length model learns from: recent completion lengths, running requests' progress."""
        return run(self.length_sample_call(name))

    def length_sample_call(self, name: str) -> Call[LengthSample]:
        k = self._keys(name)
        return Call(self._length_sample, [k.lengths, k.progress, k.meta, *k.turn_lengths, k.stats], [],
                    parse_length_sample)

    # -- reading -------------------------------------------------------------------------------------
    def state(self, name: str) -> DatasetState:
        k = keys.DatasetKeys(name)
        with self.r.pipeline(transaction=True) as p:
            p.hgetall(k.meta)
            p.get(k.used)
            p.hlen(k.done)
            p.hlen(k.failed)
            p.zcard(k.chunks)
            p.zcount(k.chunks, "+inf", "+inf")
            p.xlen(k.results)
            p.hvals(k.resv)
            p.hvals(k.inflight)
            p.hgetall(k.stats)
            p.llen(k.discarded)
            meta, used, done, failed, live, queued, unwritten, resv, inflight, stats, to_mark = p.execute()
        fields = {text(a): text(b) for a, b in meta.items()}
        budget = fields.get("budget", "")
        return DatasetState(
            name=name, status=fields.get("status", ""), budget=int(budget) if budget else None,
            used=int(used or 0), committed=int(fields.get("committed", 0)), done=int(done),
            failed=int(failed), live_chunks=int(live), queued_chunks=int(queued), unwritten=int(unwritten),
            discarded_chunks=int(fields.get("discarded_chunks", 0)), reserved=sum(int(x) for x in resv),
            in_flight=sum(int(x) for x in inflight), discards_to_mark=int(to_mark), fields=fields,
            stats={text(a): text(b) for a, b in stats.items()})

    def done_ids(self, name: str) -> dict[str, int]:
        return {text(a): int(b) for a, b in self.r.hgetall(keys.DatasetKeys(name).done).items()}

    def failed(self, name: str) -> dict[str, dict[str, Any]]:
        return {text(a): json.loads(b) for a, b in self.r.hgetall(keys.DatasetKeys(name).failed).items()}

    def live_chunks(self, name: str) -> set[str]:
        return {text(x) for x in self.r.zrange(keys.DatasetKeys(name).chunks, 0, -1)}

    def holders(self, name: str) -> dict[str, str]:
        """sample id -> chunk id, for samples the pending hash assigns to a chunk (live or not)."""
        return {text(a): text(b) for a, b in self.r.hgetall(keys.DatasetKeys(name).pending).items()}
