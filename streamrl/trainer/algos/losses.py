"""Policy losses, KL estimators, off-policy corrections and loss aggregation as pure functions.

Formulas follow `docs/algorithms.md`. Three log-probs of each response token meet here:

- `logp` (ℓ): the policy being trained, with its gradient;
- `prox` (ℓ^prox): the proximal policy the PPO ratio is clipped around. With one optimizer step
  per batch it is the current policy with its gradient stopped; with decoupled PPO it is the
  pi_old role's log-prob;
- `behav` (ℓ^behav): the behaviour policy that sampled the token (the rollout engine's
  log-prob, at whatever policy version the token carries).

The ratio ℓ - ℓ^prox is what the clip acts on; the gap ℓ^prox - ℓ^behav (staleness and
engine numerics) is corrected by an importance weight (truncated or masked, per token or per
sequence). Losses are returned per token `[B, T]`; `aggregation_weights` and `normaliser_share`
turn them into a *sum* plus a normaliser share, so micro-batches of any size accumulate to
the full-batch gradient once the summed gradient is divided by the summed normaliser.
"""

from __future__ import annotations

import torch

# -- KL and entropy --------------------------------------------------------------------------------


def kl_estimate(logp_bt: torch.Tensor, ref_bt: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = logp_bt - ref_bt  # log pi / pi_ref
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; use 'k1', 'k2' or 'k3'")


def entropy_from_logits(logits_btv: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution, `[B, T]`."""
    logp = torch.log_softmax(logits_btv.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# -- policy losses (per token, to be minimised) ---------------------------------------------------


def ppo_clip_loss(
    log_ratio_bt: torch.Tensor,
    adv_bt: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """PPO clipped surrogate, `-min(r A, clip(r, 1-eps_low, 1+eps_high) A)` (DAPO's clip-higher
    when eps_high > eps_low). Dual clip (c > 1) also bounds the loss of a negative advantage by
    `-c A`, so a huge ratio on a bad token cannot blow up the step."""
    ratio = torch.exp(log_ratio_bt)
    loss = -torch.minimum(ratio * adv_bt, ratio.clamp(1 - eps_low, 1 + eps_high) * adv_bt)
    if dual_clip is not None:
        loss = torch.where(adv_bt < 0, torch.minimum(loss, -dual_clip * adv_bt), loss)
    return loss


def sequence_log_ratio(log_ratio_bt: torch.Tensor, mask_bt: torch.Tensor) -> torch.Tensor:
    """GSPO's length-normalised sequence log-ratio, 1/|o| sum_t (ℓ - ℓ^prox), `[B, 1]`."""
    lengths = mask_bt.sum(-1, keepdim=True).clamp_min(1.0)
    return (log_ratio_bt * mask_bt).sum(-1, keepdim=True) / lengths


def gspo_loss(
    log_ratio_bt: torch.Tensor,
    adv_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    token_level: bool = False,
) -> torch.Tensor:
    """GSPO: the clipped surrogate on the sequence ratio s = exp(mean_t log-ratio), broadcast
    over the tokens. GSPO-token: s_t = sg(s) * pi(o_t) / sg(pi(o_t)), equal to s in value but
    with a per-token gradient, which admits per-token advantages."""
    seq = sequence_log_ratio(log_ratio_bt, mask_bt)
    if token_level:
        seq = seq.detach() + log_ratio_bt - log_ratio_bt.detach()
    else:
        seq = seq.expand_as(log_ratio_bt)
    return ppo_clip_loss(seq, adv_bt, eps_low=eps_low, eps_high=eps_high)


def cispo_loss(
    logp_bt: torch.Tensor, prox_bt: torch.Tensor, adv_bt: torch.Tensor, *, max_ratio: float
) -> torch.Tensor:
    """CISPO: `-sg(min(r, max_ratio)) A ℓ`: the IS ratio is clipped and detached, so every
    token keeps a gradient (none is zeroed by the clip as in PPO)."""
    ratio = torch.exp(logp_bt - prox_bt).clamp(max=max_ratio).detach()
    return -ratio * adv_bt * logp_bt


# -- off-policy correction between the proximal and the behaviour policy --------------------------


def importance_weights(
    prox_bt: torch.Tensor,
    behav_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    mode: str,
    level: str = "token",
    cap: float | None = 2.0,
    band: tuple[float, float] = (0.5, 2.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight pi_prox / pi_behav for each token, `[B, T]`, and the raw (unmodified) ratio.

    mode "tis": truncated at `cap` (truncated importance sampling); "mis": zero outside `band`
    (masked importance sampling, IcePop); "none": 1. level "token" uses each token's ratio,
    "sequence" the product over the response (one weight per sequence, broadcast).
    """
    log_w = ((prox_bt - behav_bt) * mask_bt).detach()
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    elif level != "token":
        raise ValueError(f"unknown importance-sampling level {level!r}; use 'token' or 'sequence'")
    raw = torch.exp(log_w.clamp(max=50.0))
    if mode == "none":
        return torch.ones_like(raw), raw
    if mode == "tis":
        return (raw.clamp(max=cap) if cap is not None else raw), raw
    if mode == "mis":
        keep = (raw >= band[0]) & (raw <= band[1])
        return raw * keep, raw
    raise ValueError(f"unknown importance-sampling mode {mode!r}; use 'tis', 'mis' or 'none'")


def staleness_mask(
    versions_bt: torch.Tensor, mask_bt: torch.Tensor, *, trainer_version: int, max_staleness: int
) -> torch.Tensor:
    """1 for tokens produced by a policy at most `max_staleness` versions behind the trainer.

    Per token, because an in-flight weight update changes the version in mid-response."""
    return mask_bt * ((trainer_version - versions_bt) <= max_staleness).to(mask_bt.dtype)


# -- aggregation -----------------------------------------------------------------------------------

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant")


def aggregation_weights(mask_bt: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """Per-token weight so that sum(weight * loss) / sum(normaliser shares) is the aggregation.

    | loss_agg | token weight | normaliser share of a sequence |
    | token_mean | 1 | its token count |
    | seq_mean_token_mean | 1/|o_i| | 1 |
    | seq_mean_token_sum | 1 | 1 |
    | constant (Dr. GRPO) | 1 | the constant (max response length) |
    """
    if loss_agg == "seq_mean_token_mean":
        return mask_bt / mask_bt.sum(-1, keepdim=True).clamp_min(1.0)
    if loss_agg in AGGREGATIONS:
        return mask_bt
    raise ValueError(f"unknown loss_agg {loss_agg!r}; use one of {', '.join(AGGREGATIONS)}")


def normaliser_share(num_tokens: float, loss_agg: str, constant: float = 1.0) -> float:
    """One sequence's share of the global normaliser (an empty response counts for nothing)."""
    if num_tokens <= 0:
        return 0.0
    if loss_agg == "token_mean":
        return float(num_tokens)
    if loss_agg == "constant":
        return float(constant)
    if loss_agg in AGGREGATIONS:
        return 1.0
    raise ValueError(f"unknown loss_agg {loss_agg!r}; use one of {', '.join(AGGREGATIONS)}")


def batch_normaliser(mask_bt: torch.Tensor, loss_agg: str, constant: float = 1.0) -> float:
    """The sum of the shares of every sequence of `mask_bt`."""
    return sum(normaliser_share(float(n), loss_agg, constant) for n in mask_bt.sum(-1))


# -- critic ----------------------------------------------------------------------------------------


def value_loss(
    values_bt: torch.Tensor,
    old_values_bt: torch.Tensor,
    returns_bt: torch.Tensor,
    mask_bt: torch.Tensor,
    *,
    clip: float | None,
) -> torch.Tensor:
    """Sum over tokens of PPO's clipped value loss, 0.5 max((V - R)^2, (V_clip - R)^2), where
    V_clip keeps V within `clip` of the values the advantages were computed from."""
    loss = (values_bt - returns_bt) ** 2
    if clip is not None:
        clipped = old_values_bt + (values_bt - old_values_bt).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns_bt) ** 2)
    return 0.5 * (loss * mask_bt).sum()
