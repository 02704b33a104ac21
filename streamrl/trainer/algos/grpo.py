"""GRPO math as pure functions: group advantages and the clipped, IS-corrected policy loss.

Formulas follow `shared/ALGORITHMS.md` (DeepSeekMath GRPO; DAPO clip-higher; truncated importance
sampling between the rollout engine's and the trainer's log-probs). The loss is returned as a
*sum* with its normaliser separate, so gradients accumulated over streamed micro-batches of any
size, divided by the global normaliser at the end, equal the full-batch gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards_g: torch.Tensor, *, std_eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantage of each sample in one group: (R - mean) / (unbiased std + eps).

    A group of one sample, or one where every reward is equal, has zero advantage.
    """
    if rewards_g.numel() < 2 or bool((rewards_g == rewards_g[0]).all()):
        # Exactly zero, not a rounding residue: no signal, and `skip_zero_advantage` relies on it.
        return torch.zeros_like(rewards_g)
    centred = rewards_g - rewards_g.mean()
    return centred / (rewards_g.std(unbiased=True) + std_eps)


@dataclass(frozen=True)
class LossSettings:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    tis_cap: float | None = 2.0
    loss_agg: str = "token_mean"


def token_weights(mask_bt: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """Per-token weight so that sum(weight * loss) / normaliser is the chosen aggregation.

    token_mean: every token weighs 1 and the normaliser is the batch's token count.
    seq_mean_token_mean: a token weighs 1/|o_i| and the normaliser is the number of sequences.
    """
    if loss_agg == "token_mean":
        return mask_bt
    if loss_agg == "seq_mean_token_mean":
        return mask_bt / mask_bt.sum(-1, keepdim=True).clamp_min(1.0)
    raise ValueError(f"unknown loss_agg {loss_agg!r}; use 'token_mean' or 'seq_mean_token_mean'")


def loss_normaliser(mask_bt: torch.Tensor, loss_agg: str) -> float:
    """This micro-batch's share of the global normaliser (sum the shares over a step)."""
    if loss_agg == "token_mean":
        return float(mask_bt.sum())
    return float((mask_bt.sum(-1) > 0).sum())


def policy_loss_sum(
    logprobs_bt: torch.Tensor,
    rollout_logprobs_bt: torch.Tensor,
    advantages_b: torch.Tensor,
    mask_bt: torch.Tensor,
    settings: LossSettings,
    ref_logprobs_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted *sum* of per-token GRPO losses of a micro-batch, and token statistics.

    One optimizer step per batch, so pi_old is the current policy with its gradient stopped:
    ratio = exp(l - sg(l)) is 1 in value but carries the gradient, and the clip guards later
    epochs. The gap between the rollout engine and the trainer (staleness, numerics) is corrected
    by truncated importance sampling: w = min(exp(sg(l) - l_rollout), tis_cap).
    """
    old_bt = logprobs_bt.detach()
    ratio_bt = torch.exp(logprobs_bt - old_bt)
    adv_bt = advantages_b.unsqueeze(-1).expand_as(logprobs_bt)
    unclipped = ratio_bt * adv_bt
    clipped = ratio_bt.clamp(1 - settings.clip_eps_low, 1 + settings.clip_eps_high) * adv_bt
    per_token = -torch.minimum(unclipped, clipped)

    log_is_bt = (old_bt - rollout_logprobs_bt) * mask_bt
    is_weight_bt = torch.exp(log_is_bt)
    if settings.tis_cap is not None:
        is_weight_bt = is_weight_bt.clamp(max=settings.tis_cap)
    per_token = per_token * is_weight_bt

    kl_bt = torch.zeros_like(per_token)
    if settings.kl_coef > 0:
        if ref_logprobs_bt is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (is the reference role running?)")
        delta = ref_logprobs_bt - logprobs_bt
        kl_bt = torch.exp(delta) - delta - 1  # k3 estimator
        per_token = per_token + settings.kl_coef * kl_bt

    weights_bt = token_weights(mask_bt, settings.loss_agg)
    loss_sum = (per_token * weights_bt).sum()
    num_tokens = mask_bt.sum().clamp_min(1.0)
    stats = {
        "is_weight_mean": float((is_weight_bt * mask_bt).sum() / num_tokens),
        "is_truncated_frac": float(
            ((torch.exp(log_is_bt) > settings.tis_cap) * mask_bt).sum() / num_tokens
        )
        if settings.tis_cap is not None
        else 0.0,
        "kl_mean": float((kl_bt.detach() * mask_bt).sum() / num_tokens),
        "mismatch_abs_sum": float((log_is_bt.abs() * mask_bt).sum()),
        "num_tokens": float(mask_bt.sum()),
    }
    return loss_sum, stats
