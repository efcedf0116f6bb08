"""predict's per-turn length model: what a conversation's remaining turns will cost (docs/multiturn.md, "Budget").

A conversation's turns are not alike: in real multi-turn data a follow-up answer is often shorter than the first,
an agent's later step longer. A reservation that prices every turn at the pooled mean of all completion lengths
(what predict did before this model) is biased as soon as they differ, and the bias lands where it hurts: near the
close the conversations still running are the ones in their later turns. So each turn index j (0, 1, 2, and 3 for
every turn from the fourth on) has a length model of its own, built from the recent lengths of that turn
(``bq:ds:{n}:lengths:{j}``), with the pooled model's mean as its prior: until a turn has answers of its own it is
priced as the pooled model prices it, and its own lengths outweigh the prior after a few dozen.

Not every planned turn happens: a conversation ends early when a turn is cut by max_new_tokens, no longer fits the
context, or calls other tools than the dataset's. The share of conversations that go on from turn j-1 to turn j,
among ended conversations that had a turn j planned (``bq:ds:{n}:stats`` ``reached:{j}`` / ``offered:{j}``, counted
by ``end_conversation``), weighs turn j's expected length. Pseudo-counts keep it at 1 (reserve every planned turn,
the upper bound) until conversations have ended.

The running turn is priced as a single-turn request is, E[L_j | L_j > progress] (worker/estimate.py LengthModel);
the turns after it at their expected length. The per-turn models do not count running requests as censored
observations (the pooled model does): their lists fill from the turns that ended, which is an unbiased sample of
turn j's lengths once a few hundred have, long before a budget of any size closes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Mapping, Sequence

from worker.estimate import LengthModel

#: Turn indexes with a model of their own; every later turn shares the last one's (``lengths:3``).
TURN_BUCKETS: Final = 4
#: Pseudo-observations of "went on" behind each continuation share: 1 until that many conversations have ended.
CONTINUATION_PRIOR: Final = 8


def bucket(turn: int) -> int:
    """The model a turn uses: its own for turns 0..2, the shared one for the fourth and later."""
    return min(max(turn, 0), TURN_BUCKETS - 1)


@dataclass(frozen=True)
class TurnModels:
    """The length model of each turn bucket and the share of conversations that reach each turn."""

    models: tuple[LengthModel, ...]  # one per bucket
    continuation: tuple[float, ...]  # continuation[j]: P(turn j happens | turn j-1 did, turn j planned); [0] = 1
    z: float = 0.0  # reservations add z standard errors of each model (BUDGETQ_PREDICT_MODEL_ERROR)

    @classmethod
    def build(cls, pooled: LengthModel, per_turn: Sequence[Sequence[int]], counts: Mapping[str, int],
              z: float = 0.0) -> "TurnModels":
        """From the pooled model (the prior), each bucket's recent lengths (missing buckets: none yet) and the
        stats hash's ``reached:{j}`` / ``offered:{j}`` counts."""
        prior = pooled.mean()
        models = tuple(LengthModel(list(per_turn[j]) if j < len(per_turn) else [], prior, pooled.max_new)
                       for j in range(TURN_BUCKETS))
        shares = [1.0]
        for j in range(1, TURN_BUCKETS):
            reached, offered = int(counts.get(f"reached:{j}", 0)), int(counts.get(f"offered:{j}", 0))
            shares.append(min(1.0, (reached + CONTINUATION_PRIOR) / (offered + CONTINUATION_PRIOR)))
        return cls(models, tuple(shares), z)

    def model(self, turn: int) -> LengthModel:
        return self.models[bucket(turn)]

    def current(self, turn: int, progress: float) -> int:
        """What the running turn ``turn`` reserves, ``progress`` tokens into it."""
        return self.model(turn).reserve(progress, self.z)

    def future(self, turn: int, planned: int) -> int:
        """The expected tokens of the turns after ``turn`` of a conversation planned for ``planned`` turns: each
        later turn's expected length, weighed by the chance the conversation gets there."""
        total = 0.0
        reach = 1.0
        for j in range(turn + 1, planned):
            reach *= self.continuation[bucket(j)]
            total += reach * self.model(j).reserve(0.0, self.z)
        return round(total)

    def conversation(self, planned: int) -> int:
        """What a new conversation of ``planned`` turns reserves when it is admitted: turn 0 and the rest."""
        return self.current(0, 0.0) + self.future(0, planned)
