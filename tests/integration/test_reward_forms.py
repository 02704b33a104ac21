"""Reward functions written as TRL's and veRL's documentation write them train the default task
unchanged: TRL's batched `fn(completions, answer, **kwargs)` (two of them, weighted) and veRL's
`compute_score(data_source, solution_str, ground_truth, extra_info=None)`. Each run starts from
the default warm start (shared with the other slow tests) and must raise held-out accuracy,
scored by the same functions; no sample is dropped, so every call was made in its form."""

from __future__ import annotations

import pytest

from tests.integration.conftest import learning_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 10


def train(run_dir, *reward: str) -> tuple[dict, list[dict]]:
    summary, steps = learning_run(
        run_dir,
        *reward,
        "runtime.mode=inline",
        "rollout.batch_prompts=16",
        "data.num_eval=128",
        steps=STEPS,
    )
    assert summary["num_samples_dropped"] == {}, summary
    before, after = summary["initial_eval_accuracy"], summary["final_eval_accuracy"]
    assert after >= before + 0.2, f"held-out accuracy {before:.3f} -> {after:.3f}"
    return summary, steps


def test_trl_style_weighted_reward_functions_train_unchanged(tmp_path) -> None:
    module = "tests.integration.trl_reward"
    _, steps = train(
        tmp_path / "trl",
        f"reward.function=[{module}:accuracy_reward, {module}:format_reward]",
        "reward.weights=[1.0, 0.1]",
    )
    for m in steps:  # each function's value is logged; the reward is their weighted sum
        accuracy, fmt = m["reward_components/accuracy_reward"], m["reward_components/format_reward"]
        assert m["reward/mean"] == pytest.approx(accuracy + 0.1 * fmt)


def test_a_verl_style_compute_score_trains_unchanged(tmp_path) -> None:
    train(tmp_path / "verl", "reward.function=tests.integration.verl_compute_score:compute_score")
