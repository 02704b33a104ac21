"""GRPO math (group advantages, the IS-corrected clipped loss) and the learner's gradient
accumulation, which must not depend on how a step's samples are split into micro-batches."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from streamrl.api import fields as F
from streamrl.config.schema import KLConfig, OffPolicyConfig, PolicyLossConfig
from streamrl.models.loading import load_causal_lm
from streamrl.trainer.algos.advantages import grpo_advantages
from streamrl.trainer.algos.losses import AGGREGATIONS
from streamrl.trainer.algos.losses import aggregation_weights as token_weights
from streamrl.trainer.algos.losses import batch_normaliser as loss_normaliser
from streamrl.trainer.algos.objective import LossSettings, policy_loss_sum
from streamrl.trainer.learner import Learner
from streamrl.trainer.service import BatchTrainer, is_zero


def group_advantages(rewards_g: torch.Tensor, std_eps: float = 1e-4) -> torch.Tensor:
    """One group's GRPO advantages."""
    return grpo_advantages(rewards_g, torch.zeros(len(rewards_g), dtype=torch.long), eps=std_eps)


# -- group advantages -----------------------------------------------------------------------------


def test_group_advantages_test_vector() -> None:
    # docs/algorithms.md: unbiased std 0.57735, eps 1e-4.
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), std_eps=1e-4)
    expected = 0.5 / (1 / math.sqrt(3) + 1e-4)
    assert expected == pytest.approx(0.86588, abs=1e-5)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, -expected, expected]))


def test_equal_rewards_and_single_samples_have_zero_advantage() -> None:
    assert torch.equal(group_advantages(torch.tensor([1.0, 1.0, 1.0])), torch.zeros(3))
    assert torch.equal(group_advantages(torch.tensor([0.0, 0.0])), torch.zeros(2))
    assert torch.equal(group_advantages(torch.tensor([0.7])), torch.zeros(1))


def test_equal_fractional_rewards_have_zero_advantage() -> None:
    assert torch.equal(group_advantages(torch.full((7,), 0.1)), torch.zeros(7))


def test_equal_rewards_with_no_epsilon_have_zero_advantage() -> None:
    assert torch.equal(group_advantages(torch.ones(4), std_eps=0.0), torch.zeros(4))


@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=2, max_size=16))
def test_group_advantages_sum_to_zero_and_are_bounded(rewards: list[float]) -> None:
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64))
    n = len(rewards)
    assert abs(float(adv.sum())) < 1e-6
    assert float(adv.abs().max()) <= (n - 1) / math.sqrt(n) + 1e-9  # the largest z-score


# -- the policy loss --------------------------------------------------------------------------------

LENGTHS = [5, 2, 3]


def loss_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Leaf log-probs [3, 5] with a gradient, advantages [3] and a right-padded mask [3, 5]."""
    gen = torch.Generator().manual_seed(seed)
    mask_bt = torch.zeros(3, 5)
    for i, n in enumerate(LENGTHS):
        mask_bt[i, :n] = 1.0
    logprobs_bt = (-torch.rand(3, 5, generator=gen) * 3 * mask_bt).requires_grad_()
    advantages_b = torch.tensor([0.8, -1.5, 0.3])
    return logprobs_bt, advantages_b, mask_bt


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_on_policy_gradient_is_minus_advantage_times_weight(loss_agg: str) -> None:
    logprobs_bt, advantages_b, mask_bt = loss_inputs()
    settings = LossSettings(
        loss=PolicyLossConfig(agg=loss_agg), off_policy=OffPolicyConfig(tis_cap=None)
    )
    loss, stats = policy_loss_sum(
        logprobs_bt, logprobs_bt.detach().clone(), advantages_b, mask_bt, settings
    )
    loss.backward()
    lengths_b1 = torch.tensor(LENGTHS, dtype=torch.float32).unsqueeze(-1)
    weight_bt = mask_bt if loss_agg == "token_mean" else mask_bt / lengths_b1
    torch.testing.assert_close(logprobs_bt.grad, -advantages_b.unsqueeze(-1) * weight_bt)
    assert stats["is_weight_mean"] == pytest.approx(sum(LENGTHS))  # a sum; the learner divides
    assert stats["num_tokens"] == sum(LENGTHS)
    assert stats["mismatch_abs_sum"] == 0.0


def test_truncated_importance_weight() -> None:
    logprobs_bt, advantages_b, mask_bt = loss_inputs()
    # log(pi_trainer / pi_rollout) per token; padding columns get huge gaps that must not count.
    ratios_bt = torch.tensor(
        [[0.5, 1.5, 3.0, 10.0, 1.0], [2.5, 0.9, 50.0, 50.0, 50.0], [1.0, 1.0, 4.0, 50.0, 50.0]]
    )
    rollout_bt = logprobs_bt.detach() - torch.log(ratios_bt)
    loss, stats = policy_loss_sum(
        logprobs_bt,
        rollout_bt,
        advantages_b,
        mask_bt,
        LossSettings(off_policy=OffPolicyConfig(tis_cap=2.0)),
    )
    loss.backward()
    weight_bt = ratios_bt.clamp(max=2.0) * mask_bt
    torch.testing.assert_close(logprobs_bt.grad, -advantages_b.unsqueeze(-1) * weight_bt)
    num_tokens = sum(LENGTHS)
    assert stats["is_truncated_frac"] == pytest.approx(4)  # 3.0, 10.0, 2.5, 4.0 (a count)
    assert stats["num_tokens"] == num_tokens
    assert stats["is_weight_mean"] == pytest.approx(float(weight_bt.sum()))
    expected_mismatch = float((torch.log(ratios_bt).abs() * mask_bt).sum())
    assert stats["mismatch_abs_sum"] == pytest.approx(expected_mismatch, rel=1e-5)


def test_without_a_cap_the_importance_weight_is_not_truncated() -> None:
    logprobs_bt, advantages_b, mask_bt = loss_inputs()
    rollout_bt = logprobs_bt.detach() - math.log(3.0)
    loss, stats = policy_loss_sum(
        logprobs_bt,
        rollout_bt,
        advantages_b,
        mask_bt,
        LossSettings(off_policy=OffPolicyConfig(tis_cap=None)),
    )
    loss.backward()
    torch.testing.assert_close(logprobs_bt.grad, -3.0 * advantages_b.unsqueeze(-1) * mask_bt)
    assert stats["is_truncated_frac"] == 0.0


def test_kl_penalty_uses_the_k3_estimator() -> None:
    logprobs_bt, _, mask_bt = loss_inputs()
    ref_bt = logprobs_bt.detach() + math.log(2.0)  # pi_ref / pi = 2
    settings = LossSettings(kl=KLConfig(coef=0.5), off_policy=OffPolicyConfig(tis_cap=None))
    loss, stats = policy_loss_sum(
        logprobs_bt, logprobs_bt.detach(), torch.zeros(3), mask_bt, settings, ref_bt=ref_bt
    )
    loss.backward()
    assert stats["kl_mean"] / stats["num_tokens"] == pytest.approx(2.0 - math.log(2.0) - 1.0)
    # d/dl [exp(ref - l) - (ref - l) - 1] = 1 - pi_ref / pi = -1
    torch.testing.assert_close(logprobs_bt.grad, -0.5 * mask_bt)


def test_kl_penalty_needs_reference_logprobs() -> None:
    logprobs_bt, advantages_b, mask_bt = loss_inputs()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss_sum(
            logprobs_bt,
            logprobs_bt.detach(),
            advantages_b,
            mask_bt,
            LossSettings(kl=KLConfig(coef=0.1)),
        )


def test_token_weights_and_normaliser() -> None:
    mask_bt = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(token_weights(mask_bt, "token_mean"), mask_bt)
    torch.testing.assert_close(
        token_weights(mask_bt, "seq_mean_token_mean").sum(-1), torch.tensor([1.0, 1.0, 0.0])
    )
    assert loss_normaliser(mask_bt, "token_mean") == 5.0
    assert loss_normaliser(mask_bt, "seq_mean_token_mean") == 2.0  # empty rows do not count
    with pytest.raises(ValueError, match="unknown loss_agg 'seq_sum'.*token_mean"):
        token_weights(mask_bt, "seq_sum")


# -- the learner -----------------------------------------------------------------------------------

PAD_ID = 0
CONSTANT = 6.0  # the constant normaliser per sequence (Dr. GRPO's max length)


def make_learner(
    model_dir: Path, loss_agg: str = "token_mean", *, compile: bool = False, **schedule: Any
) -> Learner:
    learner = Learner(
        load_causal_lm(model_dir),
        pad_token_id=PAD_ID,
        lr=1.0,
        weight_decay=0.0,
        grad_clip=None,
        temperature=1.0,
        settings=LossSettings(loss=PolicyLossConfig(agg=loss_agg), agg_constant=CONSTANT),
        compile=compile,
        **schedule,
    )
    # Plain SGD: the update is the normalised gradient itself (Adam would hide its scale).
    learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=1.0)
    return learner


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_warmup_rises_linearly_then_the_schedule_runs_over_the_steps_left(
    model_dir: Path, schedule: str
) -> None:
    def learner(**steps: int) -> Learner:
        return make_learner(model_dir, lr_schedule=schedule, min_lr_ratio=0.1, **steps)

    warm, after = learner(warmup_steps=4, total_steps=14), learner(total_steps=10)
    assert [warm.lr_at(v) for v in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert [warm.lr_at(v) for v in range(4, 14)] == [after.lr_at(v) for v in range(10)]
    assert warm.lr_at(4) == 1.0
    assert warm.lr_at(13) == pytest.approx(1.0 if schedule == "constant" else 0.1)
    assert learner(warmup_steps=20, total_steps=14).lr_at(13) == pytest.approx(14 / 21)


def random_rows(num: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    advantages = [0.7, -1.2, 0.0, 0.5, 0.0, -0.3, 1.1]
    rows = []
    for i in range(num):
        num_response = int(rng.integers(1, 7))
        rows.append(
            {
                "prompt_ids": rng.integers(5, 100, size=int(rng.integers(2, 8))).tolist(),
                "response_ids": rng.integers(5, 100, size=num_response).tolist(),
                # The model's log-probs are about -4.9: odd rows are far off-policy (IS weight
                # truncated), even rows near it; neither near the cap, where rounding could flip.
                "rollout_logprobs": rng.uniform(-5.0, -4.8, size=num_response).tolist()
                if i % 2 == 0
                else rng.uniform(-7.5, -7.0, size=num_response).tolist(),
                "advantages": advantages[i % len(advantages)],
            }
        )
    return rows


def skip_zero_advantage(
    rows: Sequence[dict[str, Any]], loss_agg: str
) -> tuple[list[dict[str, Any]], float]:
    """What the trainer role does: leave zero-advantage rows out, keep their normaliser share."""
    kept = [r for r in rows if not is_zero(r["advantages"])]
    skipped = [r for r in rows if is_zero(r["advantages"])]
    settings = LossSettings(loss=PolicyLossConfig(agg=loss_agg), agg_constant=CONSTANT)
    share = sum(settings.normaliser_share(len(r["response_ids"])) for r in skipped)
    return kept, share


def grads(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}


def params(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("loss_agg", AGGREGATIONS)
def test_step_gradient_does_not_depend_on_micro_batches(
    model_dir: Path, loss_agg: str, per_token: bool
) -> None:
    rows = random_rows(7)
    if per_token:  # REINFORCE++ / GAE style: one advantage per token (zero rows stay zero)
        for i, r in enumerate(rows):
            n = len(r["response_ids"])
            r["advantages"] = np.linspace(-1, 1, n) * (i + 1) if r["advantages"] else np.zeros(n)
    whole = make_learner(model_dir, loss_agg)
    split = make_learner(model_dir, loss_agg)
    before = params(whole)

    whole.accumulate(rows)
    for part in (rows[:1], rows[1:5], rows[5:]):  # uneven, zero-advantage rows skipped
        kept, share = skip_zero_advantage(part, loss_agg)
        split.accumulate(kept, num_skipped_tokens=share)

    expected_normaliser = {
        "token_mean": sum(len(r["response_ids"]) for r in rows),
        "seq_mean_token_mean": len(rows),
        "seq_mean_token_sum": len(rows),
        "constant": len(rows) * CONSTANT,
    }[loss_agg]
    assert whole._normaliser == split._normaliser == expected_normaliser
    grads_whole, grads_split = grads(whole), grads(split)
    assert grads_whole.keys() == grads_split.keys() and grads_whole
    assert any(g.abs().sum() > 0 for g in grads_whole.values())
    for name, g in grads_whole.items():
        # fp32 rounding of sums in a different order: tolerance relative to the largest entry
        atol = 1e-6 * max(1.0, float(g.abs().max()))
        torch.testing.assert_close(grads_split[name], g, atol=atol, rtol=1e-5, msg=name)

    out_whole, out_split = whole.step(), split.step()
    assert out_whole["loss"] == pytest.approx(out_split["loss"], abs=1e-6)
    assert 0 < out_whole["is_truncated_frac"] < 1
    assert whole.version == split.version == 1
    after_whole, after_split = params(whole), params(split)
    for name, g in grads_whole.items():
        # SGD with lr 1: the step moved each parameter by minus the normalised gradient.
        torch.testing.assert_close(
            before[name] - after_whole[name], g / expected_normaliser, atol=1e-6, rtol=1e-5
        )
        # The two gradients may differ by the tolerance above; the step scales that by
        # 1 / normaliser, on top of the parameters' own fp32 rounding.
        atol = 1e-6 + 1e-6 * max(1.0, float(g.abs().max())) / expected_normaliser
        torch.testing.assert_close(after_split[name], after_whole[name], atol=atol, rtol=0)


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_mask_truncated_leaves_cut_responses_out_of_loss_and_normaliser(
    model_dir: Path, loss_agg: str
) -> None:
    # DAPO's overlong filtering: the step is the step of the rows that finished, as if the
    # truncated ones had never been sampled; without it they train like any other row.
    rows = random_rows(7, seed=2)
    for i, r in enumerate(rows):
        r.update(
            {
                "sample_id": f"s{i}",
                F.REWARD: 1.0,
                F.REWARD_STATUS: "ok",
                F.VERSIONS: [0] * len(r["response_ids"]),
                F.FINISH_REASON: "length" if i in (0, 3) else "stop",
            }
        )
    assert not is_zero(rows[0]["advantages"]) and not is_zero(rows[3]["advantages"])
    finished = [r for i, r in enumerate(rows) if i not in (0, 3)]
    masked = BatchTrainer(
        make_learner(model_dir, loss_agg),
        skip_zero_advantage=True,
        max_staleness=0,
        mask_truncated=True,
    )
    plain = BatchTrainer(
        make_learner(model_dir, loss_agg), skip_zero_advantage=True, max_staleness=0
    )
    reference = make_learner(model_dir, loss_agg)
    for part in (rows[:4], rows[4:]):
        masked.train_microbatch(part)
        plain.train_microbatch(part)
    kept, share = skip_zero_advantage(finished, loss_agg)
    reference.accumulate(kept, num_skipped_tokens=share)

    assert masked.dropped == {"truncated": 2} and not plain.dropped
    assert masked.trained_ids == [r["sample_id"] for r in finished]
    assert len(plain.trained_ids) == len(rows)
    assert masked.learner._normaliser == reference._normaliser < plain.learner._normaliser
    expected = grads(reference)
    for name, g in grads(masked.learner).items():
        torch.testing.assert_close(g, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(not torch.allclose(g, expected[name]) for name, g in grads(plain.learner).items())


def test_a_step_that_trains_nothing_says_why_once(model_dir: Path, caplog) -> None:
    trainer = BatchTrainer(
        make_learner(model_dir), skip_zero_advantage=True, max_staleness=0, mask_truncated=True
    )
    for _ in range(2):
        rows = random_rows(3)
        for i, r in enumerate(rows):
            r.update(
                {
                    "sample_id": f"s{i}",
                    F.REWARD: 1.0,
                    F.REWARD_STATUS: "ok",
                    F.VERSIONS: [trainer.learner.version] * len(r["response_ids"]),
                    F.FINISH_REASON: "length",
                }
            )
        trainer.train_microbatch(rows)
        record = trainer.finish()
        assert record["trained_ids"] == [] and record["metrics"]["samples/dropped_truncated"] == 3
    warnings = [r.getMessage() for r in caplog.records if "trained none" in r.getMessage()]
    assert warnings == [
        "step 1 trained none of its 3 samples (dropped: truncated 3); every response reached "
        "rollout.max_new_tokens under algorithm.shaping.mask_truncated: raise the one or turn off the "
        "other. Said once; later such steps show in the metrics only."
    ]


def test_a_compiled_learner_trains_like_the_eager_one(model_dir: Path) -> None:
    # trainer.compile: the same gradients, losses and updates, over micro-batches of different
    # shapes (dynamic shapes: one compilation serves them all), with the model itself untouched
    # for evaluation and the engine.
    from torch._dynamo.utils import counters

    eager, compiled = (
        make_learner(model_dir, "token_mean"),
        make_learner(model_dir, "token_mean", compile=True),
    )
    assert compiled.forward_model is not compiled.model and eager.forward_model is eager.model
    graphs_before = counters["stats"]["unique_graphs"]
    for seed in (0, 1):
        rows = random_rows(5 + 2 * seed, seed=seed)
        for learner in (eager, compiled):
            learner.accumulate(rows[:3])
            learner.accumulate(rows[3:])
        expected = grads(eager)
        for name, g in grads(compiled).items():
            atol = 1e-6 * max(1.0, float(expected[name].abs().max()))
            torch.testing.assert_close(g, expected[name], atol=atol, rtol=1e-5, msg=name)
        out_eager, out_compiled = eager.step(), compiled.step()
        assert out_compiled["loss"] == pytest.approx(out_eager["loss"], abs=1e-6)
    for name, p in params(compiled).items():
        torch.testing.assert_close(p, params(eager)[name], atol=1e-5, rtol=1e-5, msg=name)
    # Compiled indeed (a failed compilation would fall back to eager and pass the checks above),
    # into one graph for both shapes.
    assert counters["stats"]["unique_graphs"] - graphs_before == 1


def test_step_reports_trained_tokens_and_resets(model_dir: Path) -> None:
    learner = make_learner(model_dir, "token_mean")
    rows = random_rows(3, seed=1)
    learner.accumulate(rows)
    out = learner.step()
    assert out["trained_tokens"] == sum(len(r["response_ids"]) for r in rows)
    assert out["logprob_mismatch"] > 0
    assert all(p.grad is None for p in learner.model.parameters())
    assert learner._normaliser == 0.0
