"""The MoE demo: `streamrl train examples/moe.yaml`, the built-in tiny model as a Qwen3-MoE with
rollout routing replay, learns the built-in task; and the same with vLLM as the engine.

- held-out accuracy rises from <= 0.4 to >= 0.8 (the warm start included, as a user runs it);
- every step logs the router's load-balancing loss, each layer's expert load and the share of
  replayed routing decisions the trainer's router agrees with;
- with vLLM (its CPU build) the rows carry vLLM's routes and a short run's reward rises.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.integration.conftest import read_jsonl, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ARGS = ["examples/moe.yaml", "run.progress=false", "run.tensorboard=false"]


def _steps(run_dir):
    return [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]


def _assert_routing_metrics(steps, num_layers: int = 4) -> None:
    for m in steps:
        assert m["train/moe/aux_loss"] >= 1.0  # E * sum f_e P_e is at least 1
        for layer in range(num_layers):
            assert 1.0 <= m[f"train/moe/expert_load_max/l{layer}"] <= 8.0
        # One version of staleness at most: the trainer's router keeps (nearly) every choice.
        assert 0.9 <= m["train/moe/replay_agreement"] <= 1.0


def test_moe_demo_learns_with_routing_replay(tmp_path):
    run_dir = tmp_path / "moe"
    run_cli(["train", *ARGS, f"run.run_dir={run_dir}"], timeout=1500)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["initial_eval_accuracy"] <= 0.4
    assert summary["final_eval_accuracy"] >= 0.8, summary
    steps = _steps(run_dir)
    assert len(steps) == summary["num_steps"] == 100
    _assert_routing_metrics(steps)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_moe_on_vllm_with_routing_replay(tmp_path):
    run_dir = tmp_path / "moe-vllm"
    args = [*ARGS, "rollout.engine=vllm", "trainer.steps=24", "trainer.eval_every=0"]
    run_cli(["train", *args, f"run.run_dir={run_dir}"], timeout=1500)
    steps = _steps(run_dir)
    assert len(steps) == 24
    _assert_routing_metrics(steps)
    first = sum(m["reward/mean"] for m in steps[:6]) / 6
    last = sum(m["reward/mean"] for m in steps[-6:]) / 6
    assert last > first + 0.05, (first, last)
