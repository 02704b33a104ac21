"""Advantage estimators as pure functions of rewards (and values), one per algorithm.

Formulas follow `docs/algorithms.md`. Inputs are flat: `rewards_b` is one reward per sample
and `group_b` an integer group index per sample, so groups may have different sizes (samples
that could not be scored are simply absent). Sequence-level estimators return `[B]`; token-level
ones (REINFORCE++, GAE) take a right-padded response mask `[B, T]` and return `[B, T]`.

| estimator | advantage |
| --- | --- |
| grpo | (R - mean_group R) / (std + eps); std of the group, of the batch, or none (Dr. GRPO) |
| rloo | k/(k-1) (R - mean_group R): the leave-one-out baseline |
| reinforce_pp | return-to-go of r_t = 1[t=T] R - beta KL_t, z-scored over the batch's tokens |
| reinforce_pp_baseline | R - mean_group R, divided by the batch std of that (ms-swift's form) |
| gae | generalised advantage estimation over token rewards and critic values |
"""

from __future__ import annotations

import torch


def group_mean(values_b: torch.Tensor, group_b: torch.Tensor) -> torch.Tensor:
    """Each sample's group mean, `[B]`."""
    _, inverse, counts = torch.unique(group_b, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=values_b.dtype).index_add_(0, inverse, values_b)
    return (sums / counts.to(values_b.dtype))[inverse]


def group_sizes(group_b: torch.Tensor) -> torch.Tensor:
    """Each sample's group size, `[B]`."""
    _, inverse, counts = torch.unique(group_b, return_inverse=True, return_counts=True)
    return counts[inverse]


def group_std(values_b: torch.Tensor, group_b: torch.Tensor, *, unbiased: bool) -> torch.Tensor:
    """Each sample's group standard deviation, `[B]` (0 for a group of one)."""
    centred = values_b - group_mean(values_b, group_b)
    sizes = group_sizes(group_b).to(values_b.dtype)
    dof = (sizes - 1).clamp_min(1.0) if unbiased else sizes
    return (group_mean(centred**2, group_b) * sizes / dof).sqrt()


def _is_constant_group(values_b: torch.Tensor, group_b: torch.Tensor) -> torch.Tensor:
    """True where every member of the sample's group has the same value (or the group has one)."""
    spread = torch.zeros(len(values_b), dtype=torch.bool)
    for g in torch.unique(group_b):
        members = group_b == g
        spread[members] = bool((values_b[members] != values_b[members][0]).any())
    return ~spread


def grpo_advantages(
    rewards_b: torch.Tensor,
    group_b: torch.Tensor,
    *,
    scale: str = "group",
    unbiased: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO: the reward minus its group mean, divided by a standard deviation plus `eps`.

    scale "group" divides by the group's std (GRPO), "batch" by the std of every reward in the
    batch (Lite PPO; TRL's scale_rewards="batch"), "none" not at all (Dr. GRPO). A group whose
    rewards are all equal gets exactly zero: it carries no signal.
    """
    constant = _is_constant_group(rewards_b, group_b)
    centred = torch.where(constant, 0.0, rewards_b - group_mean(rewards_b, group_b))
    if scale == "none":
        return centred
    if scale == "group":
        std = group_std(rewards_b, group_b, unbiased=unbiased)
    elif scale == "batch":
        std = rewards_b.std(unbiased=unbiased) if len(rewards_b) > 1 else rewards_b.new_zeros(())
        std = std.expand_as(rewards_b)
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; use 'group', 'batch' or 'none'")
    # A constant group stays exactly 0 even with eps = 0 (no 0/0).
    return torch.where(constant, 0.0, centred / torch.where(constant, 1.0, std + eps))


def rloo_advantages(rewards_b: torch.Tensor, group_b: torch.Tensor) -> torch.Tensor:
    """RLOO: R_i minus the mean of the *other* rewards of its group, = k/(k-1) (R_i - mean).

    A group of one has no baseline and gets zero.
    """
    sizes = group_sizes(group_b).to(rewards_b.dtype)
    centred = rewards_b - group_mean(rewards_b, group_b)
    return torch.where(sizes > 1, centred * sizes / (sizes - 1).clamp_min(1.0), 0.0)


def outcome_token_rewards(
    rewards_b: torch.Tensor,
    mask_bt: torch.Tensor,
    kl_bt: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Token rewards `[B, T]`: the outcome reward on each response's last token, minus
    `kl_coef * KL_t` on every token when a per-token KL is given."""
    lengths_b = mask_bt.sum(-1).long()
    out_bt = torch.zeros_like(mask_bt)
    has_tokens = lengths_b > 0
    rows = torch.arange(len(rewards_b))[has_tokens]
    out_bt[rows, lengths_b[has_tokens] - 1] = rewards_b[has_tokens].to(out_bt.dtype)
    if kl_bt is not None and kl_coef:
        out_bt = out_bt - kl_coef * kl_bt * mask_bt
    return out_bt


def returns_to_go(token_rewards_bt: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted sum of the rewards from each token to the end, `[B, T]`."""
    out_bt = torch.zeros_like(token_rewards_bt)
    running = torch.zeros(token_rewards_bt.shape[0], dtype=token_rewards_bt.dtype)
    for t in reversed(range(token_rewards_bt.shape[1])):
        running = token_rewards_bt[:, t] + gamma * running
        out_bt[:, t] = running
    return out_bt


def masked_whiten(values_bt: torch.Tensor, mask_bt: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole batch; zero elsewhere."""
    count = mask_bt.sum()
    if count < 2:
        return torch.zeros_like(values_bt)
    mean = (values_bt * mask_bt).sum() / count
    var = (((values_bt - mean) * mask_bt) ** 2).sum() / (count - 1)
    return (values_bt - mean) / (var.sqrt() + eps) * mask_bt


def reinforce_pp_advantages(
    rewards_b: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    kl_bt: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++: return-to-go (gamma 1) of the KL-shaped token rewards, then z-scored over
    every response token of the batch (global batch normalisation)."""
    returns_bt = returns_to_go(outcome_token_rewards(rewards_b, mask_bt, kl_bt, kl_coef))
    return masked_whiten(returns_bt, mask_bt, eps)


def reinforce_pp_baseline_advantages(
    rewards_b: torch.Tensor, group_b: torch.Tensor, *, eps: float = 1e-4
) -> torch.Tensor:
    """REINFORCE++-baseline (ms-swift's sequence-level form): R - mean_group R, divided by the
    std of those centred rewards over the whole batch. Full groups are already zero-mean, so no
    batch mean is subtracted. (KL, when in the reward, is subtracted from R beforehand.)"""
    centred = rewards_b - group_mean(rewards_b, group_b)
    if len(centred) < 2:
        return torch.zeros_like(centred)
    return centred / (centred.std(unbiased=True) + eps)


def gae(
    token_rewards_bt: torch.Tensor,
    values_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over right-padded responses.

    delta_t = r_t + gamma V_{t+1} - V_t, with V past the last token = 0;
    A_t = delta_t + gamma lam A_{t+1}; returns_t = A_t + V_t. Returns (advantages, returns), both
    zero on padding.
    """
    values_bt = values_bt * mask_bt
    advantages_bt = torch.zeros_like(values_bt)
    next_value = torch.zeros(values_bt.shape[0], dtype=values_bt.dtype)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(values_bt.shape[1])):
        m = mask_bt[:, t]
        delta = token_rewards_bt[:, t] + gamma * next_value - values_bt[:, t]
        adv = (delta + gamma * lam * next_adv) * m
        advantages_bt[:, t] = adv
        # Padding does not carry anything back: the next real step sees V = 0, A = 0 past the end.
        next_value = values_bt[:, t] * m
        next_adv = adv
    return advantages_bt, (advantages_bt + values_bt) * mask_bt
