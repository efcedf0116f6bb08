"""The attached producer's side of a mix (docs/mix.md): which mix this run is, the shares at attach, a member that
runs dry passing its rest on, and the shares applied again on every lease check (a ``produce budget --mix`` from
elsewhere, or another producer's apply, converges here).

The numbers come from budget/mix.py; each share becomes a member's budget through ``Ledger.set_budget``, so the
per-dataset scripts enforce it in every worker."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from budget.ledger import Ledger
from budget.mix import Mix, MixStore, mix_id

if TYPE_CHECKING:
    import redis

    from producer.session.state import DatasetRun


def _same(a: Mix, b: Mix) -> bool:
    return a.total == b.total and dict(a.weights) == dict(b.weights)


#: A member is ahead, and gets no new chunks, while its share is this much more spent than the least spent open
#: member's (fractions of their shares): what is queued already still runs, so this is a band, not a hard cap.
PACE_SLACK = 0.02


class MixKeeper:
    """``given``: the run's --mix (None: none given; a mix stored for exactly these datasets still applies)."""

    def __init__(self, client: "redis.Redis", ledger: Ledger, given: Mix | None, new_run: bool,
                 echo: Callable[[str], None], pace: bool = True) -> None:
        self.store = MixStore(client)
        self.ledger = ledger
        self.given = given
        self.new_run = new_run
        self.echo = echo
        self.pace = pace
        self.mix: Mix | None = None
        self._given: str | None = None  # what ``attached`` records as the command's mix (None: keep the record)

    def settle(self, names: Iterable[str]) -> Mix | None:
        """Before the datasets attach, read-only: the mix this run applies (``attached`` writes it).

        A rerun giving the last command's mix again keeps a total or weights ``produce budget --mix`` set since
        (saying so), as a rerun's --budget does; another mix replaces it (saying so). Without --mix, the mix stored
        for exactly these datasets applies."""
        names = sorted(names)
        if self.given is None:
            ids = {self.store.mix_of(n) for n in names}
            self.mix = self.store.load(mix_id(names)) if ids == {mix_id(names)} else None
            return self.mix
        wanted = self.given
        stored = None if self.new_run else self.store.load(wanted.id)
        if stored is not None and self.store.given(wanted.id) == wanted.given() and not _same(stored, wanted):
            self.echo(f"keeps the {stored.describe()}, set since the last run; --mix is the last run's (give "
                      "another --budget or --mix to replace it)")
            self.mix, self._given = stored, None
        else:
            kept = Mix(wanted.total, wanted.weights, stored.dry if stored is not None else {})
            if stored is not None and not _same(stored, wanted):
                self.echo(f"mix changed: {stored.describe()} -> {kept.describe()}")
            self.mix, self._given = kept, wanted.given()
        return self.mix

    def shares(self) -> dict[str, int]:
        return self.mix.shares() if self.mix is not None else {}

    def attached(self, runs: list["DatasetRun"]) -> None:
        """After every member attached: a member marked dry that has prompts to run again (a rerun with more data,
        or more --max-samples) is a member again; then every share is applied."""
        if self.mix is None:
            return
        if self.given is not None:
            if self.new_run:
                self.store.forget(self.mix.id)
            self.store.save(self.mix, given=self._given)
        back = [d.name for d in runs if d.name in self.mix.dry and (d.todo or d.chunk_samples)]
        if back:
            self.store.clear_dry(self.mix.id, back)
        self.apply()

    def ran_dry(self, d: "DatasetRun") -> bool:
        """``d`` has nothing left to run while open and under its share: it keeps what it used, and the rest of its
        share goes to the others by weight. Returns whether that happened."""
        if self.mix is None or d.name not in self.mix.weights or d.name in self.mix.dry:
            return False
        if d.status != "open" or d.budget is None or d.used >= d.budget:
            return False
        self.store.mark_dry(self.mix.id, d.name, d.used)
        others = ", ".join(n for n in sorted(self.mix.weights) if n != d.name and n not in self.mix.dry)
        self.apply()
        self.echo(f"{d.name}: ran dry at {d.used:,} tokens of its share {d.budget:,}; the rest goes to "
                  f"{others or 'no other dataset (every one ran dry)'} by weight")
        return True

    def paces(self, d: "DatasetRun") -> bool:
        return self.pace and self.mix is not None and d.name in self.mix.weights

    def ahead(self, d: "DatasetRun", runs: list["DatasetRun"], mean: Callable[["DatasetRun"], float]) -> bool:
        """Proportion at any moment (docs/mix.md): should ``d`` wait for the other members before it gets another
        chunk? A member's progress is the part of its share it used or holds in live chunks (their samples at its
        mean length, ``mean``): counting only what is used, the first member to be enqueued would fill the queue
        before its first result. ``d`` waits while it is PACE_SLACK ahead of the least advanced member that can
        still go on (open, prompts left, not dry). Workers pull chunks in queue order, so the members' token
        rates follow what the producer queues."""
        if not self.pace or self.mix is None or d.name not in self.mix.weights:
            return False

        def progress(x: "DatasetRun") -> float:
            held = sum(1 for ids in x.chunk_samples.values() for sid in ids if sid not in x.done)
            return (x.used + held * mean(x)) / x.budget if x.budget else 1.0

        behind = [progress(x) for x in runs if x is not d and x.name in self.mix.weights
                  and x.name not in self.mix.dry and x.status == "open" and x.todo and not x.finished]
        return bool(behind) and progress(d) > min(behind) + PACE_SLACK

    def apply(self) -> None:
        """Read the mix again and set every member's budget to its share; closing a member discards its queued
        chunks in the loop's next step (a closed dataset's queue is discarded there)."""
        if self.mix is None:
            return
        self.mix = self.store.load(self.mix.id) or self.mix
        self.store.apply(self.ledger, self.mix)
