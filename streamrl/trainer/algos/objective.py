"""The trainer's objective for one micro-batch: policy loss, off-policy weight, KL, entropy.

`policy_loss_sum` composes the pure pieces of `losses.py` as the settings say and returns the
weighted *sum* of per-token losses plus statistics; the learner adds the micro-batch's
normaliser share and divides once per optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from streamrl.config.schema import AlgorithmConfig, KLConfig, OffPolicyConfig, PolicyLossConfig
from streamrl.trainer.algos import losses as L


@dataclass(frozen=True)
class LossSettings:
    """What the objective reads: the config's `algorithm.loss`, `algorithm.kl` and
    `algorithm.off_policy` sections as they are, and the aggregation constant resolved."""

    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    agg_constant: float = 1.0
    """Normaliser per sequence of `loss.agg=constant` (`loss.agg_constant`, else the longest
    response)."""

    @classmethod
    def of(cls, algorithm: AlgorithmConfig, max_new_tokens: int) -> LossSettings:
        return cls(
            loss=algorithm.loss,
            kl=algorithm.kl,
            off_policy=algorithm.off_policy,
            agg_constant=algorithm.loss.agg_constant or float(max_new_tokens),
        )

    @property
    def kl_in_loss(self) -> bool:
        return self.kl.coef > 0 and not self.kl.in_reward

    @property
    def entropy_coef(self) -> float:
        return self.loss.entropy_coef

    def normaliser_share(self, num_tokens: float) -> float:
        return L.normaliser_share(num_tokens, self.loss.agg, self.agg_constant)


def policy_loss_sum(
    logp_bt: torch.Tensor,
    behav_bt: torch.Tensor,
    advantages: torch.Tensor,
    mask_bt: torch.Tensor,
    settings: LossSettings,
    *,
    prox_bt: torch.Tensor | None = None,
    ref_bt: torch.Tensor | None = None,
    entropy_bt: torch.Tensor | None = None,
    versions_bt: torch.Tensor | None = None,
    trainer_version: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted sum of the per-token losses of a micro-batch, and token statistics (sums).

    `advantages` is `[B]` (one per sequence) or `[B, T]` (per token). `prox_bt` None means the
    current policy with its gradient stopped (one optimizer step per batch).
    """
    s, o = settings, settings.off_policy
    prox_bt = logp_bt.detach() if prox_bt is None else prox_bt
    adv_bt = advantages.unsqueeze(-1).expand_as(logp_bt) if advantages.dim() == 1 else advantages
    log_ratio = logp_bt - prox_bt
    if s.loss.type == "ppo":
        per_token = L.ppo_clip_loss(
            log_ratio,
            adv_bt,
            eps_low=s.loss.clip_eps_low,
            eps_high=s.loss.clip_eps_high,
            dual_clip=s.loss.dual_clip,
        )
    elif s.loss.type in ("gspo", "gspo_token"):
        per_token = L.gspo_loss(
            log_ratio,
            adv_bt,
            mask_bt,
            eps_low=s.loss.clip_eps_low,
            eps_high=s.loss.clip_eps_high,
            token_level=s.loss.type == "gspo_token",
        )
    else:
        per_token = L.cispo_loss(logp_bt, prox_bt, adv_bt, max_ratio=s.loss.cispo_max_ratio)

    weight_bt, raw_w = L.importance_weights(
        prox_bt,
        behav_bt,
        mask_bt,
        mode=o.correction,
        level=o.level,
        cap=o.tis_cap,
        band=(o.mis_low, o.mis_high),
    )
    per_token = per_token * weight_bt

    kl_bt = torch.zeros_like(per_token)
    if s.kl_in_loss:
        if ref_bt is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (is the reference role running?)")
        kl_bt = L.kl_estimate(logp_bt, ref_bt, s.kl.estimator)
        per_token = per_token + s.kl.coef * kl_bt
    if s.entropy_coef and entropy_bt is not None:
        per_token = per_token - s.entropy_coef * entropy_bt

    loss_mask = mask_bt
    if o.max_token_staleness is not None and versions_bt is not None:
        loss_mask = L.staleness_mask(
            versions_bt,
            mask_bt,
            trainer_version=trainer_version,
            max_staleness=o.max_token_staleness,
        )
    loss_sum = (per_token * L.aggregation_weights(mask_bt, s.loss.agg) * loss_mask).sum()

    def total(x_bt: torch.Tensor) -> float:
        return float((x_bt.detach() * mask_bt).sum())

    log_ratio = log_ratio.detach()
    stats = {
        "is_weight_mean": total(weight_bt),
        "is_truncated_frac": total((weight_bt != raw_w).float()),
        "clip_frac": total(clipped_tokens(log_ratio, mask_bt, s.loss).float()),
        # KL(pi_prox || pi) by Schulman's k3 on tokens drawn from (about) pi_prox: 0 at ratio 1.
        "approx_kl": total(torch.expm1(log_ratio) - log_ratio),
        "kl_mean": total(kl_bt),
        "entropy_mean": total(entropy_bt) if entropy_bt is not None else 0.0,
        "mismatch_abs_sum": total((logp_bt.detach() - behav_bt).abs()),
        "stale_masked_frac": total(mask_bt - loss_mask),
        "num_tokens": float(mask_bt.sum()),
    }
    return loss_sum, stats


def clipped_tokens(
    log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor, loss: PolicyLossConfig
) -> torch.Tensor:
    """Bool `[B, T]`: the tokens whose ratio (to the proximal policy) the loss clipped. PPO: the
    token ratio outside [1 - clip_eps_low, 1 + clip_eps_high]; GSPO: the sequence ratio outside
    it; CISPO: the weight capped at `cispo_max_ratio`."""
    if loss.type == "cispo":
        return log_ratio_bt > math.log(loss.cispo_max_ratio)
    if loss.type in ("gspo", "gspo_token"):
        log_ratio_bt = L.sequence_log_ratio(log_ratio_bt, mask_bt).expand_as(log_ratio_bt)
    return (log_ratio_bt > math.log1p(loss.clip_eps_high)) | (
        log_ratio_bt < math.log1p(-min(loss.clip_eps_low, 0.999999))
    )
