"""Every algorithm preset trains on the built-in task and raises held-out accuracy.

Each runs the default job (the shared warm start, every role its own loop) with only
`algorithm.preset` changed, fewer steps than the demo, and every role a thread of one process
(`runtime.mode=threads`): the algorithms are what is tested here, and threads mode runs the same
roles over the same bus contract without Ray's start-up and per-call costs (the Ray runtime has
its own tests). docs/algorithms.md has the full-length figures (benchmarks/presets.py).
"""

from __future__ import annotations

import json

import pytest

from streamrl.config.presets import PRESETS
from tests.integration.conftest import read_jsonl, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 30


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_learns(tmp_path, preset: str) -> None:
    run_dir = tmp_path / preset
    run_cli(
        [
            "train",
            f"algorithm.preset={preset}",
            "runtime.mode=threads",
            f"trainer.steps={STEPS}",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=0",
            "run.progress=false",
            "run.tensorboard=false",
            f"run.run_dir={run_dir}",
        ],
        timeout=1200,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_steps"] == STEPS and summary["mode"] == "threads"
    before, after = summary["initial_eval_accuracy"], summary["final_eval_accuracy"]
    assert before <= 0.4
    assert after >= before + 0.2, f"{preset}: held-out accuracy {before:.3f} -> {after:.3f}"

    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert len(steps) == STEPS
    if preset == "ppo":
        assert sum("critic/value_loss" in m for m in steps) >= STEPS - 3
    if preset == "dapo":
        assert sum(m.get("samples/dropped_zero_variance", 0) for m in steps) > 0
    if PRESETS[preset].get("kl_in_reward"):
        assert all(
            m["train/kl_mean"] == 0.0 for m in steps
        )  # the KL is in the reward, not the loss
