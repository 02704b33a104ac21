"""A run with top-p 0.9 and a stop string learns the default task, through the real CLI.

The stop string `+0=` (a column that adds a zero digit) occurs in the worked solutions of about
one prompt in five, so it cuts responses throughout the run (a mean of 18% a step when written): the rollout must end each such
response with the token that completes it (the reward's `cut_at_stop` component counts them and
`stop_inside` would count a response that ran past one), and the cut responses train like any
other. Held-out accuracy (greedy, no stops) must still rise from the warm start's <= 0.4. The
run also logs the rollout/trainer log-prob mismatch, which top-p makes nonzero (docs/engines.md)."""

from __future__ import annotations

import pytest

from tests.integration.conftest import learning_run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 10


def test_a_run_with_top_p_and_a_stop_string_learns(tmp_path) -> None:
    summary, steps = learning_run(
        tmp_path / "top-p-stop",
        "rollout.top_p=0.9",
        "rollout.stop=['+0=']",
        "reward.function=tests.integration.stop_reward:exact_match_noting_stops",
        "runtime.mode=inline",
        "rollout.batch_prompts=16",
        "data.num_eval=128",
        steps=STEPS,
    )
    assert summary["num_samples_dropped"] == {}, summary
    before, after = summary["initial_eval_accuracy"], summary["final_eval_accuracy"]
    assert after >= 0.7, f"held-out accuracy {before:.3f} -> {after:.3f}"
    # The stop string ended responses throughout (a batch of 16 prompts may hold none with a
    # zero digit, so not necessarily at every step).
    cut = [m["reward_components/cut_at_stop"] for m in steps]
    assert sum(cut) / len(cut) > 0.05 and sum(c > 0 for c in cut) >= len(cut) // 2, cut
    assert max(m["reward_components/stop_inside"] for m in steps) == 0.0
    # The behaviour log-probs are the truncated distribution's, the trainer's the full one's.
    assert max(m["train/logprob_mismatch"] for m in steps) > 1e-4
