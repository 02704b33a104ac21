"""`streamrl train model.dtype=bfloat16` learns the default task.

The default job (Ray mode, every role its own process, the object-store weight channel, the
shared warm start) with the policy in bf16 everywhere: the trainer's weights and AdamW state,
the builtin engine, and the weights published after every step (moved as raw bf16 bytes).
Fewer steps than the demo, no intermediate evaluation or checkpoints: held-out greedy accuracy
must still rise from <= 0.4 to >= 0.8, and the trainer/engine log-prob mismatch, which shows
bf16 drift, must be logged at every step. docs/precision.md has the fp32 / bf16 / mixed figures.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.integration.conftest import read_jsonl, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 10


def test_bf16_default_job_learns(tmp_path) -> None:
    run_dir = tmp_path / "bf16"
    run_cli(
        [
            "train",
            "model.dtype=bfloat16",
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
    assert summary["mode"] == "ray" and summary["num_steps"] == STEPS
    assert summary["initial_eval_accuracy"] <= 0.4
    assert summary["final_eval_accuracy"] >= 0.8

    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert len(steps) == STEPS
    mismatch = [m["train/logprob_mismatch"] for m in steps]
    assert all(math.isfinite(x) and 0 < x < 0.5 for x in mismatch), mismatch
