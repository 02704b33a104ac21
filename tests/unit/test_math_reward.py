"""The math-verify reward: answers compared by value, in the sandbox worker as a run calls it."""

from __future__ import annotations

import pytest

from streamrl.api.reward import RewardResult
from streamrl.reward.forms import check_reward_signature
from streamrl.reward.math_answer import math_answer
from streamrl.reward.sandbox import SandboxedScorer, ScoreTask
from streamrl.reward.scoring import resolve_callable

CASES = [
    ("The answer is \\boxed{\\frac12}.", "\\frac{1}{2}", 1.0),
    ("so $x = 0.5$", "1/2", 1.0),
    ("48/2 = 24 clips in May. 48+24 = 72. #### 72", "72", 1.0),
    ("48/2 = 24 clips in May. 48+24 = 73. #### 73", "72", 0.0),
    ("First 5, then \\boxed{3}, and 7 after it", "3", 1.0),  # the boxed answer wins
    ("$\\boxed{\\sqrt 2}$", "\\sqrt{2}", 1.0),  # MATH's LaTeX answers, undelimited
    ("$\\boxed{2\\sqrt 2}$", "\\sqrt{2}", 0.0),
    ("x = -4", -4, 1.0),  # a number, as JSON data has them
]


@pytest.mark.parametrize(("response", "answer", "value"), CASES)
def test_answers_are_compared_by_value(response: str, answer, value: float) -> None:
    assert math_answer(response, answer) == RewardResult.ok(value)


def test_a_response_without_an_answer_is_an_invalid_output() -> None:
    result = math_answer("I do not know", "10")
    assert result.status == "invalid_output" and "I do not know" in result.reason


def test_an_unreadable_reference_answer_is_reported_not_scored() -> None:
    result = math_answer("\\boxed{3}", " ")
    assert result.status == "infra_error" and "cannot read the answer" in result.reason


def sandbox_values(path: str, pairs) -> list[float | None]:
    """The reward `path` of (response, answer) pairs as a run computes it: its signature
    checked, scored in the sandbox worker."""
    check_reward_signature(resolve_callable(path), path)
    scorer = SandboxedScorer(path, timeout_s=30)
    try:
        return [r.value for r in scorer.score([ScoreTask(r, str(a)) for r, a in pairs])]
    finally:
        scorer.close()


def test_it_scores_in_the_sandbox_worker() -> None:
    pairs = [(response, answer) for response, answer, _ in CASES]
    values = sandbox_values("streamrl.reward.math_answer:math_answer", pairs)
    assert values == [value for *_, value in CASES]
