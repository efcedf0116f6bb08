"""What the ledger answers (budget/ledger.py): each budget script's verdict as a typed value, the parse of the
script's raw reply into it, and a dataset's state as one read.

The values are policy-free: "is this sample admitted", "was this commit new", "did this commit close the dataset".
The worker and the producer decide what to do with them. Each parse reads the reply its script's header in
budget/scripts.py names, in the same order.
"""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

# LengthSample.per_turn[j] holds turn bucket j's lengths (turns 0, 1, 2; 3: the fourth and later). Re-exported for
# the worker, which names no key: budget/keys.py owns the lists they come from.
from budget.keys import SEP
from budget.keys import TURN_BUCKETS as TURN_BUCKETS
from budget.keys import turn_bucket as turn_bucket


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
