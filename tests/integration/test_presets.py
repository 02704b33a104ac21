"""Every algorithm preset trains on the built-in task and raises held-out accuracy.

Each runs the default job (the shared warm start, every role its own loop) with only
`algorithm.preset` changed, fewer and smaller steps than the demo (20 steps of 16 prompts:
measured 0.289 -> 0.953-0.992 for every preset, against the bar of +0.2; 30 steps of the
default 64 prompts cost CI 7.6 minutes), and every role a thread of one process
(`runtime.mode=threads`): the algorithms are what is tested here, and threads mode runs the same
roles over the same bus contract without Ray's start-up and per-call costs (the Ray runtime has
its own tests). docs/algorithms.md has the full-length figures (benchmarks/presets.py).
"""

from __future__ import annotations

import pytest

from streamrl.config.presets import PRESETS
from tests.integration.conftest import learning_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 20


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_learns(tmp_path, preset: str) -> None:
    summary, steps = learning_run(
        tmp_path / preset,
        f"algorithm.preset={preset}",
        "runtime.mode=threads",
        "rollout.batch_prompts=16",
        steps=STEPS,
    )
    assert summary["mode"] == "threads"
    before, after = summary["initial_eval_accuracy"], summary["final_eval_accuracy"]
    assert after >= before + 0.2, f"{preset}: held-out accuracy {before:.3f} -> {after:.3f}"
    if preset == "ppo":
        assert sum("critic/value_loss" in m for m in steps) >= STEPS - 3
    if preset == "dapo":
        assert sum(m.get("samples/dropped_zero_variance", 0) for m in steps) > 0
    if PRESETS[preset].get("kl_in_reward"):
        assert all(
            m["train/kl_mean"] == 0.0 for m in steps
        )  # the KL is in the reward, not the loss
