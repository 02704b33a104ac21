"""LoRA training (`trainer/lora.py`): the merged weights the engines receive are peft's own merge
under the base model's names; the reference log-probs with the adapters disabled are the base
model's; only the adapters train; a checkpoint holds the adapter alone and a resume continues
bit for bit."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamrl.api.run import RunContext
from streamrl.config import load_config
from streamrl.models.loading import load_causal_lm
from streamrl.reference.service import reference_fields
from streamrl.trainer.checkpoint import load_checkpoint, save_checkpoint
from streamrl.trainer.lora import LoraLearner, merged_in_place, merged_weights
from streamrl.trainer.role import make_learner
from tests.unit.test_precision import rows as precision_rows

LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8", "algorithm.lr=1e-2"]


def rows(num: int = 6, seed: int = 0) -> list[dict[str, Any]]:
    """test_precision's rows, each with a sample id."""
    return [{**r, "sample_id": f"s{seed}-{i}"} for i, r in enumerate(precision_rows(num, seed))]


def lora_learner(model_dir: Path, tmp_path: Path, *overrides: str) -> LoraLearner:
    cfg = load_config([*LORA, "algorithm.lr_schedule=constant", *overrides])
    learner = make_learner(RunContext(cfg, model_dir, tmp_path, [], []))
    assert isinstance(learner, LoraLearner)
    return learner


def train_steps(learner: LoraLearner, seeds: range) -> list[float]:
    losses = []
    for seed in seeds:
        learner.accumulate(rows(seed=seed))
        losses.append(learner.step()["loss"])
    return losses


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_weights_are_peft_merge_under_the_base_models_names(
    model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    learner = lora_learner(model_dir, tmp_path, f"model.dtype={dtype}")
    train_steps(learner, range(2))  # B is zero at first: train so the deltas are not
    peft_model = learner.model
    adapted = {n: p.detach().clone() for n, p in peft_model.named_parameters() if ".lora_B." in n}
    assert adapted and all(t.abs().sum() > 0 for t in adapted.values())
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters()}

    merged = merged_weights(peft_model)

    reference = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    base = dict(load_causal_lm(model_dir, dtype=dtype).named_parameters())
    assert list(merged) == list(base)
    for name, tensor in merged.items():
        assert tensor.shape == base[name].shape and tensor.dtype == base[name].dtype, name
        assert torch.equal(tensor, reference[name]), name
    changed = [n for n in merged if not torch.equal(merged[n], base[n])]
    assert len(changed) == 7  # every linear of the one decoder layer (the conftest model)
    # The training model is untouched: its base weights are still the loaded ones.
    for name, p in peft_model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_merged_in_place_puts_the_original_parameters_back(model_dir: Path, tmp_path) -> None:
    learner = lora_learner(model_dir, tmp_path)
    train_steps(learner, range(1))
    params = dict(learner.model.named_parameters())
    merged = merged_weights(learner.model)
    with merged_in_place(learner.model):
        inside = dict(learner.model.get_base_model().named_parameters())
        for name, value in merged.items():
            peft_name = next(n for n in inside if n.replace(".base_layer.", ".") == name)
            assert torch.equal(inside[peft_name], value)
    after = dict(learner.model.named_parameters())
    assert all(after[n] is params[n] for n in params)


def test_reference_logprobs_with_adapters_disabled_are_the_base_models(
    model_dir: Path, tmp_path: Path
) -> None:
    learner = lora_learner(model_dir, tmp_path, "algorithm.kl.coef=0.1")
    train_steps(learner, range(2))
    batch = rows(seed=7)
    refs = learner.reference_logprobs(batch)
    base = load_causal_lm(model_dir)
    expected = reference_fields(base, batch, pad_token_id=0, temperature=1.0)
    for row, ref in zip(batch, refs, strict=True):
        np.testing.assert_array_equal(ref, expected[row["sample_id"]]["ref_logprobs"])
    # ... and the adapted policy's differ from them.
    adapted = learner.logprobs(batch)
    assert max(float(np.abs(a - r).max()) for a, r in zip(adapted, refs, strict=True)) > 1e-4


def test_only_the_adapters_receive_updates(model_dir: Path, tmp_path: Path) -> None:
    learner = lora_learner(model_dir, tmp_path, "algorithm.kl.coef=0.1")
    trainable = [n for n, p in learner.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = {id(p) for group in learner.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in learner.model.parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    train_steps(learner, range(2))
    for name, p in learner.model.named_parameters():
        assert torch.equal(p, before[name]) != (name in trainable), name


def test_a_checkpoint_holds_the_adapter_and_a_resume_continues_bit_for_bit(
    model_dir: Path, tmp_path: Path
) -> None:
    learner = lora_learner(model_dir, tmp_path, "algorithm.kl.coef=0.1")
    train_steps(learner, range(2))
    checkpoint = save_checkpoint(tmp_path / "run", 2, learner, model_dir, {})
    saved = sorted(p.name for p in (checkpoint / "model").iterdir())
    assert "adapter_model.safetensors" in saved and "adapter_config.json" in saved
    assert "model.safetensors" not in saved
    from safetensors.torch import load_file

    adapter = load_file(str(checkpoint / "model" / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    optimizer_state = torch.load(checkpoint / "trainer.pt", weights_only=True)["optimizer"]
    assert len(optimizer_state["state"]) == len(adapter)  # AdamW state of the adapter only

    continued = train_steps(learner, range(2, 4))
    resumed = lora_learner(model_dir, tmp_path, "algorithm.kl.coef=0.1")
    load_checkpoint(checkpoint, resumed)
    assert train_steps(resumed, range(2, 4)) == continued
    for (name, a), (_, b) in zip(
        learner.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    # The checkpoint's model folder loads as the merged model (`streamrl eval`, model.path=).
    loaded = dict(load_causal_lm(checkpoint / "model").named_parameters())
    at_checkpoint = lora_learner(model_dir, tmp_path)
    load_checkpoint(checkpoint, at_checkpoint)
    for name, value in merged_weights(at_checkpoint.model).items():
        assert torch.equal(loaded[name], value), name


def test_lora_refuses_settings_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match="in_reward=false"):
        load_config([*LORA, "algorithm.kl.coef=0.1", "algorithm.kl.in_reward=true"])
    assert load_config([*LORA, "trainer.world_size=2"]).trainer.lora.rank == 4  # FSDP2 ranks
