"""LoRA on two FSDP2 ranks (`trainer.world_size=2`, gloo on CPU) trains as LoRA in one process
does: the trainer role's own learners (`make_learner`), fed the same rows, report the same loss
(KL term included: the reference log-probs come from each rank's model with the adapters
disabled, and a rank with no rows joins that forward) and publish the same merged weights; the
checkpoint holds the adapter, and two ranks resumed from it continue where one process does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.api.run import RunContext
from streamrl.config import load_config
from streamrl.trainer.checkpoint import load_checkpoint, save_checkpoint
from streamrl.trainer.lora import LoraLearner
from streamrl.trainer.ranks import RankedLearner, ShardedLoraLearner
from streamrl.trainer.role import make_learner
from tests.unit.test_lora import LORA, rows

pytestmark = pytest.mark.timeout(300)

SETTINGS = [*LORA, "algorithm.lr_schedule=constant", "algorithm.kl.coef=0.1"]


def learner(model_dir: Path, tmp_path: Path, world_size: int):
    cfg = load_config([*SETTINGS, f"trainer.world_size={world_size}"])
    return make_learner(RunContext(cfg, model_dir, tmp_path, [], []))


def step(learner, seed: int) -> dict[str, float]:
    """Six rows split over the ranks, then one row alone: rank 1 gets none of it."""
    batch = rows(seed=seed)
    learner.accumulate(batch[:6])
    learner.accumulate(rows(num=1, seed=100 + seed))
    return learner.step()


def assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_two_lora_ranks_train_and_resume_as_one_process(model_dir: Path, tmp_path: Path) -> None:
    # One process first: rank 0 below joins a process group, and a `Learner` in a process with
    # one all-reduces across it.
    one = learner(model_dir, tmp_path, 1)
    assert isinstance(one, LoraLearner)
    expected_weights = [one.named_weights()]
    expected = []
    for seed in (0, 1, 2):
        expected.append(step(one, seed))
        expected_weights.append(one.named_weights())
    assert expected[1]["kl_mean"] > 0  # B moved at step 1: the reference term is live

    two = learner(model_dir, tmp_path, 2)
    try:
        assert isinstance(two, RankedLearner) and isinstance(two.local, ShardedLoraLearner)
        assert_close(two.named_weights(), expected_weights[0])  # the same adapters at the start
        for seed in (0, 1):
            assert step(two, seed) == pytest.approx(expected[seed], rel=1e-5, abs=1e-7)
        merged = two.named_weights()
        assert_close(merged, expected_weights[2])
        assert not any("lora_" in name or "base_layer" in name for name in merged)
        checkpoint = save_checkpoint(tmp_path / "run", 2, two, model_dir, {})
    finally:
        two.close()
    assert (checkpoint / "model" / "adapter_model.safetensors").is_file()
    resumed = learner(model_dir, tmp_path, 2)
    try:
        load_checkpoint(checkpoint, resumed)
        # Step 3 needs the restored AdamW moments to land where one process does.
        assert step(resumed, 2) == pytest.approx(expected[2], rel=1e-5, abs=1e-7)
        assert_close(resumed.named_weights(), expected_weights[3])
    finally:
        resumed.close()
