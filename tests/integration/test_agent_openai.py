"""An unmodified OpenAI-client agent program trains through the real CLI.

`streamrl train examples/agent_calculator_openai.yaml`: each episode runs examples/agent_openai.py,
whose chat requests are the episode's turns on the rollout's endpoint. Every step must train on
episodes the program played, and their rewards (the run's reward function on the program's last
answer) must be recorded.
"""

from __future__ import annotations

import ast
import json

import pytest

from tests.integration.conftest import SHORT, read_jsonl, run_cli

pytestmark = pytest.mark.integration


def test_an_openai_client_program_is_trained(tmp_path, quick_cache) -> None:
    run_dir = tmp_path / "run"
    steps = 2
    run_cli(
        [
            "train",
            "examples/agent_calculator_openai.yaml",
            f"trainer.steps={steps}",
            "warm_start.steps=60",
            "data.num_eval=8",
            f"run.cache_dir={quick_cache}",
            *SHORT,
            f"run.run_dir={run_dir}",
        ],
        timeout=600,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    trained = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert len(trained) == steps == summary["num_steps"], summary
    for m in trained:
        assert m["samples/trained"] > 0, m
        assert 0.0 <= m["reward/mean"] <= 1.0, m

    # The episodes were the program's: it made requests, and every episode ended well.
    rollout_log = (run_dir / "logs" / "rollout.log").read_text()
    assert "OpenAI-compatible endpoint at http://127.0.0.1:" in rollout_log
    stopped = next(line for line in rollout_log.splitlines() if "rollout: stopped;" in line)
    stats = ast.literal_eval(stopped.split("rollout: stopped;", 1)[1].strip())
    assert set(stats["episodes"]) == {"ok"}, stats
    assert stats["episode_requests_mean"] >= 1 and stats["episode_splits_mean"] == 0, stats
