"""Building the rollout role from the run's config: its engine, sampling and admission bound."""

from __future__ import annotations

from streamrl.api.run import RunContext
from streamrl.config.derived import multimodal
from streamrl.rollout.engines import make_engine, rows_per_claim, sampling_params
from streamrl.rollout.service import RolloutRole


def build(ctx: RunContext, bus, weights, *, start_step: int) -> RolloutRole:
    cfg = ctx.cfg
    return RolloutRole(
        bus,
        weights,
        make_engine(ctx),
        params=sampling_params(cfg),
        max_staleness=cfg.rollout.max_staleness,
        max_rows=rows_per_claim(cfg),
        inflight_updates=cfg.rollout.inflight_weight_updates,
        lease_s=cfg.runtime.lease_s,
        multimodal=multimodal(cfg),
    )
