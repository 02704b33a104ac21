"""Building the advantage role: the estimator and reward shaping of `algorithm.*`, with the
reward normaliser's state kept beside the run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamrl.api.run import RunContext
from streamrl.config.derived import prompts_per_batch, rows_per_batch
from streamrl.config.schema import Config

if TYPE_CHECKING:
    from streamrl.trainer.advantage import AdvantageRole, AdvantageSettings


def advantage_settings(cfg: Config) -> AdvantageSettings:
    from streamrl.trainer.advantage import AdvantageSettings

    return AdvantageSettings.of(cfg.algorithm, cfg.rollout.max_new_tokens)


def build(ctx: RunContext, bus, weights, *, start_step: int) -> AdvantageRole:
    from streamrl.trainer.advantage import NORMALISER_FILE, AdvantageRole  # torch

    cfg = ctx.cfg
    return AdvantageRole(
        bus,
        weights,
        advantage_settings(cfg),
        groups_per_batch=prompts_per_batch(cfg),
        max_staleness=cfg.rollout.max_staleness,
        max_rows=rows_per_batch(cfg),
        lease_s=cfg.runtime.lease_s,
        normaliser_path=ctx.run_dir / NORMALISER_FILE,
        resume_step=start_step if ctx.checkpoint is not None else None,
        keep_batches=cfg.rollout.max_staleness + 2 * max(cfg.trainer.checkpoint_every, 1) + 2,
    )
