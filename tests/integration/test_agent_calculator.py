"""The calculator agent (examples/agent_calculator.yaml) through the real CLI.

- It learns: held-out episode success from <= 0.3 after the warm start on a sloppy teacher to
  >= 0.7 after RL, and `summary.json` says so.
- `rollout.max_staleness=0` multi-turn reproduces the synchronous loop: the same episodes
  (token for token) and the same losses, and the trainer's log-probs of the sampled tokens match
  the engine's (tool output excluded by the loss mask).
- SIGKILL of the rollout role mid-episode (Ray mode): every sample id is trained once or dropped
  with a reason, none lost, none trained twice.
"""

from __future__ import annotations

import ast
import json

import pytest

from tests.integration.conftest import QUICK, SHORT, read_jsonl, run_cli
from tests.integration.test_faults import all_ids, run_with_kills, trained_ids
from tests.integration.test_staleness_zero import assert_reproduces

pytestmark = pytest.mark.integration

EXAMPLE = "examples/agent_calculator.yaml"
# Mechanics, not learning: a short warm start (it already calls the tool now and then).
AGENT_QUICK = [EXAMPLE, *QUICK, "warm_start.steps=150", "trainer.eval_every=0"]


def rollout_stats(run_dir) -> dict:
    """The rollout role's last stats line (episodes by status, episode means)."""
    log = (run_dir / "logs" / "rollout.log").read_text()
    line = next(x for x in reversed(log.splitlines()) if "rollout: stopped;" in x)
    return ast.literal_eval(line.split("rollout: stopped;", 1)[1].strip())


@pytest.mark.slow
def test_the_calculator_agent_learns_to_use_its_tool(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_cli(
        ["train", EXAMPLE, *SHORT, f"run.cache_dir={tmp_path / 'cache'}", f"run.run_dir={run_dir}"],
        timeout=1500,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["initial_eval_accuracy"] <= 0.3, summary
    assert summary["final_eval_accuracy"] >= 0.7, summary
    assert summary["wall_time_s"] > 0 and summary["num_steps"] == 60, summary
    stats = rollout_stats(run_dir)
    assert stats["episode_tool_calls_mean"] >= 0.5, stats  # it learnt by calling the tool
    assert stats["episode_splits_mean"] == 0, stats


def _run(mode: str, run_dir, cache) -> tuple[list[dict], list[dict]]:
    run_cli(
        [
            "train",
            *AGENT_QUICK,
            "trainer.steps=3",
            "rollout.max_staleness=0",
            f"runtime.mode={mode}",
            f"run.cache_dir={cache}",
            f"run.run_dir={run_dir}",
        ]
    )
    return read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "trained_samples.jsonl")


def test_staleness_zero_multi_turn_reproduces_the_sync_loop(tmp_path, agent_cache) -> None:
    sync_run = _run("sync", tmp_path / "sync", agent_cache)
    inline_metrics, inline_samples = _run("inline", tmp_path / "inline", agent_cache)
    assert_reproduces(sync_run, (inline_metrics, inline_samples), steps=3)
    # The episodes were multi-turn: some called the tool and were shown its result.
    for m in inline_metrics:
        if "train/loss" in m:
            assert m["episode/turns"] > 1.0 and m["episode/tool_calls"] > 0, m


@pytest.fixture(scope="module")
def agent_cache(quick_cache):
    """The quick cache with AGENT_QUICK's warm start built (so that the kill test's waits time
    the run, not the warm start; a test that builds it meanwhile waits on its file lock)."""
    from streamrl.config.loader import load_config
    from streamrl.trainer.sft import ensure_policy_dir

    ensure_policy_dir(load_config([*AGENT_QUICK, f"run.cache_dir={quick_cache}"]))
    return quick_cache


@pytest.mark.slow
def test_rollout_killed_mid_episode_loses_and_duplicates_nothing(tmp_path, agent_cache) -> None:
    run_dir = tmp_path / "kills"
    steps = 10
    args = [
        *AGENT_QUICK,
        f"trainer.steps={steps}",
        "runtime.mode=ray",
        f"run.cache_dir={agent_cache}",
    ]
    run_with_kills(args, run_dir, [("rollout", 3), ("rollout", 6)])

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["role_restarts"] == {"rollout": 2}, summary
    trained = trained_ids(run_dir)
    assert max(trained.values()) == 1, "a sample was trained twice"
    expected = all_ids(steps, 4, 4)
    dropped = sum(summary["num_samples_dropped"].values())
    assert set(trained) <= expected
    assert len(trained) + dropped == len(expected), "samples were lost"
