"""DAPO dynamic sampling with refill, through the real CLI on the built-in task.

- Every step trains exactly `rollout.batch_prompts` groups with signal (refill batches are
  generated when too few have it), and the policy still learns.
- With `max_staleness=0` inline mode trains the same samples with the same losses as the
  synchronous loop, refills included, and a run resumed from a checkpoint continues exactly as
  the uninterrupted one: the same samples, and the same gradients, which needs the online reward
  normaliser's state back (`reward_norm=true` with `adv_scale=none`, so its scale matters).

Both use the default warm start (shared with the other slow tests) and small batches.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.integration.conftest import read_jsonl, run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COMMON = [
    "algorithm.preset=dapo",
    "rollout.group_size=8",
    "run.progress=false",
    "run.log_every=0",
    "run.tensorboard=false",
]


def train_steps(run_dir) -> list[dict]:
    return [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]


def assert_full_steps(steps: list[dict], batch_prompts: int, group_size: int = 8) -> None:
    """Each step trained exactly `batch_prompts` groups with signal, or hit the refill cap."""
    for m in steps:
        trained = m["dynamic_sampling/groups_trained"]
        assert trained == batch_prompts or m["dynamic_sampling/cap_hit"] == 1.0, m
        assert trained <= batch_prompts
        assert m["samples/trained"] <= trained * group_size
        assert 1 <= m["dynamic_sampling/batches_per_step"] <= 4


def test_every_step_trains_batch_prompts_groups_and_the_policy_learns(tmp_path) -> None:
    run_dir = tmp_path / "dapo"
    run_cli(
        [
            "train",
            *COMMON,
            "rollout.batch_prompts=8",
            "rollout.max_staleness=1",
            "runtime.mode=inline",
            "trainer.steps=12",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=0",
            "data.num_eval=128",
            f"run.run_dir={run_dir}",
        ],
        timeout=1200,
    )
    steps = train_steps(run_dir)
    assert len(steps) == 12
    assert_full_steps(steps, batch_prompts=8)
    assert sum(m["dynamic_sampling/cap_hit"] for m in steps) <= 2
    assert any(m["dynamic_sampling/batches_per_step"] > 1 for m in steps), "never refilled"
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = summary["initial_eval_accuracy"], summary["final_eval_accuracy"]
    assert after >= before + 0.1, f"held-out accuracy {before:.3f} -> {after:.3f}"


def run_exact(mode: str, run_dir, *extra: str) -> None:
    run_cli(
        [
            "train",
            *COMMON,
            "algorithm.shaping.reward_norm=true",
            "algorithm.advantage.scale=none",
            "rollout.batch_prompts=4",
            "rollout.max_staleness=0",
            "trainer.steps=6",
            "trainer.checkpoint_every=3",
            "trainer.eval_every=0",
            "data.num_eval=16",
            f"runtime.mode={mode}",
            f"run.run_dir={run_dir}",
            *extra,
        ]
    )


def assert_same_training(a, b) -> None:
    samples_a, samples_b = (read_jsonl(d / "trained_samples.jsonl") for d in (a, b))
    assert [s["digest"] for s in samples_a] == [s["digest"] for s in samples_b]
    assert [sorted(s["ids"]) for s in samples_a] == [sorted(s["ids"]) for s in samples_b]
    for ma, mb in zip(train_steps(a), train_steps(b), strict=True):
        for key in ("train/loss", "train/grad_norm"):
            assert math.isclose(ma[key], mb[key], rel_tol=1e-4, abs_tol=1e-6), (key, ma, mb)
        for key in ("dynamic_sampling/batches_per_step", "dynamic_sampling/groups_surplus"):
            assert ma[key] == mb[key], key


def test_staleness_zero_matches_sync_and_resumes_exactly(tmp_path) -> None:
    inline, sync, resumed = tmp_path / "inline", tmp_path / "sync", tmp_path / "resumed"
    run_exact("inline", inline)
    steps = train_steps(inline)
    assert len(steps) == 6
    assert_full_steps(steps, batch_prompts=4)
    assert all(m["staleness/max"] == 0 for m in steps)

    run_exact("sync", sync)
    assert_same_training(inline, sync)

    # A crash right after the checkpoint of step 3: the run directory as it was then, with the
    # logs of later steps still in it (a resume truncates them).
    shutil.copytree(inline, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000006")
    run_cli(["train", "--resume", str(resumed)])
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3
    assert_same_training(inline, resumed)
