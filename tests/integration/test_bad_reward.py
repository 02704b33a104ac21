"""A reward function that raises or hangs does not stop the run, and no sample is scored 0 for it.

The failing samples are dropped from training with their reason counted (`infra_error` for an
exception, `timeout` for a hang), in the per-step metrics and in the run summary. The held-out
evaluation runs the same reward in the sandbox too: a response it cannot score counts as not
correct and is counted (`eval/unscored`), and a hang costs `reward.timeout_s`, not the hang.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import QUICK, read_jsonl, run_cli

pytestmark = pytest.mark.integration


def test_raising_and_hanging_reward_samples_are_dropped_and_counted(tmp_path, quick_cache):
    run_dir = tmp_path / "flaky"
    run_cli(
        [
            "train",
            *QUICK,
            "trainer.steps=3",  # evaluated before the first step and after the last
            "runtime.mode=inline",
            "reward.function=tests.integration.flaky_reward:flaky",
            "reward.timeout_s=0.5",
            "rollout.temperature=3.0",  # varied responses, so every failure mode shows up
            f"run.cache_dir={quick_cache}",
            f"run.run_dir={run_dir}",
        ]
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    dropped = summary["num_samples_dropped"]
    assert dropped.get("infra_error", 0) > 0

    records = read_jsonl(run_dir / "metrics.jsonl")
    evals = [m for m in records if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 3]
    assert all(m["eval/unscored"] > 0 for m in evals)  # the raising reward's, of 32 responses
    steps = [m for m in records if "train/loss" in m]
    assert len(steps) == 3
    total_rows = 4 * 4
    for m in steps:
        assert m["samples/trained"] + m["samples/dropped"] == total_rows
    trained = [len(line["ids"]) for line in read_jsonl(run_dir / "trained_samples.jsonl")]
    assert sum(trained) == 3 * total_rows - sum(dropped.values())
