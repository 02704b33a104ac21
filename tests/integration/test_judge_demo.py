"""The judge demo: a generative reward model the project builds is the policy's only reward.

`streamrl train examples/judge.yaml` as a user runs it (the built-in judge built once and
cached, like the warm start), while the judge role is SIGKILLed three times:

- the policy learns the task it never sees the rule of: held-out accuracy, measured by the rule
  reward alone, rises from <= 0.4 to >= 0.8;
- the judge's own held-out verdict accuracy is in `summary.json`;
- every restart of the judge loses and repeats no sample: each sample id is trained once or
  dropped with a reason, never both and never lost;
- the judge's metrics (throughput, latency, queue depth, verdict shares) are logged every step.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.integration.conftest import read_jsonl
from tests.integration.test_faults import assert_each_sample_once, run_with_kills

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_judge_demo_learns_while_its_judge_is_killed(tmp_path):
    run_dir = tmp_path / "judge"
    kills = [("judge", 10), ("judge", 30), ("judge", 50)]
    args = ["examples/judge.yaml", "run.progress=false", "run.tensorboard=false"]
    # The first kill waits for set-up too: on a fresh clone the warm start and the judge build.
    out = run_with_kills(args, run_dir, kills, first_step_s=1200)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["role_restarts"] == {"judge": 3}, out[-3000:]
    assert summary["initial_eval_accuracy"] <= 0.4
    assert summary["final_eval_accuracy"] >= 0.8, summary
    assert summary["judge_verdict_accuracy"] >= 0.85, summary
    assert summary["judge_samples_per_s"] > 0

    assert_each_sample_once(run_dir, summary, 32, 8)
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["role"] for e in events] == ["judge"] * 3

    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    judged = [m for m in steps if not math.isnan(m.get("judge/verdict_correct", math.nan))]
    assert len(judged) >= len(steps) // 2, "the judge's metrics are missing"
    for m in judged:
        shares = m["judge/verdict_correct"] + m["judge/verdict_incorrect"]
        assert shares + m["judge/verdict_invalid"] == pytest.approx(1.0)
        assert m["judge/samples_per_s"] > 0 and m["judge/batch_latency_s"] > 0
