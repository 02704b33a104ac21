"""Pieces of the FSDP2 trainer ranks that need no process group: the row codec that carries a
micro-batch to the other ranks (safetensors, no pickle), the per-rank plan, and the checkpoint
formats that must not be mixed up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.trainer.learner import Learner
from streamrl.trainer.ranks import OPTIMIZER_FORMAT, decode_rows, encode_rows, micro_batch_plan
from tests.unit.test_grpo import make_learner


def test_rows_round_trip_through_the_codec():
    rows = [
        {
            "prompt_ids": np.array([1, 2, 3]),
            "response_ids": np.array([4, 5]),
            "rollout_logprobs": np.array([-0.5, -1.25], dtype=np.float32),
            "advantages": 0.75,
            "versions": np.array([3, 4]),
            "finish_reason": "stop",  # not a learner field: stays behind
        },
        {
            "prompt_ids": np.array([7]),
            "response_ids": np.array([8, 9, 10]),
            "rollout_logprobs": np.array([-1.0, -2.0, -3.0], dtype=np.float32),
            "advantages": np.array([0.1, 0.2, 0.3]),  # per token
            "old_logprobs": np.array([-1.0, -2.0, -3.0], dtype=np.float32),
        },
    ]
    got = decode_rows(encode_rows(rows))
    assert len(got) == 2
    assert got[0]["advantages"] == 0.75 and "finish_reason" not in got[0]
    assert "old_logprobs" not in got[0] and "old_logprobs" in got[1]
    for want, have in zip(rows, got, strict=True):
        for key, value in have.items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(want[key]))
            if isinstance(value, np.ndarray):
                assert value.dtype == np.asarray(want[key]).dtype


def test_every_rank_gets_the_same_number_of_micro_batches_and_every_row_once():
    rows = [
        {"prompt_ids": [0] * (3 + i % 4), "response_ids": [0] * (1 + (5 * i) % 7)}
        for i in range(11)
    ]
    for budget in (None, 16, 40):
        plan = micro_batch_plan(rows, 3, budget)
        assert len({len(p) for p in plan}) == 1
        seen = sorted(i for rank in plan for mb in rank for i in mb)
        assert seen == list(range(11))
        assert all(plan[r] for r in range(3))


def test_checkpoint_formats_are_not_mixed(tmp_path):
    from streamrl.models.tiny import build_tiny_model_dir

    model_dir = build_tiny_model_dir(tmp_path, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    learner: Learner = make_learner(model_dir, "token_mean")
    weights = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    state = learner.optimizer_state_dict()
    learner.load_weights_and_optimizer(weights, state)  # its own format round-trips
    with pytest.raises(ValueError, match="trainer.world_size > 1"):
        learner.load_weights_and_optimizer(weights, {"format": OPTIMIZER_FORMAT, "state": {}})
    with pytest.raises(RuntimeError, match="does not match"):
        learner.load_weights_and_optimizer({"bogus": torch.zeros(1)}, state)
