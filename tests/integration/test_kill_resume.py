"""SIGKILL a multi-process run mid-training, resume it, and nothing is trained twice or skipped.

The run is killed like a crashed machine: its whole process group (driver, Ray, every role) at
once. `streamrl train --resume` continues from the latest checkpoint; the multiset of sample ids
trained (from `trained_samples.jsonl`, which a resume truncates back to the checkpoint along with
everything trained after it) must equal that of an uninterrupted run with the same config.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch

from tests.integration.conftest import QUICK, REPO, cli_env, read_jsonl, run_cli

pytestmark = pytest.mark.integration

ARGS = [
    *QUICK,
    "trainer.steps=16",
    "trainer.checkpoint_every=4",
    "trainer.eval_every=0",
    "runtime.mode=ray",
]


def _trained(run_dir) -> Counter:
    ids = Counter()
    for line in read_jsonl(run_dir / "trained_samples.jsonl"):
        ids.update(line["ids"])
    return ids


def _kill_at_checkpoint(run_dir, args: list[str], step: int) -> None:
    """Start `streamrl train`, SIGKILL its whole process group once checkpoint `step` exists."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "train", *args, f"run.run_dir={run_dir}"],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "checkpoints" / f"step-{step:06d}").is_dir():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, f"no checkpoint at step {step} within 300 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_sigkill_then_resume_trains_each_sample_once(tmp_path, quick_cache):
    cache = f"run.cache_dir={quick_cache}"
    reference = tmp_path / "uninterrupted"
    # Also: the rollout's torch threads follow `rollout.threads` (the sample ids do not depend
    # on them).
    run_cli(["train", *ARGS, cache, "rollout.threads=2", f"run.run_dir={reference}"])
    assert "start step 0, 2 torch threads)" in (reference / "logs" / "rollout.log").read_text()
    # `streamrl eval` of the finished run measures what the run measured last.
    final = json.loads((reference / "summary.json").read_text())["final_eval_accuracy"]
    said = run_cli(["eval", str(reference), "--show", "1"]).stdout
    assert f"step-000016/model: held-out accuracy {final:.4f} (" in said, said
    if final < 1:  # and, asked to, shows a prompt it answered wrong
        assert said.startswith("[") and "\n    response: " in said, said

    crashed = tmp_path / "crashed"
    _kill_at_checkpoint(crashed, [*ARGS, cache], 8)
    steps_logged = [line["step"] for line in read_jsonl(crashed / "trained_samples.jsonl")]
    assert max(steps_logged) < 16, "the run finished before the kill; nothing was tested"

    run_cli(["train", "--resume", str(crashed)])
    summary = (crashed / "summary.json").read_text()
    assert '"resumed_from_step": ' in summary and '"resumed_from_step": 0' not in summary

    expected = _trained(reference)
    assert sum(expected.values()) == 16 * 4 * 4
    assert _trained(crashed) == expected


def test_a_resumed_ppo_run_restores_the_critic_of_the_same_batches(tmp_path, quick_cache):
    # The critic may have saved a later state than the trainer's checkpoint when the job died
    # (it can run a batch or two ahead); the resumed critic must be the one that had trained
    # exactly the batches before the checkpoint, so that it ends with one step per batch.
    run_dir = tmp_path / "ppo"
    args = [
        *ARGS,
        "algorithm.preset=ppo",
        "trainer.checkpoint_every=2",
        f"run.cache_dir={quick_cache}",
    ]
    _kill_at_checkpoint(run_dir, args, 8)
    run_cli(["train", "--resume", str(run_dir)])

    state = torch.load(run_dir / "critic" / "step-000016.pt", weights_only=True)
    assert state["meta"] == {"next_batch": 16, "ahead": []}
    assert state["steps"] == 16  # one critic step per batch: none repeated, none skipped
    log = (run_dir / "logs" / "critic.log").read_text()
    assert "critic: restored" in log and "step-000008.pt" in log


def test_a_run_resumed_before_its_first_checkpoint_starts_over_and_logs_each_step_once(
    tmp_path, quick_cache
):
    run_dir = tmp_path / "early"
    args = [*QUICK, f"run.cache_dir={quick_cache}", "trainer.steps=3", "runtime.mode=sync"]
    run_cli(["train", *args, "trainer.eval_every=2", f"run.run_dir={run_dir}"])
    first = json.loads((run_dir / "summary.json").read_text())
    shutil.rmtree(run_dir / "checkpoints")  # as if it had died before its first checkpoint

    run_cli(["train", "--resume", str(run_dir)])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == 0 and summary["num_steps"] == 3
    assert summary["initial_eval_accuracy"] == first["initial_eval_accuracy"]
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert sorted(steps) == sorted(set(steps)), f"steps logged twice: {steps}"
    assert _trained(run_dir) == Counter(
        f"b{b}-p{p}-s{s}" for b in range(3) for p in range(4) for s in range(4)
    )

    # Resumed from its checkpoint, the summary's accuracy before RL is still the step-0
    # evaluation (marked here so that no later evaluation can pass for it).
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[0]["step"] == 0
    metrics[0]["eval/accuracy"] = 0.125
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    run_cli(["train", "--resume", str(run_dir), "trainer.steps=5"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == 3 and summary["initial_eval_accuracy"] == 0.125
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == sorted(set(steps)) and steps[-1] == 5
