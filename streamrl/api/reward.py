"""Contract of a reward: a value with a status and a reason, never a silent 0.

Only `ok` results (and `invalid_output` when the task sets an explicit penalty) enter group
baselines and advantages; the rest are counted and shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

RewardStatus = Literal["ok", "invalid_output", "timeout", "infra_error"]


@dataclass(frozen=True)
class RewardResult:
    value: float | None
    status: RewardStatus = "ok"
    reason: str = ""

    @classmethod
    def ok(cls, value: float) -> RewardResult:
        return cls(float(value), "ok")

    @classmethod
    def invalid(cls, reason: str) -> RewardResult:
        return cls(None, "invalid_output", reason)


class RewardFn(Protocol):
    def __call__(self, response: str, answer: str, **extra: object) -> float | RewardResult:
        """Score one response. Called in a sandboxed worker process with a timeout."""
        ...
