"""The algorithm library against hand-derived vectors (docs/algorithms.md) and invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.config.schema import OffPolicyConfig, PolicyLossConfig
from streamrl.trainer.algos import advantages as A
from streamrl.trainer.algos import losses as L
from streamrl.trainer.algos import shaping
from streamrl.trainer.algos.objective import LossSettings, policy_loss_sum

ONE_GROUP = torch.zeros(4, dtype=torch.long)
R = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)


# -- advantages: worked vectors ---------------------------------------------------------------------


def test_rloo_vector() -> None:
    torch.testing.assert_close(
        A.rloo_advantages(R, ONE_GROUP), torch.tensor([2, -2, -2, 2], dtype=torch.float64) / 3
    )


def test_grpo_unbiased_and_population_vectors() -> None:
    unbiased = A.grpo_advantages(R, ONE_GROUP, unbiased=True, eps=1e-4)
    assert float(unbiased[0]) == pytest.approx(0.86588, abs=1e-5)
    population = A.grpo_advantages(R, ONE_GROUP, unbiased=False, eps=1e-8)
    assert float(population[0]) == pytest.approx(0.99999998, abs=1e-9)
    torch.testing.assert_close(population, torch.sign(R - 0.5) * population[0])


def test_dr_grpo_and_batch_scaling() -> None:
    group_b = torch.tensor([0, 0, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(
        A.grpo_advantages(rewards, group_b, scale="none"),
        torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64),
    )
    batch_std = float(rewards.std())  # 0.5
    torch.testing.assert_close(
        A.grpo_advantages(rewards, group_b, scale="batch", eps=0.0),
        torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64) / batch_std,
    )


def test_groups_of_unequal_size() -> None:
    group_b = torch.tensor([0, 0, 0, 1, 1])
    rewards = torch.tensor([3.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(
        A.rloo_advantages(rewards, group_b),
        torch.tensor([3.0, -1.5, -1.5, 1.0, -1.0], dtype=torch.float64),
    )
    adv = A.grpo_advantages(rewards, group_b, eps=0.0)
    torch.testing.assert_close(
        adv[:3], torch.tensor([2.0, -1.0, -1.0], dtype=torch.float64) / 3**0.5
    )
    torch.testing.assert_close(adv[3:], torch.tensor([1.0, -1.0], dtype=torch.float64) / 2**0.5)


def test_reinforce_pp_return_to_go_and_whitening() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    kl = torch.full((2, 3), 0.5, dtype=torch.float64)
    token_rewards = A.outcome_token_rewards(torch.tensor([1.0, 0.0]).double(), mask, kl, 0.1)
    torch.testing.assert_close(
        token_rewards,
        torch.tensor([[-0.05, -0.05, 0.95], [-0.05, -0.05, 0.0]], dtype=torch.float64),
    )
    returns = A.returns_to_go(token_rewards)
    torch.testing.assert_close(
        returns, torch.tensor([[0.85, 0.9, 0.95], [-0.1, -0.05, 0.0]], dtype=torch.float64)
    )
    adv = A.reinforce_pp_advantages(torch.tensor([1.0, 0.0]).double(), mask, kl_bt=kl, kl_coef=0.1)
    valid = returns[mask.bool()]
    expected = (valid - valid.mean()) / (valid.std() + 1e-8)
    torch.testing.assert_close(adv[mask.bool()], expected)
    assert float(adv[1, 2]) == 0.0


def test_reinforce_pp_baseline_divides_by_batch_std_of_centred_rewards() -> None:
    group_b = torch.tensor([0, 0, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    centred = torch.tensor([0.5, -0.5, 1.0, -1.0], dtype=torch.float64)
    torch.testing.assert_close(
        A.reinforce_pp_baseline_advantages(rewards, group_b, eps=1e-4),
        centred / (centred.std() + 1e-4),
    )


def test_gae_by_hand() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 9.0]])  # 9.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = A.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # Row 0: deltas 0+0.9*0.6-0.5=0.04, 0+0.9*0.7-0.6=0.03, 1-0.7=0.3
    a2 = 0.3
    a1 = 0.03 + 0.45 * a2
    a0 = 0.04 + 0.45 * a1
    # Row 1: the last real token bootstraps from nothing: delta1 = 2 - 1 = 1, delta0 = 0.9 - 1.
    b1 = 1.0
    b0 = -0.1 + 0.45 * b1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2], [b0, b1, 0.0]]))
    torch.testing.assert_close(ret, (adv + values) * mask)


def test_gae_with_lambda_one_and_gamma_one_is_return_minus_value() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.8]])
    adv, ret = A.gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, 1.0 - values)
    torch.testing.assert_close(ret, torch.ones(1, 3))


# -- advantages: invariants ------------------------------------------------------------------------

group_rewards = st.lists(
    st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=2, max_size=8),
    min_size=1,
    max_size=5,
)


def _flatten(groups: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.tensor([r for g in groups for r in g], dtype=torch.float64)
    group_b = torch.tensor([i for i, g in enumerate(groups) for _ in g])
    return rewards, group_b


@given(group_rewards, st.sampled_from(["group", "batch", "none"]), st.booleans())
def test_grpo_advantages_sum_to_zero_in_every_group(groups, scale, unbiased) -> None:
    rewards, group_b = _flatten(groups)
    adv = A.grpo_advantages(rewards, group_b, scale=scale, unbiased=unbiased)
    assert torch.isfinite(adv).all()
    for g in range(len(groups)):
        assert abs(float(adv[group_b == g].sum())) < 1e-6


@given(group_rewards)
def test_rloo_advantages_sum_to_zero_and_are_a_scaled_grpo_centring(groups) -> None:
    rewards, group_b = _flatten(groups)
    adv = A.rloo_advantages(rewards, group_b)
    centred = A.grpo_advantages(rewards, group_b, scale="none")
    k = A.group_sizes(group_b).double()
    torch.testing.assert_close(adv, centred * k / (k - 1), atol=1e-9, rtol=1e-9)
    for g in range(len(groups)):
        assert abs(float(adv[group_b == g].sum())) < 1e-6


@given(group_rewards, st.floats(-3, 3), st.floats(0.1, 4))
def test_grpo_group_scale_is_invariant_to_affine_rewards(groups, shift, factor) -> None:
    rewards, group_b = _flatten(groups)
    base = A.grpo_advantages(rewards, group_b, eps=0.0)
    moved = A.grpo_advantages(rewards * factor + shift, group_b, eps=0.0)
    # Only up to rounding: an affine map can make nearly-equal rewards exactly equal or not.
    spread = torch.tensor(
        [float(rewards[group_b == g].max() - rewards[group_b == g].min()) for g in group_b]
    )
    ok = spread > 1e-3
    torch.testing.assert_close(moved[ok], base[ok], atol=1e-6, rtol=1e-5)


# -- KL, entropy -------------------------------------------------------------------------------------


def test_kl_estimators() -> None:
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])  # log(pi / pi_ref) = log 2
    assert float(L.kl_estimate(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(L.kl_estimate(logp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(L.kl_estimate(logp, ref, "k3")) == pytest.approx(0.5 + math.log(2) - 1)
    with pytest.raises(ValueError, match="k4"):
        L.kl_estimate(logp, ref, "k4")


@given(st.lists(st.floats(-4, 0), min_size=1, max_size=6), st.lists(st.floats(-4, 0), min_size=1))
def test_k2_and_k3_are_non_negative(a, b) -> None:
    n = min(len(a), len(b))
    logp, ref = torch.tensor(a[:n]), torch.tensor(b[:n])
    assert (L.kl_estimate(logp, ref, "k2") >= 0).all()
    assert (L.kl_estimate(logp, ref, "k3") >= -1e-6).all()


def test_entropy_of_uniform_and_peaked_distributions() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    torch.testing.assert_close(L.entropy_from_logits(logits), torch.tensor([[math.log(4), 0.0]]))


# -- policy losses -------------------------------------------------------------------------------------


def test_ppo_clip_and_dual_clip() -> None:
    ratio = torch.tensor([0.5, 1.5, 5.0, 5.0])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0])
    loss = L.ppo_clip_loss(ratio.log(), adv, eps_low=0.2, eps_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([-0.5, -1.28, -1.28, 5.0]))
    dual = L.ppo_clip_loss(ratio.log(), adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(dual, torch.tensor([-0.5, -1.28, -1.28, 3.0]))


def test_gspo_uses_the_length_normalised_sequence_ratio() -> None:
    log_ratio = torch.tensor([[0.1, 0.3, 9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.ones(2, 3)
    loss = L.gspo_loss(log_ratio, adv, mask, eps_low=0.5, eps_high=0.5)
    torch.testing.assert_close(loss[0], torch.full((3,), -math.exp(0.2)))
    torch.testing.assert_close(loss[1], torch.full((3,), -1.0))


def test_gspo_token_has_the_sequence_value_and_a_per_token_gradient() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    prox = torch.tensor([[-1.2, -2.2]])
    mask = torch.ones(1, 2)
    adv = torch.tensor([[1.0, 2.0]])
    loss = L.gspo_loss(logp - prox, adv, mask, eps_low=0.5, eps_high=0.5, token_level=True)
    s = math.exp(0.2)
    torch.testing.assert_close(loss.detach(), -s * adv)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, -s * adv)  # d s_t / d l_t = s_t


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    prox = torch.tensor([[-1.0 - math.log(10.0), -1.0]])  # ratios 10 and 1
    adv = torch.tensor([[1.0, 1.0]])
    loss = L.cispo_loss(logp, prox, adv, max_ratio=5.0)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-5.0, -1.0]]))


# -- off-policy corrections ----------------------------------------------------------------------------


def test_token_and_sequence_importance_weights() -> None:
    behav = torch.zeros(1, 3)
    prox = torch.log(torch.tensor([[0.25, 3.0, 9.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, raw = L.importance_weights(prox, behav, mask, mode="tis", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.25, 2.0, 1.0]]))
    torch.testing.assert_close(raw, torch.tensor([[0.25, 3.0, 1.0]]))
    w, _ = L.importance_weights(prox, behav, mask, mode="mis", band=(0.5, 2.0))
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0, 1.0]]))
    w, _ = L.importance_weights(prox, behav, mask, mode="tis", level="sequence", cap=None)
    torch.testing.assert_close(w, torch.full((1, 3), 0.75))
    w, _ = L.importance_weights(prox, behav, mask, mode="none")
    torch.testing.assert_close(w, torch.ones(1, 3))


def test_staleness_mask_is_per_token() -> None:
    versions = torch.tensor([[3.0, 3.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = L.staleness_mask(versions, mask, trainer_version=6, max_staleness=2)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))


def test_decoupled_ppo_clips_around_the_proximal_policy() -> None:
    logp = torch.tensor([[math.log(0.6)]], requires_grad=True)
    prox = torch.tensor([[math.log(0.4)]])  # ratio 1.5: clipped at 1.2 for A > 0
    behav = torch.tensor([[math.log(0.2)]])  # IS weight prox/behav = 2
    settings = LossSettings(
        loss=PolicyLossConfig(clip_eps_low=0.2, clip_eps_high=0.2),
        off_policy=OffPolicyConfig(tis_cap=None),
    )
    loss, stats = policy_loss_sum(
        logp, behav, torch.tensor([1.0]), torch.ones(1, 1), settings, prox_bt=prox
    )
    assert float(loss.detach()) == pytest.approx(-1.2 * 2.0)
    loss.backward()
    assert float(logp.grad) == 0.0  # clipped
    assert stats["clip_frac"] == 1.0


# -- aggregation: the worked vectors ---------------------------------------------------------------------

# All ratios 1, A = [1, -1], lengths [2, 4], so the per-token loss is -A.
AGG_MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
AGG_ADV = torch.tensor([1.0, -1.0])


@pytest.mark.parametrize(
    ("loss_agg", "expected"),
    [
        ("constant", 0.25),
        ("token_mean", 1 / 3),
        ("seq_mean_token_mean", 0.0),
        ("seq_mean_token_sum", 1.0),
    ],
)
def test_aggregation_vectors(loss_agg: str, expected: float) -> None:
    logp = torch.zeros(2, 4, requires_grad=True)
    settings = LossSettings(
        loss=PolicyLossConfig(agg=loss_agg),
        off_policy=OffPolicyConfig(tis_cap=None),
        agg_constant=4.0,
    )
    loss_sum, _ = policy_loss_sum(logp, logp.detach(), AGG_ADV, AGG_MASK, settings)
    normaliser = L.batch_normaliser(AGG_MASK, loss_agg, constant=4.0)
    assert float(loss_sum) / normaliser == pytest.approx(expected)


@settings(deadline=None, max_examples=30)
@given(
    st.sampled_from(L.AGGREGATIONS),
    st.lists(st.integers(0, 6), min_size=2, max_size=9),
    st.integers(0, 2**16),
    st.data(),
)
def test_micro_batch_sums_equal_the_full_batch(loss_agg, lengths, seed, data) -> None:
    """Any split into micro-batches, padded to their own widths, gives the same sum/normaliser."""
    gen = torch.Generator().manual_seed(seed)
    width = max(max(lengths), 1)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    logp = -torch.rand(len(lengths), width, generator=gen, dtype=torch.float64) * mask
    behav = logp - 0.3 * torch.rand(len(lengths), width, generator=gen, dtype=torch.float64)
    adv = torch.randn(len(lengths), width, generator=gen, dtype=torch.float64)
    s = LossSettings(loss=PolicyLossConfig(agg=loss_agg), agg_constant=7.0)
    full, _ = policy_loss_sum(logp, behav, adv, mask, s)
    cuts = sorted(data.draw(st.sets(st.integers(1, len(lengths) - 1), max_size=3)))
    parts, total = 0.0, 0.0
    for lo, hi in zip([0, *cuts], [*cuts, len(lengths)], strict=True):
        w = max(max(lengths[lo:hi]), 1)
        part, _ = policy_loss_sum(
            logp[lo:hi, :w], behav[lo:hi, :w], adv[lo:hi, :w], mask[lo:hi, :w], s
        )
        parts += float(part)
        total += L.batch_normaliser(mask[lo:hi, :w], loss_agg, 7.0)
    assert total == pytest.approx(L.batch_normaliser(mask, loss_agg, 7.0))
    assert parts == pytest.approx(float(full), abs=1e-9)


# -- reward shaping ----------------------------------------------------------------------------------------


def test_overlong_penalty() -> None:
    assert shaping.overlong_penalty(16, max_len=20, cache_len=4) == 0.0
    assert shaping.overlong_penalty(18, max_len=20, cache_len=4) == -0.5
    assert shaping.overlong_penalty(20, max_len=20, cache_len=4) == -1.0
    assert shaping.overlong_penalty(21, max_len=20, cache_len=4) == -1.0


def test_dynamic_sampling_filter() -> None:
    assert shaping.informative([1.0, 0.0, 1.0])
    assert not shaping.informative([1.0, 1.0])
    assert not shaping.informative([0.3])


def test_reward_normaliser_tracks_an_exponential_moving_mean_and_std() -> None:
    norm = shaping.RewardNormaliser(momentum=0.5, eps=0.0)
    first = norm(torch.tensor([0.0, 2.0]))
    torch.testing.assert_close(first, torch.tensor([-1.0, 1.0]))
    norm(torch.tensor([4.0, 4.0]))
    assert norm.mean == pytest.approx(0.5 * 1 + 0.5 * 4)
    assert norm.var == pytest.approx(0.5 * 1 + 0.5 * 0)
    clone = shaping.RewardNormaliser()
    clone.load_state_dict(norm.state_dict())
    assert clone.state_dict() == norm.state_dict()


def test_reward_clip() -> None:
    torch.testing.assert_close(
        shaping.clip_rewards(torch.tensor([-3.0, 0.5, 3.0]), 1.0), torch.tensor([-1.0, 0.5, 1.0])
    )
    with pytest.raises(ValueError, match="momentum"):
        shaping.RewardNormaliser(momentum=1.0)
