"""The video learning check: `streamrl train examples/video.yaml` as a user runs it.

The built-in tiny Qwen2.5-VL is warm-started on a teacher that names the opposite of the
square's direction in most answers, so it sees the motion but answers it backwards; RL on the
rule reward alone must turn it round: the training reward and the held-out accuracy rise.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import read_jsonl, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_video_task_trains_end_to_end(tmp_path):
    run_dir = tmp_path / "video"
    args = ["examples/video.yaml", "trainer.eval_every=0", "run.progress=false"]
    run_cli(["train", *args, "run.tensorboard=false", f"run.run_dir={run_dir}"], timeout=1500)
    summary = json.loads((run_dir / "summary.json").read_text())
    # Greedy, the warm-started policy names the opposite direction.
    assert summary["initial_eval_accuracy"] <= 0.2, summary
    assert summary["final_eval_accuracy"] >= summary["initial_eval_accuracy"] + 0.2, summary
    assert summary["train_reward_last"] >= summary["train_reward_first"] + 0.05, summary
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert len(steps) == summary["num_steps"]
    assert steps[0]["train/logprob_mismatch"] <= 1e-5, steps[0]["train/logprob_mismatch"]
    last = steps[-1]  # each clip is two 56 x 56 frames: one time step of 2 x 2 tokens
    assert last["media/videos"] >= 32 and last["media/tokens_per_prompt"] == 4.0
