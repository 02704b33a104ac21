"""Building the reference role (frozen initial policy, for the KL term) and the logp role (pi_old
of decoupled PPO, following the published weights): the same model load and scoring settings."""

from __future__ import annotations

from typing import Any

from streamrl.api.run import RunContext
from streamrl.config.derived import multimodal, rows_per_batch
from streamrl.models.loading import load_policy_model, policy_tokenizer
from streamrl.reference.service import LogpRole, ReferenceRole


def _scoring(ctx: RunContext) -> dict[str, Any]:
    cfg = ctx.cfg
    return {
        "pad_token_id": policy_tokenizer(ctx).pad_token_id,
        "temperature": cfg.rollout.temperature,
        "max_rows": rows_per_batch(cfg),
        "lease_s": cfg.runtime.lease_s,
        "routing_replay": cfg.algorithm.routing_replay == "rollout",
        "multimodal": multimodal(cfg),
    }


def build(ctx: RunContext, bus, weights, *, start_step: int) -> ReferenceRole:
    return ReferenceRole(bus, load_policy_model(ctx), **_scoring(ctx))


def build_logp(ctx: RunContext, bus, weights, *, start_step: int) -> LogpRole:
    return LogpRole(bus, weights, load_policy_model(ctx), **_scoring(ctx))
