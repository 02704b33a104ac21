"""The trainer's objective for one micro-batch: policy loss, off-policy weight, KL, entropy.

`policy_loss_sum` composes the pure pieces of `losses.py` as the settings say and returns the
weighted *sum* of per-token losses plus statistics; the learner adds the micro-batch's
normaliser share and divides once per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamrl.trainer.algos import losses as L

POLICY_LOSSES = ("ppo", "gspo", "gspo_token", "cispo")


@dataclass(frozen=True)
class LossSettings:
    policy_loss: str = "ppo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    dual_clip: float | None = None
    cispo_max_ratio: float = 5.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    is_mode: str = "tis"
    is_level: str = "token"
    tis_cap: float | None = 2.0
    mis_band: tuple[float, float] = (0.5, 2.0)
    loss_agg: str = "token_mean"
    loss_agg_constant: float = 1.0
    max_token_staleness: int | None = None

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(
                f"unknown policy_loss {self.policy_loss!r}; use one of {', '.join(POLICY_LOSSES)}"
            )
        L.aggregation_weights(torch.zeros(1, 1), self.loss_agg)  # validates the name

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and not self.kl_in_reward

    def normaliser_share(self, num_tokens: float) -> float:
        return L.normaliser_share(num_tokens, self.loss_agg, self.loss_agg_constant)


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
    s = settings
    prox_bt = logp_bt.detach() if prox_bt is None else prox_bt
    adv_bt = advantages.unsqueeze(-1).expand_as(logp_bt) if advantages.dim() == 1 else advantages
    log_ratio = logp_bt - prox_bt
    if s.policy_loss == "ppo":
        per_token = L.ppo_clip_loss(
            log_ratio,
            adv_bt,
            eps_low=s.clip_eps_low,
            eps_high=s.clip_eps_high,
            dual_clip=s.dual_clip,
        )
    elif s.policy_loss in ("gspo", "gspo_token"):
        per_token = L.gspo_loss(
            log_ratio,
            adv_bt,
            mask_bt,
            eps_low=s.clip_eps_low,
            eps_high=s.clip_eps_high,
            token_level=s.policy_loss == "gspo_token",
        )
    else:
        per_token = L.cispo_loss(logp_bt, prox_bt, adv_bt, max_ratio=s.cispo_max_ratio)

    weight_bt, raw_w = L.importance_weights(
        prox_bt, behav_bt, mask_bt, mode=s.is_mode, level=s.is_level, cap=s.tis_cap, band=s.mis_band
    )
    per_token = per_token * weight_bt

    kl_bt = torch.zeros_like(per_token)
    if s.kl_in_loss:
        if ref_bt is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (is the reference role running?)")
        kl_bt = L.kl_estimate(logp_bt, ref_bt, s.kl_estimator)
        per_token = per_token + s.kl_coef * kl_bt
    if s.entropy_coef and entropy_bt is not None:
        per_token = per_token - s.entropy_coef * entropy_bt

    loss_mask = mask_bt
    if s.max_token_staleness is not None and versions_bt is not None:
        loss_mask = L.staleness_mask(
            versions_bt,
            mask_bt,
            trainer_version=trainer_version,
            max_staleness=s.max_token_staleness,
        )
    loss_sum = (per_token * L.aggregation_weights(mask_bt, s.loss_agg) * loss_mask).sum()

    def total(x_bt: torch.Tensor) -> float:
        return float((x_bt.detach() * mask_bt).sum())

    clipped = (log_ratio.detach().abs() > 0) & (
        (log_ratio.detach() > torch.log1p(torch.tensor(s.clip_eps_high)))
        | (log_ratio.detach() < torch.log1p(torch.tensor(-min(s.clip_eps_low, 0.999999))))
    )
    stats = {
        "is_weight_mean": total(weight_bt),
        "is_truncated_frac": total((weight_bt != raw_w).float()),
        "clip_frac": total(clipped.float()),
        "kl_mean": total(kl_bt),
        "entropy_mean": total(entropy_bt) if entropy_bt is not None else 0.0,
        "mismatch_abs_sum": total((logp_bt.detach() - behav_bt).abs()),
        "stale_masked_frac": total(mask_bt - loss_mask),
        "num_tokens": float(mask_bt.sum()),
    }
    return loss_sum, stats
