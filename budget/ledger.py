"""Typed Python calls for the budget scripts: the only way the rest of budgetq changes budget state.

The ledger is policy-free mechanism: it answers "is this sample admitted", "was this commit new", "did this
commit close the dataset", each as a typed value (``Admit``, ``CommitOutcome``, ... below) parsed from the reply
its script's header in budget/scripts.py names, in the same order, and a dataset's state as one read. Workers
and the producer decide what to do with the answers.

Each ``*_call`` method builds a ``Call``: the script, its KEYS and ARGV, and how to read its reply. When it is sent
is the caller's: ``run`` sends one (what the plain methods do), ``run_many`` sends many in one pipeline. The
worker's ``Batcher`` (worker/batch.py) is what calls ``run_many``: the ledger calls its event loop makes in one
iteration go to Redis together, from a helper thread. The producer sends each call alone, through the plain
methods. How calls of one script merge (``Call.merge``) follows from the script's ARGV layout, budget/scripts.py's.

A mix (the last section) is one token budget shared by several datasets by weight (docs/mix.md). A member's share
is its budget: the per-dataset scripts (admit, commit, the close and the discard) enforce it in every worker,
unchanged. The section only decides the numbers, from the total, the weights and the tokens of the members that ran
dry, stores the mix in ``bq:mix:{id}`` (budget/keys.py) and applies the shares with ``set_budget``. Why shares are
not one Lua script over every member: such a script would span the members' hash slots, and it needs no
atomicity. A share depends on the total, the weights and the dry members' tokens only, and a dry member's tokens no
longer change (nothing of it is live). Applying the shares is one ``set_budget`` per member, atomic against that
member's commits and admissions; whoever applies them computes the same numbers from the same hash.
"""
from __future__ import annotations

import enum
import functools
import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Mapping, Sequence, TypeVar

import orjson
import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from budget import keys, scripts
from budget.keys import SEP
from budget.keys import TURN_BUCKETS as TURN_BUCKETS
from budget.keys import turn_bucket as turn_bucket

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
    (``commit_call``: a ``Call``, for the worker, whose batcher sends many in one round trip)."""

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


class Admit(enum.IntEnum):
    START = 1
    CLOSED = 0
    REVOKED = -1
    SKIP = -2
    FULL = -3  # the remaining budget is reserved by requests in flight; the dataset is still open


@dataclass(frozen=True)
class Admission:
    verdict: Admit
    reserved: int  # tokens this request reserves until its commit (0 in drain mode)


@dataclass(frozen=True)
class LengthSample:
    lengths: list[int]  # the last 4096 completion lengths
    running: list[int]  # progress of requests running now: lengths known only to exceed these
    prior_mean: float | None
    max_new_tokens: int
    mode: str
    #: the recent lengths of conversations' turn j (``lengths:{j}``, j = 0..3): predict's per-turn model
    per_turn: list[list[int]] = field(default_factory=list)
    #: the stats hash's ``reached:{j}`` and ``offered:{j}``: how far ended conversations went
    turn_counts: dict[str, int] = field(default_factory=dict)
    #: the progress of conversations' running turns, by turn bucket (``running`` holds them too)
    turn_running: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class CommitOutcome:
    committed: bool  # False: a duplicate; nothing was changed
    used: int
    closed_now: bool  # this commit brought the counter to the budget and closed the dataset
    late: bool = False  # the chunk had lost its lease while the request ran (its reservation had expired)


@dataclass(frozen=True)
class DatasetState:
    name: str
    status: str  # open / closed / '' (never set up)
    budget: int | None
    used: int
    committed: int
    done: int
    failed: int
    live_chunks: int
    queued_chunks: int
    unwritten: int  # results in the stream, not yet on disk
    discarded_chunks: int
    reserved: int
    in_flight: int
    discards_to_mark: int  # discarded chunks whose RQ jobs are not yet marked canceled (an interrupted discard)
    fields: dict[str, str]
    stats: dict[str, str]

    @property
    def mode(self) -> str:
        return self.fields.get("mode", "drain")

    @property
    def max_new_tokens(self) -> int:
        return int(self.fields.get("max_new_tokens", 0) or 0)

    def has_room(self) -> bool:
        """Could a new request be admitted now? (what the producer asks before enqueueing more)"""
        if self.status != "open":
            return False
        if self.budget is None or self.mode == "drain":
            return True
        if self.mode == "strict":
            return self.used + self.reserved + self.max_new_tokens <= self.budget
        return self.used + self.reserved < self.budget


class TurnVerdict(enum.IntEnum):
    COMMITTED = 1
    DUPLICATE = 0  # the turn is committed already, or its conversation is written: nothing changed
    OUT_OF_ORDER = -1  # not the conversation's next turn (generated on another history): nothing changed


@dataclass(frozen=True)
class TurnOutcome:
    """What ``commit_turn`` decided for one turn of a conversation (budget/scripts.py COMMIT_TURN)."""

    verdict: TurnVerdict
    used: int
    closed_now: bool  # this turn brought the counter to the budget and closed the dataset (no new conversation)
    late: bool = False  # the chunk had lost its lease while the request ran

    @property
    def committed(self) -> bool:
        return self.verdict is TurnVerdict.COMMITTED


class TurnAdmit(enum.IntEnum):
    """admit_turn's verdicts (budget/scripts.py ADMIT_TURN)."""

    START = 1
    STOP = 0  # end the conversation with stopped_by "budget": the budget was cut, or (strict) the turn cannot fit
    REVOKED = -1  # the chunk is no longer ours: start nothing more
    SKIP = -2  # not this chunk's conversation, written already, or not at this turn: someone else carries it on
    FULL = -3  # strict: the budget is reserved by requests in flight; ask again once they commit


@dataclass(frozen=True)
class TurnAdmission:
    verdict: TurnAdmit
    reserved: int  # tokens the turn reserves until its commit_turn (0 in drain mode)


class EndVerdict(enum.IntEnum):
    ENDED = 1
    DUPLICATE = 0  # ended already (in done): nothing changed
    MISMATCH = -1  # the conversation has not exactly that many turns committed: nothing changed


@dataclass(frozen=True)
class EndOutcome:
    """What ``end_conversation`` decided (budget/scripts.py END_CONVERSATION)."""

    verdict: EndVerdict
    tokens: int  # ENDED/DUPLICATE: the conversation's done value; MISMATCH: the turns committed

    @property
    def ended(self) -> bool:
        return self.verdict is EndVerdict.ENDED


def parse_turn_admission(reply: Any) -> TurnAdmission:
    verdict, reserved = reply
    return TurnAdmission(TurnAdmit(int(verdict)), int(reserved))


def parse_end(reply: Any) -> EndOutcome:
    verdict, tokens = reply
    return EndOutcome(EndVerdict(int(verdict)), int(tokens))


def parse_turn_commit(reply: Any) -> TurnOutcome:
    verdict, used, closed, late = reply
    return TurnOutcome(TurnVerdict(int(verdict)), int(used), bool(closed), bool(late))


def parse_admissions(reply: Any, n: int) -> list[Admission]:
    """One verdict per sample of ``n``: the script stops at the first refusal that stops the chunk, and the
    samples after it get that refusal too."""
    out = [Admission(Admit(int(reply[i])), int(reply[i + 1])) for i in range(0, len(reply), 2)]
    return out + [out[-1]] * (n - len(out))


def parse_commit(reply: Any) -> CommitOutcome:
    ok, used, closed, late = reply
    return CommitOutcome(bool(ok), int(used), bool(closed), bool(late))


def parse_length_sample(reply: Any) -> LengthSample:
    lengths, progress, (prior, max_new, mode) = reply[:3]
    running = [int(x) for row in progress for x in json.loads(row)]
    per_turn: list[list[int]] = []
    counts: dict[str, int] = {}
    turn_running: list[list[int]] = [[] for _ in range(TURN_BUCKETS)]
    if len(reply) > 3:  # called with the per-turn keys (Ledger.length_sample_call does)
        per_turn = [[int(x) for x in rows] for rows in reply[3:3 + TURN_BUCKETS]]
        flat = reply[3 + TURN_BUCKETS]
        counts = {text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        fields = reply[4 + TURN_BUCKETS]
        for i in range(0, len(fields), 2):
            chunk, sep, b = text(fields[i]).rpartition(SEP)
            if sep and b.isdigit() and int(b) < TURN_BUCKETS:
                turn_running[int(b)].extend(int(x) for x in json.loads(fields[i + 1]))
    return LengthSample([int(x) for x in lengths], running, float(prior) if prior else None,
                        int(max_new or 0), text(mode) if mode else "drain", per_turn, counts, turn_running)


def text(value: Any) -> str:
    """A Redis reply value as str (the client may or may not decode replies)."""
    return value.decode() if isinstance(value, bytes) else str(value)


T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One budget script call as a value: sent alone (``run``) or many in one round trip (``run_many``)."""

    script: Script
    keys: list[str]
    args: list[Any]
    parse: Callable[[Any], T]
    #: Width of one reply in a script that takes repeated groups of ARGV (COMMIT). Calls of such a script
    #: with the same KEYS go to Redis as one EVALSHA with their ARGV joined (``run_many``); each gets back
    #: its own ``merge`` values. 0: never merged.
    merge: int = 0


def run(call: Call[T]) -> T:
    """Send one call on the client its script was registered on; its parsed reply."""
    return call.parse(call.script(keys=call.keys, args=call.args))


def run_many(client: "redis.Redis", calls: Sequence[Call[Any]]) -> list[Any]:
    """Send ``calls`` in one non-transactional pipeline on ``client`` (the one their scripts were registered on):
    one round trip instead of len(calls).

    Returns each call's parsed reply, or the exception a call raised (a refused script does not stop the
    others; each script is atomic on its own, which is all the budget needs). A connection error raises for
    the whole batch: a caller may resend any of them, because every budget script is idempotent.

    Calls that can merge (``Call.merge``: COMMIT) and share a script and KEYS go as one EVALSHA with their
    ARGV joined: packing, sending and running one script instead of many is most of what a batch saves. The
    script still decides each group as if it ran alone, in order; the calls of a batch are concurrent, so
    no caller relied on an order between them. A refused merged script is refused for each of its calls.

    The pipeline sends plain EVALSHAs, not redis-py's pipeline scripts, which ask SCRIPT EXISTS before every
    execute (a second round trip); a NOSCRIPT reply (Redis restarted, or SCRIPT FLUSH) means that script did
    not run, so it is loaded and those sends alone go again."""
    sends: list[tuple[Call[Any], list[Any], list[int]]] = []  # (call, joined ARGV, indices of its calls)
    merged: dict[tuple[int, tuple[str, ...]], int] = {}
    for i, call in enumerate(calls):
        if call.merge:
            at = merged.setdefault((id(call.script), tuple(call.keys)), len(sends))
            if at < len(sends):
                sends[at][1].extend(call.args)
                sends[at][2].append(i)
                continue
        sends.append((call, list(call.args), [i]))
    replies: list[Any] = [None] * len(calls)
    todo = sends
    for attempt in (1, 2):
        with client.pipeline(transaction=False) as p:
            for call, args, _ in todo:
                p.evalsha(call.script.sha, len(call.keys), *call.keys, *args)
            raw = p.execute(raise_on_error=False)
        missing = []
        for send, reply in zip(todo, raw, strict=True):
            call, _, members = send
            if isinstance(reply, NoScriptError) and attempt == 1:
                missing.append(send)
            elif isinstance(reply, Exception):
                for i in members:
                    replies[i] = reply
            elif call.merge:
                w = call.merge
                for j, i in enumerate(members):
                    replies[i] = calls[i].parse(reply[j * w:(j + 1) * w])
            else:
                replies[members[0]] = call.parse(reply)
        if not missing:
            break
        for script in {id(send[0].script): send[0].script for send in missing}.values():
            script.sha = client.script_load(script.script)
        todo = missing
    return replies

# -- a mix: one budget shared by weight (docs/mix.md) --------------------------------------------------------

if TYPE_CHECKING:
    import redis

SEPARATOR = ","  # never in a dataset name (keys.DATASET_NAME_RE)


def mix_id(names: Iterable[str]) -> str:
    """The id of the mix of these members: their names, sorted, joined by ",". The same datasets are the same mix
    on every host."""
    return SEPARATOR.join(sorted(names))


def split_shares(total: int, weights: Mapping[str, Fraction], dry: Mapping[str, int]) -> dict[str, int]:
    """Each member's budget: a dry member keeps what it used; the rest of ``total`` goes to the others in
    proportion to their weights, each rounded down, the last by name taking the remainder so the shares sum to
    the rest exactly. Exact arithmetic (Fraction): a share never depends on float rounding."""
    fixed = {n: dry[n] for n in weights if n in dry}
    active = sorted(n for n in weights if n not in dry)
    out = dict(fixed)
    rest = max(0, total - sum(fixed.values()))
    if active:
        wsum = sum(weights[n] for n in active)
        for n in active[:-1]:
            out[n] = int(rest * weights[n] / wsum)  # int() of a positive Fraction rounds down
        out[active[-1]] = rest - sum(out[n] for n in active[:-1])
    return out


def plan_shares(total: int, weights: Mapping[str, Fraction], capacity: Mapping[str, int | None]) -> Mix:
    """The mix a run is expected to end with, for ``--dry-run``: a member whose projected tokens (``capacity``;
    None: unknown, never dry) cannot fill its share runs dry at its capacity and passes the rest on, until every
    share fits. The same rule as a run's (``split_shares`` with the dry members), applied ahead of time."""
    dry: dict[str, int] = {}
    while True:
        shares = split_shares(total, weights, dry)
        short = {n: c for n, c in capacity.items()
                 if n not in dry and n in shares and c is not None and c < shares[n]}
        if not short:
            return Mix(total, weights, dry)
        dry.update(short)


@dataclass(frozen=True)
class Mix:
    """A mix as stored: the total, each member's weight, the tokens of the members that ran dry."""

    total: int
    weights: Mapping[str, Fraction]
    dry: Mapping[str, int] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return mix_id(self.weights)

    def shares(self) -> dict[str, int]:
        return split_shares(self.total, self.weights, self.dry)

    def given(self) -> str:
        """The total and weights as one string: what a ``produce`` command gave (``MixStore.given``)."""
        return json.dumps({"total": self.total, "weights": {n: str(w) for n, w in sorted(self.weights.items())}})

    def describe(self) -> str:
        """One line: the total, and each member's weight and share, for status and the summary."""
        shares = self.shares()
        parts = [f"{n}={_weight(self.weights[n])} ({shares[n]:,}{', ran dry' if n in self.dry else ''})"
                 for n in sorted(self.weights)]
        return f"mix of {len(parts)}: total {self.total:,}: " + ", ".join(parts)


def _weight(w: Fraction) -> str:
    return str(w.numerator) if w.denominator == 1 else f"{float(w):g}"


class MixStore:
    """The mixes in Redis: ``bq:mix:{id}`` and each member's ``mix`` field (budget/keys.py)."""

    def __init__(self, client: "redis.Redis") -> None:
        self.r = client

    def load(self, mix_id: str) -> Mix | None:
        raw = {text(k): text(v) for k, v in self.r.hgetall(keys.mix(mix_id)).items()}
        if "total" not in raw:
            return None
        weights = {k[len("weight:"):]: Fraction(v) for k, v in raw.items() if k.startswith("weight:")}
        dry = {k[len("dry:"):]: int(v) for k, v in raw.items() if k.startswith("dry:")}
        return Mix(total=int(raw["total"]), weights=weights, dry=dry)

    def save(self, mix: Mix, given: str | None = None) -> None:
        """Store the total and the weights (a mix's members never change: they are its id); the dry marks stay."""
        fields: dict[Any, Any] = {"total": str(mix.total), **{f"weight:{n}": str(w) for n, w in mix.weights.items()}}
        if given is not None:
            fields["given"] = given
        pipe = self.r.pipeline()
        pipe.hset(keys.mix(mix.id), mapping=fields)
        for name in mix.weights:
            pipe.hset(keys.DatasetKeys(name).meta, "mix", mix.id)
        pipe.execute()

    def given(self, mix_id: str) -> str | None:
        """The mix the last ``produce`` that gave ``--mix`` gave (``Mix.given``); None: none yet."""
        raw = self.r.hget(keys.mix(mix_id), "given")
        return text(raw) if raw is not None else None

    def mix_of(self, name: str) -> str | None:
        raw = self.r.hget(keys.DatasetKeys(name).meta, "mix")
        return text(raw) if raw else None

    def mark_dry(self, mix_id: str, name: str, used: int) -> None:
        self.r.hset(keys.mix(mix_id), f"dry:{name}", used)

    def clear_dry(self, mix_id: str, names: Iterable[str]) -> None:
        fields = [f"dry:{n}" for n in names]
        if fields:
            self.r.hdel(keys.mix(mix_id), *fields)

    def forget(self, mix_id: str) -> None:
        self.r.delete(keys.mix(mix_id))

    def apply(self, ledger: Ledger, mix: Mix) -> dict[str, str]:
        """Set every member's budget to its share (``set_budget``: raising reopens, lowering to what is used
        closes); returns each member's status. A member whose budget is already its share is left as it is."""
        out = {}
        for name, share in mix.shares().items():
            current, status = self.r.hmget(keys.DatasetKeys(name).meta, ["budget", "status"])
            if current is not None and text(current) == str(share):
                out[name] = text(status) if status else "open"
                continue
            out[name] = ledger.set_budget(name, share)
        return out
