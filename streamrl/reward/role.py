"""Building the reward role: the reward function of `reward.function`, scored in its sandbox.

The role's process never imports torch (rewards are plain numbers; the function runs in a
worker process of its own).
"""

from __future__ import annotations

from streamrl.api.run import RunContext
from streamrl.config.derived import rows_per_batch
from streamrl.models.loading import policy_tokenizer
from streamrl.reward.sandbox import SandboxedScorer
from streamrl.reward.service import RewardRole


def make_scorer(ctx: RunContext) -> SandboxedScorer:
    """The run's reward function behind its sandbox (its workers start at the first call)."""
    return SandboxedScorer.from_config(ctx.cfg.reward)


def build(ctx: RunContext, bus, weights, *, start_step: int) -> RewardRole:
    cfg = ctx.cfg
    return RewardRole(
        bus,
        make_scorer(ctx),
        policy_tokenizer(ctx),
        invalid_penalty=cfg.reward.invalid_output_penalty,
        max_rows=rows_per_batch(cfg),
        lease_s=cfg.runtime.lease_s,
        episodes=cfg.agent.enabled,
    )
