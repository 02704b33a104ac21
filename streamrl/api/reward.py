"""Contract of a reward: a value with a status and a reason, never a silent 0.

Only `ok` results (and `invalid_output` when the task sets an explicit penalty) enter group
baselines and advantages; the rest are counted and shown. A result may also carry named
components (say `accuracy` and `format`, of which the value is the weighted sum): each is
logged per step as `reward_components/<name>`, and none of them enters training.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

RewardStatus = Literal["ok", "invalid_output", "timeout", "infra_error"]


@dataclass(frozen=True)
class RewardResult:
    value: float | None
    status: RewardStatus = "ok"
    reason: str = ""
    components: Mapping[str, float] = field(default_factory=dict)
    """Named parts of the reward, logged (not trained on): `reward_components/<name>`."""

    @classmethod
    def ok(cls, value: float) -> RewardResult:
        return cls(float(value), "ok")

    @classmethod
    def invalid(cls, reason: str) -> RewardResult:
        return cls(None, "invalid_output", reason)


class RewardFn(Protocol):
    def __call__(
        self, response: str, answer: str, **extra: object
    ) -> float | RewardResult | Mapping[str, float]:
        """Score one response. Called in a sandboxed worker process with a timeout. A mapping
        is veRL's form: its `score` is the reward and its other numbers are components."""
        ...
