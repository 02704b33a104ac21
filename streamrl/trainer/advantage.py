"""The advantage role: claims whole groups once every sample is scored, writes GRPO advantages.

Only samples with a reward (status ok, or invalid_output with an explicit penalty) enter the
group baseline; the others get advantage 0 and are left out of training by the trainer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from streamrl.api import fields as F
from streamrl.bus.transform import TransformRole
from streamrl.trainer.algos.grpo import group_advantages

CONSUMER = "advantage"


def advantage_fields(
    rows: Sequence[Mapping[str, Any]], std_eps: float
) -> dict[str, dict[str, Any]]:
    """Advantages for rows holding one or more complete groups."""
    groups: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r["group_id"]].append(r)
    updates: dict[str, dict[str, Any]] = {}
    for members in groups.values():
        scored = [r for r in members if r[F.REWARD] is not None]
        adv = (
            group_advantages(torch.tensor([float(r[F.REWARD]) for r in scored]), std_eps=std_eps)
            if scored
            else []
        )
        for r, a in zip(scored, adv, strict=True):
            updates[r["sample_id"]] = {F.ADVANTAGES: float(a)}
        for r in members:
            updates.setdefault(r["sample_id"], {F.ADVANTAGES: 0.0})
    return updates


class AdvantageRole(TransformRole):
    consumer = CONSUMER
    consumes = (F.REWARD,)
    sampler = "group"

    def __init__(self, bus, *, std_eps: float, max_rows: int, lease_s: float):
        super().__init__(bus, max_rows=max_rows, lease_s=lease_s)
        self.std_eps = std_eps

    def compute(self, rows):
        return advantage_fields(rows, self.std_eps)
