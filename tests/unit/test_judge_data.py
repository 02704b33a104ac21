"""The built-in judge's data: verdicts agree with the rule reward, both verdicts are common,
held-out problems stay held out, and the judge's user turn is rendered verbatim."""

from __future__ import annotations

import pytest

from streamrl.data import arith
from streamrl.judge.data import (
    BUILTIN_TEMPLATE,
    VERDICTS,
    judge_examples,
    render,
    solution,
)
from streamrl.reward.rule import arith_exact_match


@pytest.fixture(scope="module")
def train() -> list:
    return judge_examples(2000, digits=2, seed=0, split="train")


def test_labels_are_the_rule_rewards_verdicts(train) -> None:
    for e in train:
        assert e.label in VERDICTS
        rewarded = arith_exact_match(e.response, e.answer).value == 1.0
        assert (e.label == "correct") == rewarded, e


def test_both_verdicts_are_common_and_every_kind_of_response_occurs(train) -> None:
    share = sum(e.label == "correct" for e in train) / len(train)
    assert 0.35 <= share <= 0.65
    responses = {e.response for e in train}

    def some(predicate) -> bool:
        return any(predicate(e) for e in train)

    assert some(lambda e: e.response == arith.worked_solution(*_operands(e)))
    assert some(
        lambda e: (
            arith.has_carry(*_operands(e))
            and e.response == arith.worked_solution(*_operands(e), carry=False)
        )
    )
    assert some(lambda e: ":" not in e.response and e.response)  # cut off before the answer
    assert "" in responses
    # A right answer after a wrong step is correct; right steps before a wrong answer are not.
    assert some(
        lambda e: (
            e.label == "correct"
            and e.response != arith.worked_solution(*_operands(e))
            and e.response.endswith(f":{e.answer}")
        )
    )
    assert some(
        lambda e: (
            e.label == "incorrect"
            and e.response.rpartition(":")[0]
            == arith.worked_solution(*_operands(e)).rpartition(":")[0]
        )
    )


def test_partial_carries_sit_between_all_and_none() -> None:
    assert solution(37, 85, [True, True]) == arith.worked_solution(37, 85) == "7+5=12,3+8+1=12:122"
    assert solution(37, 85, [False, False]) == arith.worked_solution(37, 85, carry=False)
    assert solution(37, 85, [True, False]) == "7+5=12,3+8+1=12:22"
    assert solution(37, 85, [False, True]) == "7+5=12,3+8=11:112"
    with pytest.raises(ValueError, match="one flag per column"):
        solution(37, 85, [True])


def test_eval_examples_never_use_train_pairs() -> None:
    held_out = judge_examples(500, digits=2, seed=0, split="eval")
    assert all(arith.is_eval_pair(*_operands(e), 0.1) for e in held_out)
    train = judge_examples(500, digits=2, seed=0, split="train")
    assert not any(arith.is_eval_pair(*_operands(e), 0.1) for e in train)


def test_deterministic_given_the_seed() -> None:
    first = judge_examples(300, digits=2, seed=3, split="train")
    assert first == judge_examples(300, digits=2, seed=3, split="train")
    assert first != judge_examples(300, digits=2, seed=4, split="train")


def test_render_fills_placeholders_once_and_keeps_braces() -> None:
    turn = render(BUILTIN_TEMPLATE, prompt="37+85=", response="7+5=12:122", answer="122")
    assert turn == "37+85=7+5=12:122|122"
    odd = render(BUILTIN_TEMPLATE, prompt="{answer}", response="{x} {prompt} }{", answer="1")
    assert odd == "{answer}{x} {prompt} }{|1"
    with pytest.raises(ValueError, match="response"):
        render("{prompt}|{answer}", prompt="1+1=", response="2", answer="2")


def _operands(e) -> tuple[int, int]:
    a, b = e.prompt.rstrip("=").split("+")
    return int(a), int(b)
