"""`streamrl replay` trains an asynchronous run's recorded steps again and reproduces each step's
loss and gradient norm bit for bit; a record changed after the run makes it report a mismatch.

The run: the default job (GRPO on the built-in task) at `rollout.max_staleness=1` in threads
mode, with `run.record_samples=true` and a checkpoint every two steps; replay restores checkpoint
2 and trains steps 3 and 4 from the record (step 4 needs the AdamW state step 3 left). The reward
is the share of digits in a response, so that the briefly warm-started policy's groups have
advantages and every step a gradient (its exact-match rewards are all 0 at first).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.integration.conftest import QUICK, read_jsonl, run_cli

pytestmark = pytest.mark.integration

ARGS = [
    *QUICK,
    "trainer.steps=4",
    "trainer.checkpoint_every=2",
    "trainer.eval_every=0",
    "rollout.max_staleness=1",
    "runtime.mode=threads",
    "run.record_samples=true",
    "reward.function=tests.integration.digit_reward:digit_share",
]


def test_replay_reproduces_an_async_run_bit_for_bit(tmp_path, quick_cache) -> None:
    run_dir = tmp_path / "run"
    run_cli(["train", *ARGS, f"run.cache_dir={quick_cache}", f"run.run_dir={run_dir}"])

    record = run_dir / "samples"
    index = read_jsonl(record / "index.jsonl")
    assert [line["step"] for line in index] == [1, 2, 3, 4]
    assert all(line["bytes"] == (record / line["file"]).stat().st_size for line in index)
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] >= 1]
    assert all(m["record/bytes"] > 0 for m in metrics)
    # The record holds what the loss read, and the step's figures from the metrics.
    for m, line in zip(metrics, index, strict=True):
        assert (line["loss"], line["grad_norm"]) == (m["train/loss"], m["train/grad_norm"])
    assert all(line["grad_norm"] > 0 for line in index), index  # something to reproduce
    with np.load(record / "step-000003.npz", allow_pickle=False) as npz:
        for field in ("prompt_ids", "response_ids", "rollout_logprobs", "versions", "advantages"):
            assert f"{field}.data" in npz.files

    proc = run_cli(["replay", str(run_dir), "--from-step", "2", "--steps", "2"])
    assert "all 2 steps equal the record bit for bit" in proc.stdout, proc.stdout

    proc = run_cli(["replay", str(run_dir), "--inspect", "3"])
    assert "step 3" in proc.stdout and "micro-batch 0" in proc.stdout, proc.stdout
    assert "logprob" in proc.stdout and "response:" in proc.stdout

    # Negative check: one recorded advantage changed, and replay says step 3 differs.
    path = record / "step-000003.npz"
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    advantages = arrays["advantages.data"].copy()
    nonzero = np.flatnonzero(advantages)
    assert nonzero.size, "no sample of step 3 has an advantage to change"
    advantages[nonzero[0]] *= 2.0
    arrays["advantages.data"] = advantages
    with path.open("wb") as f:
        np.savez_compressed(f, **arrays)
    proc = run_cli(["replay", str(run_dir), "--from-step", "2", "--steps", "1"], check_ok=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "steps [3] differ from the record" in proc.stdout, proc.stdout

    # A checkpoint the run no longer keeps (the newest two) is named as missing.
    proc = run_cli(["replay", str(run_dir), "--from-step", "1"], check_ok=False)
    assert proc.returncode == 2 and "no checkpoint of step 1" in proc.stderr, proc.stderr
    json.loads((run_dir / "summary.json").read_text())  # the run itself finished normally
