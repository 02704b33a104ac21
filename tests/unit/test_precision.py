"""Precision of the one-process trainer: `trainer.mixed_precision` computes in bf16 over fp32
master weights, gradients and AdamW state; a pure-bf16 learner keeps everything in bf16.

The reason master weights matter is shown directly: an update smaller than half a bf16 step
of a weight is lost in a bf16 parameter and kept in an fp32 one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from streamrl.api.run import RunContext
from streamrl.config import load_config
from streamrl.config.schema import PolicyLossConfig
from streamrl.models.loading import load_causal_lm
from streamrl.trainer.algos.objective import LossSettings
from streamrl.trainer.learner import BF16Compute, Learner
from streamrl.trainer.role import make_learner

PAD_ID = 0


def learner_for(model: torch.nn.Module, *, mixed_precision: bool, lr: float) -> Learner:
    return Learner(
        model,
        pad_token_id=PAD_ID,
        lr=lr,
        weight_decay=0.0,
        grad_clip=None,
        temperature=1.0,
        settings=LossSettings(loss=PolicyLossConfig(), agg_constant=6.0),
        mixed_precision=mixed_precision,
    )


def rows(num: int = 6, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        width = int(rng.integers(2, 6))
        out.append(
            {
                "prompt_ids": rng.integers(5, 100, size=4).tolist(),
                "response_ids": rng.integers(5, 100, size=width).tolist(),
                "rollout_logprobs": [-4.9] * width,
                "advantages": 1.0 if i % 2 else -1.0,
            }
        )
    return out


def linear_output_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """Record the output dtype of every linear layer during the next forwards."""
    seen: set[torch.dtype] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    return seen


def test_mixed_precision_keeps_fp32_master_weights_grads_and_optimizer_state(
    model_dir: Path,
) -> None:
    learner = learner_for(load_causal_lm(model_dir), mixed_precision=True, lr=1e-3)
    computed = linear_output_dtypes(learner.model)
    learner.accumulate(rows())
    assert computed == {torch.bfloat16}  # the products ran in bf16
    params = list(learner.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}
    assert {p.grad.dtype for p in params if p.grad is not None} == {torch.float32}
    out = learner.step()
    assert out["grad_norm"] > 0 and out["logprob_mismatch"] > 0
    assert {p.dtype for p in learner.model.parameters()} == {torch.float32}
    states = [learner.optimizer.state[p] for p in params if p in learner.optimizer.state]
    assert len(states) == len(params)
    for state in states:
        assert state["exp_avg"].dtype == torch.float32
        assert state["exp_avg_sq"].dtype == torch.float32
    # The checkpointed optimizer state is fp32 as well.
    saved = learner.optimizer_state_dict()["state"]
    assert {s["exp_avg"].dtype for s in saved.values()} == {torch.float32}


def test_small_updates_survive_in_fp32_master_weights_and_are_lost_in_bf16(
    model_dir: Path,
) -> None:
    """An AdamW step of 1e-5 against weights of about 0.02 to 1: below half a bf16 ulp for most
    weights. The fp32 master weights move; a bf16 model's weights mostly stay where they were."""
    moved = {}
    for mixed, dtype in ((True, "float32"), (False, "bfloat16")):
        learner = learner_for(
            load_causal_lm(model_dir, dtype=dtype), mixed_precision=mixed, lr=1e-5
        )
        before = [p.detach().clone() for p in learner.model.parameters()]
        learner.accumulate(rows())
        learner.step()
        after = list(learner.model.parameters())
        changed = sum(int((a != b).sum()) for a, b in zip(after, before, strict=True))
        moved[dtype] = changed / sum(p.numel() for p in before)
    assert moved["float32"] > 0.9
    assert moved["bfloat16"] < 0.5
    assert moved["float32"] > 2 * moved["bfloat16"]


def test_mixed_precision_refuses_a_bf16_model(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="fp32 master weights"):
        BF16Compute(load_causal_lm(model_dir, dtype="bfloat16"))


@pytest.mark.parametrize("mixed", [False, True])
def test_the_trainer_role_loads_its_model_in_the_chosen_precision(
    model_dir: Path, tmp_path: Path, mixed: bool
) -> None:
    """`model.dtype=bfloat16`: a bf16 trainer, or with `trainer.mixed_precision` fp32 master
    weights under bf16 compute (the engines and scorers stay in `model.dtype`)."""
    cfg = load_config(["model.dtype=bfloat16", f"trainer.mixed_precision={str(mixed).lower()}"])
    learner = make_learner(RunContext(cfg, model_dir, tmp_path, [], []))
    dtype = torch.float32 if mixed else torch.bfloat16
    assert {p.dtype for p in learner.model.parameters()} == {dtype}
    assert isinstance(learner.forward_model, BF16Compute) == mixed


def test_the_builtin_engines_dtype_is_chosen_apart_from_the_trainers(
    model_dir: Path, tmp_path: Path
) -> None:
    """`rollout.dtype=bfloat16` with an fp32 trainer (no mixed precision): a bf16 engine beside
    fp32 training; `auto` follows `model.dtype`."""
    from streamrl.rollout.engines import builtin_engine

    for rollout_dtype, engine_dtype in (("bfloat16", torch.bfloat16), ("auto", torch.float32)):
        ctx = RunContext(
            load_config([f"rollout.dtype={rollout_dtype}"]), model_dir, tmp_path, [], []
        )
        assert {p.dtype for p in builtin_engine(ctx).model.parameters()} == {engine_dtype}
        assert {p.dtype for p in make_learner(ctx).model.parameters()} == {torch.float32}


def test_the_builtin_engine_takes_the_trainers_weights_in_its_own_dtype(model_dir: Path) -> None:
    """Through the in-process channel: bf16 weights land in a bf16 engine bit for bit, and a
    mixed-precision trainer's fp32 master weights are rounded to nearest on arrival."""
    from streamrl.rollout.builtin_engine import BuiltinEngine
    from streamrl.weights.channels import publisher_for

    engine = BuiltinEngine(
        load_causal_lm(model_dir, dtype="bfloat16"), eos_token_id=1, pad_token_id=0
    )
    store = publisher_for(load_config(["runtime.mode=threads"]))
    torch.manual_seed(3)
    for version, dtype in enumerate((torch.bfloat16, torch.float32)):
        sent = {
            name: torch.randn(p.shape, dtype=torch.float32).to(dtype)
            for name, p in engine.model.named_parameters()
        }
        store.publish(version, sent)
        found = store.fetch_newer(version - 1)
        assert found is not None and found[0] == version
        engine.load_weights(*found)
        assert engine.version == version
        for name, p in engine.model.named_parameters():
            assert p.dtype == torch.bfloat16
            expected = sent[name].to(torch.bfloat16)  # a no-op for bf16: the bits themselves
            assert torch.equal(p.view(torch.int16), expected.view(torch.int16)), name


def test_a_mixed_precision_checkpoint_resumes_with_fp32_master_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    """The checkpoint holds the fp32 master weights and AdamW state, not bf16 roundings: the
    resumed learner has the same bits and takes the same next step."""
    from streamrl.trainer.checkpoint import load_checkpoint, save_checkpoint

    def trained_learner() -> Learner:
        torch.manual_seed(0)
        return learner_for(load_causal_lm(model_dir), mixed_precision=True, lr=1e-3)

    learner = trained_learner()
    learner.accumulate(rows())
    learner.step()
    checkpoint = save_checkpoint(tmp_path, 1, learner, model_dir, {})
    resumed = trained_learner()
    load_checkpoint(checkpoint, resumed)
    for (name, p), q in zip(
        learner.model.named_parameters(), resumed.model.parameters(), strict=True
    ):
        assert q.dtype == torch.float32 and torch.equal(p, q), name
    for each in (learner, resumed):
        each.accumulate(rows(seed=1))
        each.step()
    for p, q in zip(learner.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert {s["exp_avg_sq"].dtype for s in resumed.optimizer.state.values()} == {torch.float32}
