"""The multiple-choice reward: which letter a response chose, and how it is scored."""

from __future__ import annotations

import pytest

from streamrl.api.reward import RewardResult
from streamrl.reward.choice import chosen_letter, multiple_choice
from tests.unit.test_math_reward import sandbox_values

CHOSEN = [
    ("Reasoning... so the result is \\boxed{C}", "C"),
    ("$\\boxed{(B)}$", "B"),
    ("\\boxed{\\text{D}}", "D"),
    ("First I thought \\boxed{A}, but no: \\boxed{B}", "B"),  # the last boxed letter
    ("A is wrong and D is wrong. Answer: C", "C"),  # "answer" beats letters in the text
    ("The answer is (C).", "C"),
    ("The correct answer is C) 42", "C"),
    ("final answer: **J**", "J"),
    ("answer: A ... on second thought, ANSWER: B", "B"),
    ("B", "B"),
    (" (D) ", "D"),
    ("C.", "C"),
    ("**A**", "A"),
    ("The answer is Alice", None),  # a word, not a letter
    ("The answer is not clear", None),
    ("I would pick A or B", None),
    ("42", None),
    ("", None),
]


@pytest.mark.parametrize(("response", "letter"), CHOSEN)
def test_the_chosen_letter_is_read_out_of_the_response(response: str, letter: str | None) -> None:
    assert chosen_letter(response) == letter


@pytest.mark.parametrize(
    ("response", "answer", "value"),
    [
        ("Answer: C", "C", 1.0),
        ("Answer: C", "(c)", 1.0),  # the reference may be written plainly any way
        ("Answer: B", "C", 0.0),
        ("\\boxed{D}", "D.", 1.0),
    ],
)
def test_the_chosen_letter_is_compared_with_the_reference(
    response: str, answer: str, value: float
) -> None:
    assert multiple_choice(response, answer) == RewardResult.ok(value)


def test_a_response_without_a_letter_is_an_invalid_output() -> None:
    result = multiple_choice("It depends on the weather.", "A")
    assert result.status == "invalid_output" and "weather" in result.reason


@pytest.mark.parametrize("answer", ["Paris", "", "AB", "7"])
def test_a_reference_that_is_not_a_letter_is_reported_not_scored(answer: str) -> None:
    result = multiple_choice("Answer: A", answer)
    assert result.status == "infra_error" and "not a letter" in result.reason


def test_it_scores_in_the_sandbox_worker() -> None:
    pairs = [("Answer: (B)", "B"), ("Answer: A", "B")]
    assert sandbox_values("streamrl.reward.choice:multiple_choice", pairs) == [1.0, 0.0]
