"""The learning-rate schedule: a pure function of the step, shared by the learner and by the
checks that need the rate a run ends at (no torch here: the CLI imports it before any work)."""

from __future__ import annotations

import math


def scheduled_lr(
    version: int,
    *,
    lr: float,
    schedule: str,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
) -> float:
    """Learning rate of the step that makes version+1. The first `warmup_steps` steps rise
    linearly to `lr`; then `constant` keeps it, `cosine` decays it to `min_lr_ratio * lr` over
    the steps left."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"lr_schedule must be 'constant' or 'cosine', got {schedule!r}")
    if version < warmup_steps:
        return lr * (version + 1) / (warmup_steps + 1)
    decay_steps = total_steps - warmup_steps
    if schedule == "constant" or decay_steps <= 1:
        return lr
    progress = min((version - warmup_steps) / (decay_steps - 1), 1.0)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * cosine)


def final_lr(cfg) -> float:
    """The learning rate of the last step of a run with config `cfg`."""
    a = cfg.algorithm
    return scheduled_lr(
        cfg.trainer.steps - 1,
        lr=a.lr,
        schedule=a.lr_schedule,
        total_steps=cfg.trainer.steps,
        warmup_steps=a.lr_warmup_steps,
        min_lr_ratio=a.min_lr_ratio,
    )
