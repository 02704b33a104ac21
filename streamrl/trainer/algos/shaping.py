"""Reward shaping as pure functions (and one small stateful normaliser).

- DAPO's soft overlong punishment, added to the reward of a response that nears the length cap.
- Dynamic sampling's filter: a group whose rewards are all equal carries no signal.
- Online reward normalisation with exponential moving mean and variance.
- Reward clipping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def overlong_penalty(length: int, *, max_len: int, cache_len: int) -> float:
    """DAPO soft overlong punishment: 0 up to max_len - cache_len, then a linear ramp down to -1
    at max_len, and -1 beyond."""
    if cache_len <= 0:
        return -1.0 if length > max_len else 0.0
    free = max_len - cache_len
    if length <= free:
        return 0.0
    if length <= max_len:
        return (free - length) / cache_len
    return -1.0


def informative(rewards: Sequence[float]) -> bool:
    """Dynamic sampling keeps a group only when its rewards are not all equal."""
    return len(rewards) > 1 and any(r != rewards[0] for r in rewards)


def clip_rewards(rewards_b: torch.Tensor, bound: float | None) -> torch.Tensor:
    """Clip rewards to [-bound, bound] (None: unchanged)."""
    return rewards_b if bound is None else rewards_b.clamp(-bound, bound)


class RewardNormaliser:
    """Exponential moving mean and variance of rewards; `__call__` updates with a batch, then
    returns it normalised by the updated statistics. The first batch sets the statistics."""

    def __init__(self, momentum: float = 0.99, eps: float = 1e-6):
        if not 0 <= momentum < 1:
            raise ValueError(f"reward normaliser momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.eps = eps
        self.mean = 0.0
        self.var = 1.0
        self.count = 0

    def update(self, rewards_b: torch.Tensor) -> None:
        """Fold a batch into the statistics. Non-finite rewards are left out: one NaN would
        otherwise set the state to NaN for good (it is checkpointed), and skip every later step."""
        rewards_b = rewards_b[torch.isfinite(rewards_b)]
        if len(rewards_b) == 0:
            return
        batch_mean = float(rewards_b.mean())
        batch_var = float(rewards_b.var(unbiased=False)) if len(rewards_b) > 1 else 0.0
        if self.count == 0:
            self.mean, self.var = batch_mean, batch_var
        else:
            m = self.momentum
            self.mean = m * self.mean + (1 - m) * batch_mean
            self.var = m * self.var + (1 - m) * batch_var
        self.count += len(rewards_b)

    def __call__(self, rewards_b: torch.Tensor) -> torch.Tensor:
        if len(rewards_b) == 0:
            return rewards_b
        self.update(rewards_b)
        return (rewards_b - self.mean) / (math.sqrt(self.var) + self.eps)

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], int(state["count"])
