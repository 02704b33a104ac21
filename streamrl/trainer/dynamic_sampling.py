"""DAPO dynamic sampling with refill: which groups of one training step are trained.

A step trains exactly `target` informative groups (`rollout.batch_prompts`): groups whose
rewards are not all equal. Its prompts arrive in rounds, the feeder's batch first and then
refill rounds the trainer adds, each a function of (seed, step, round). Groups are ranked in a
fixed order, by (round, prompt), and the step trains the first `target` informative ones in that
order, so the choice never depends on which group finished first; that is what keeps resume
exact and `max_staleness=0` equal to the synchronous loop. Later informative groups are surplus:
generated, not trained.

A refill round is added as soon as the rounds so far cannot reach the target even if every group
still outstanding turns out informative. Adding only when certain keeps the number of rounds a
function of the rewards alone. After `max_rounds` rounds the step trains what it has.

Verdicts: `train`; `drop` (no signal: advantage None, or nothing scored); `surplus`. A group is
decided as soon as no outstanding group before it could change its rank, so training streams.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.api import fields as F

log = logging.getLogger(__name__)

TRAIN, DROP, SURPLUS = "train", "drop", "surplus"


def group_informative(rows: Sequence[Mapping[str, Any]]) -> bool:
    """A group counts toward the step when some sample has a reward and an advantage (the
    advantage role writes None for every sample of a group without signal)."""
    return any(r[F.REWARD] is not None and r[F.ADVANTAGES] is not None for r in rows)


class StepGroups:
    """The groups of one training step, in rank order, and the verdict on each.

    The trainer calls `add_round` with the group ids of each round it puts on the bus, `record`
    for each group it claims, then `decide` to learn which claimed groups it may now train or
    set aside; it adds a round while `wants_round` and finishes the step once `complete`.
    """

    def __init__(self, *, target: int, max_rounds: int):
        if target < 1 or max_rounds < 1:
            raise ValueError(f"target ({target}) and max_rounds ({max_rounds}) must be >= 1")
        self.target = target
        self.max_rounds = max_rounds
        self.order: list[str] = []  # group ids in rank order
        self.rounds = 0
        self.informative: dict[str, bool] = {}  # claimed groups
        self.verdicts: dict[str, str] = {}

    def add_round(self, group_ids: Sequence[str]) -> None:
        assert self.rounds < self.max_rounds, "no round beyond max_rounds"
        self.order.extend(group_ids)
        self.rounds += 1

    def record(self, group_id: str, informative: bool) -> None:
        assert group_id not in self.informative, f"group {group_id} recorded twice"
        self.informative[group_id] = informative

    @property
    def num_outstanding(self) -> int:
        return len(self.order) - len(self.informative)

    @property
    def num_informative(self) -> int:
        return sum(self.informative.values())

    @property
    def wants_round(self) -> bool:
        """True when another round is certainly needed and still allowed."""
        reachable = self.num_informative + self.num_outstanding
        return self.rounds < self.max_rounds and reachable < self.target

    @property
    def complete(self) -> bool:
        """Every group of every round is in and no further round is needed (or allowed)."""
        return self.num_outstanding == 0 and not self.wants_round

    def decide(self) -> dict[str, str]:
        """Verdicts on claimed groups that are now certain and were not given before."""
        new: dict[str, str] = {}
        informative_before = outstanding_before = 0
        for gid in self.order:
            if gid not in self.informative:
                outstanding_before += 1
                continue
            informative = self.informative[gid]
            if gid not in self.verdicts:
                verdict = None
                if not informative:
                    verdict = DROP
                elif informative_before >= self.target:
                    verdict = SURPLUS
                elif informative_before + outstanding_before < self.target:
                    verdict = TRAIN
                if verdict is not None:
                    self.verdicts[gid] = new[gid] = verdict
            informative_before += informative
        return new

    def metrics(self, step: int) -> dict[str, float]:
        """The `dynamic_sampling/*` metrics of training step `step` (call once complete); logs a
        warning when refill is on and the step still trains fewer than `target` groups."""
        counts = {v: sum(x == v for x in self.verdicts.values()) for v in (TRAIN, DROP, SURPLUS)}
        if counts[TRAIN] < self.target and self.max_rounds > 1:
            log.warning(
                "step %d: only %d of %d groups had signal after %d generation batches "
                "(algorithm.dynamic_sampling.max_batches); training on those",
                step,
                counts[TRAIN],
                self.target,
                self.rounds,
            )
        return {
            "dynamic_sampling/batches_per_step": self.rounds,
            "dynamic_sampling/groups_trained": counts[TRAIN],
            "dynamic_sampling/groups_dropped": counts[DROP],
            "dynamic_sampling/groups_surplus": counts[SURPLUS],
            "dynamic_sampling/cap_hit": float(counts[TRAIN] < self.target),
        }


def groups_of(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Rows by group id, groups in order of first appearance."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["group_id"], []).append(r)
    return out
