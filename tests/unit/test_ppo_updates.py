"""PPO mini-batches and epochs (`trainer/updates.py`): which groups each optimizer update trains,
and one update's loss and parameter change reproduced by hand from the weights it started at."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamrl.api import fields as F
from streamrl.config.schema import OffPolicyConfig, PolicyLossConfig
from streamrl.models.loading import load_causal_lm
from streamrl.trainer.algos.objective import LossSettings
from streamrl.trainer.learner import Learner
from streamrl.trainer.logprobs import pack, response_logprobs
from streamrl.trainer.service import BatchTrainer
from streamrl.trainer.updates import UpdatePlan, mini_batches

PAD_ID = 0
LR = 0.5


def test_each_epoch_trains_every_group_once_in_an_order_fixed_by_seed_and_version() -> None:
    ids = [f"b3-p{i}" for i in range(7)]
    updates = mini_batches(ids, 2, epochs=3, seed=5, version=3)
    assert [len(u) for u in updates] == [2, 2, 2, 1] * 3
    for epoch in range(3):
        assert sorted(g for u in updates[4 * epoch : 4 * epoch + 4] for g in u) == sorted(ids)
    # A function of the ids (not their arrival order), the seed and the version alone.
    assert mini_batches(ids[::-1], 2, epochs=3, seed=5, version=3) == updates
    assert mini_batches(ids, 2, epochs=3, seed=5, version=4) != updates
    assert mini_batches(ids, None, epochs=1, seed=0, version=0)[0] != []
    assert mini_batches([], 2, epochs=2, seed=0, version=0) == [[]]  # still one update


def test_several_updates_only_when_the_plan_asks_for_them() -> None:
    assert not UpdatePlan().several(32)
    assert not UpdatePlan(mini_batch_groups=32).several(32)
    assert UpdatePlan(mini_batch_groups=8).several(32)
    assert UpdatePlan(epochs=2).several(32)


def make_learner(model_dir: Path, correction: str = "tis") -> Learner:
    learner = Learner(
        load_causal_lm(model_dir),
        pad_token_id=PAD_ID,
        lr=LR,
        weight_decay=0.0,
        grad_clip=None,
        temperature=1.0,
        lr_schedule="constant",
        settings=LossSettings(
            loss=PolicyLossConfig(agg="token_mean"),
            off_policy=OffPolicyConfig(correction=correction, tis_cap=2.0),
        ),
    )
    # Plain SGD: an update is -lr times the normalised gradient, checkable by hand.
    learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=LR)
    return learner


def group_rows(num_groups: int, group_size: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of a step: group 1's rewards are all equal (zero advantage, skipped, still in the
    normaliser); the behaviour log-probs are near the model's (about -4.9) for even rows."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(num_groups):
        rewards = np.zeros(group_size) if g == 1 else (np.arange(group_size) + g) % 2.0
        centred = rewards - rewards.mean()
        advantages = centred / (rewards.std(ddof=1) + 1e-4)
        for i in range(group_size):
            n = int(rng.integers(2, 7))
            low, high = (-5.0, -4.8) if i % 2 == 0 else (-6.0, -5.5)
            rows.append(
                {
                    "sample_id": f"g{g}-s{i}",
                    "group_id": f"g{g}",
                    F.PROMPT_IDS: rng.integers(5, 100, size=int(rng.integers(2, 8))).tolist(),
                    F.RESPONSE_IDS: rng.integers(5, 100, size=n).tolist(),
                    F.ROLLOUT_LOGPROBS: rng.uniform(low, high, size=n).tolist(),
                    F.VERSIONS: [0] * n,
                    F.FINISH_REASON: "stop",
                    F.REWARD: float(rewards[i]),
                    F.REWARD_STATUS: "ok",
                    F.ADVANTAGES: float(advantages[i]),
                }
            )
    return rows


def logprobs_of(model, rows) -> torch.Tensor:
    """`[B, T]` response log-probs, the plain forward (with its graph)."""
    batch = pack([r[F.PROMPT_IDS] for r in rows], [r[F.RESPONSE_IDS] for r in rows], PAD_ID)
    return response_logprobs(model, batch), batch.response_mask_br


def padded(mask_bt: torch.Tensor, seqs) -> torch.Tensor:
    out = torch.zeros_like(mask_bt)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(np.asarray(s, dtype=np.float32))
    return out


def record_updates(learner: Learner) -> list[dict[str, Any]]:
    """Wrap `accumulate` and `step` to keep, per optimizer update, the rows it trained, the
    skipped normaliser share, the weights it started from and what it returned."""
    updates: list[dict[str, Any]] = []
    accumulate, step = learner.accumulate, learner.step
    current: dict[str, Any] = {"rows": [], "skipped": 0.0}

    def on_accumulate(rows, *, num_skipped_tokens=0.0):
        if not current["rows"] and "weights" not in current:
            current["weights"] = copy.deepcopy(learner.model.state_dict())
        current["rows"].extend(rows)
        current["skipped"] += num_skipped_tokens
        accumulate(rows, num_skipped_tokens=num_skipped_tokens)

    def on_step(**kwargs):
        current.setdefault("weights", copy.deepcopy(learner.model.state_dict()))
        out = step(**kwargs)
        updates.append({**current, "out": out, "version_after": learner.version})
        current.clear()
        current.update({"rows": [], "skipped": 0.0})
        return out

    learner.accumulate, learner.step = on_accumulate, on_step
    return updates


def test_one_mini_batch_update_reproduced_by_hand(model_dir: Path) -> None:
    learner = make_learner(model_dir)
    rows = group_rows(num_groups=4, group_size=3)
    pi_old_model = copy.deepcopy(learner.model)
    plan = UpdatePlan(epochs=2, mini_batch_groups=2, micro_batch_rows=2, seed=0)
    trainer = BatchTrainer(learner, skip_zero_advantage=True, max_staleness=None, updates=plan)
    updates = record_updates(learner)
    trainer.train_microbatch(rows[7:])  # groups arrive in any order and split
    trainer.train_microbatch(rows[:7])
    metrics = trainer.finish()["metrics"]

    # 2 epochs x 2 mini-batches of 2 groups, one version, one learning rate.
    assert metrics["train/optimizer_steps"] == 4 == len(updates)
    assert [u["version_after"] for u in updates] == [0, 0, 0, 1]
    assert {u["out"]["lr"] for u in updates} == {LR}
    expected_groups = mini_batches(["g0", "g1", "g2", "g3"], 2, epochs=2, seed=0, version=0)
    skipped_tokens = sum(len(r[F.RESPONSE_IDS]) for r in rows if r["group_id"] == "g1")
    for update, groups in zip(updates, expected_groups, strict=True):
        assert {r["group_id"] for r in update["rows"]} == set(groups) - {"g1"}
        assert update["skipped"] == (skipped_tokens if "g1" in groups else 0.0)

    # The last update, by hand: the PPO clip around pi_old (the weights before the first
    # update), the truncated IS weight pi_old / behaviour, token mean over the mini-batch.
    last = updates[-1]
    mb_rows = last["rows"]
    model = copy.deepcopy(learner.model)
    model.load_state_dict(last["weights"])
    model.train()
    logp_bt, mask_bt = logprobs_of(model, mb_rows)
    with torch.no_grad():
        old_bt, _ = logprobs_of(pi_old_model.train(), mb_rows)
    behav_bt = padded(mask_bt, [r[F.ROLLOUT_LOGPROBS] for r in mb_rows])
    adv_bt = torch.tensor([r[F.ADVANTAGES] for r in mb_rows]).unsqueeze(-1).expand_as(logp_bt)
    ratio_bt = torch.exp(logp_bt - old_bt)
    surrogate_bt = torch.minimum(ratio_bt * adv_bt, ratio_bt.clamp(0.8, 1.2) * adv_bt)
    weight_bt = torch.exp(old_bt - behav_bt).clamp(max=2.0)
    normaliser = float(mask_bt.sum()) + last["skipped"]
    loss = -(surrogate_bt * weight_bt * mask_bt).sum() / normaliser
    loss.backward()

    out = last["out"]
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-4, abs=1e-6)
    ratio = ratio_bt.detach()[mask_bt.bool()]
    clip_frac = float(((ratio < 0.8) | (ratio > 1.2)).float().mean())
    assert out["clip_frac"] == pytest.approx(clip_frac, abs=1e-6)
    assert out["approx_kl"] == pytest.approx(float((ratio - 1 - ratio.log()).mean()), rel=1e-3)
    assert out["approx_kl"] > 0
    # SGD: the update moved each parameter by -lr times the hand-made loss's gradient.
    after = dict(learner.model.named_parameters())
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        moved = after[name].detach() - last["weights"][name]
        torch.testing.assert_close(moved, -LR * p.grad, atol=2e-6, rtol=1e-3, msg=name)

    # The batch's metrics: clipped tokens once the weights moved; every token of the batch
    # counted once however many epochs; the mismatch measured before the first update.
    assert updates[0]["out"]["clip_frac"] == 0.0
    assert metrics["train/clip_frac"] > 0
    trained = [r for r in rows if r["group_id"] != "g1"]
    assert metrics["train/trained_tokens"] == sum(len(r[F.RESPONSE_IDS]) for r in trained)
    # Forward/backward passes of 2 rows at most: 3 for 2 groups of 3 rows, 2 with g1 skipped.
    assert metrics["train/micro_batches"] == sum(-(-len(u["rows"]) // 2) for u in updates) == 10
    assert learner.version == 1


def test_one_update_with_the_plan_matches_the_streaming_step(model_dir: Path) -> None:
    # One epoch, one mini-batch: pi_old from the trainer's forward before the update equals the
    # current policy with its gradient stopped, so the step is the streaming one.
    rows = group_rows(num_groups=3, group_size=4, seed=1)
    held = BatchTrainer(
        make_learner(model_dir),
        skip_zero_advantage=True,
        max_staleness=None,
        updates=UpdatePlan(micro_batch_rows=5),
    )
    streamed = BatchTrainer(make_learner(model_dir), skip_zero_advantage=True, max_staleness=None)
    for trainer in (held, streamed):
        trainer.train_microbatch(rows[:6])
        trainer.train_microbatch(rows[6:])
    out_held, out_streamed = held.finish()["metrics"], streamed.finish()["metrics"]
    assert out_held["train/optimizer_steps"] == out_streamed["train/optimizer_steps"] == 1
    assert out_held["train/loss"] == pytest.approx(out_streamed["train/loss"], abs=1e-6)
    assert out_held["train/clip_frac"] == 0.0 and out_held["train/approx_kl"] < 1e-10
    for (name, a), b in zip(
        held.learner.model.named_parameters(), streamed.learner.model.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_decoupled_ppo_clips_around_the_pi_old_roles_logprobs(model_dir: Path) -> None:
    # proximal=pi_old: every update takes its ratio against the role's `old_logprobs`, not the
    # trainer's own forward; with old_logprobs far below the model's, every ratio is clipped.
    learner = make_learner(model_dir)
    learner.settings = LossSettings(
        loss=PolicyLossConfig(agg="token_mean"), off_policy=OffPolicyConfig(proximal="pi_old")
    )
    rows = group_rows(num_groups=2, group_size=3, seed=2)
    for r in rows:
        r[F.OLD_LOGPROBS] = [-9.0] * len(r[F.RESPONSE_IDS])
    trainer = BatchTrainer(
        learner,
        skip_zero_advantage=True,
        max_staleness=None,
        updates=UpdatePlan(epochs=2, micro_batch_rows=4),
    )
    trainer.train_microbatch(rows)
    metrics = trainer.finish()["metrics"]
    assert metrics["train/optimizer_steps"] == 2
    assert metrics["train/clip_frac"] == 1.0
