"""Held-out scoring: what counts as correct, and pass@k from n samples (the unbiased estimator
against counting every k-subset)."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamrl.api.engine import GenerationResult
from streamrl.api.reward import RewardResult
from streamrl.data.dataset import PromptRow
from streamrl.trainer.evaluate import HeldOut, SampledResult, is_correct, pass_at_k, report_ks


def pass_at_k_by_counting(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(combinations(range(n), k))
    return sum(any(i < c for i in subset) for subset in subsets) / len(subsets)


@given(
    st.integers(1, 10).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))
    )
)
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(pass_at_k_by_counting(n, c, k), abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_large_n_does_not_overflow():
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)
    assert pass_at_k(16, 0, 16) == 0.0 and pass_at_k(16, 1, 16) == 1.0
    assert 0.0 < pass_at_k(100_000, 3, 500) < 1.0


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match=f"n={n}, c={c}, k={k}"):
        pass_at_k(n, c, k)


def test_report_ks_are_powers_of_two_and_n():
    assert report_ks(1) == [1]
    assert report_ks(8) == [1, 2, 4, 8]
    assert report_ks(10) == [1, 2, 4, 8, 10]


def test_sampled_result_averages_over_prompts_and_says_what_was_not_scored():
    result = SampledResult(
        samples=4,
        temperature=1.0,
        correct=[4, 0, 1],
        unscored={"timeout": 2},
        first_reason="reward took longer than 5 s",
    )
    assert result.pass_at(1) == pytest.approx((1 + 0 + 0.25) / 3)
    assert result.pass_at(4) == pytest.approx(2 / 3)
    assert result.text() == (
        "pass@1 0.4167, pass@2 0.5000, pass@4 0.6667 (4 samples a prompt at temperature 1); "
        "2 not scored (timeout 2; the first: reward took longer than 5 s)"
    )


def test_an_answer_is_correct_at_the_reward_threshold_or_by_its_acc_component() -> None:
    assert is_correct(RewardResult.ok(1.0)) and not is_correct(RewardResult.ok(0.99))
    assert is_correct(RewardResult.ok(10.0), correct_at=10.0)
    assert not is_correct(RewardResult.ok(5.0), correct_at=10.0)
    # veRL's form: `acc` is the verdict, whatever bonus or penalty the score holds.
    assert is_correct(RewardResult(0.9, components={"acc": 1.0, "format": -0.1}))
    assert not is_correct(RewardResult(1.1, components={"acc": 0.0, "format": 0.1}))
    assert not is_correct(RewardResult.invalid("no answer"))
    assert not is_correct(RewardResult(None, "timeout", "hung"))


def test_held_out_accuracy_counts_what_is_correct_and_lists_the_misses() -> None:
    class Engine:  # answers prompt i with token i
        def generate(self, requests, params):
            assert params.temperature == 0.0
            return [
                GenerationResult(r.request_id, [i], [0.0], [0], "stop")
                for i, r in enumerate(requests)
            ]

    class Tokenizer:
        def decode(self, ids, skip_special_tokens):
            return f"answer {ids[0]}"

    class Scorer:  # reward 1.1 for prompt 0 (with a bonus), 0.95 with acc 1 for prompt 1, ...
        def score(self, tasks):
            return [
                RewardResult(1.1),
                RewardResult(0.95, components={"acc": 1.0}),
                RewardResult(0.5),
                RewardResult(None, "timeout", "hung"),
            ][: len(tasks)]

    rows = [PromptRow(f"q{i}", str(i)) for i in range(4)]
    held = HeldOut(Engine(), Tokenizer(), rows, [[1]] * 4, Scorer(), max_new_tokens=4)
    result = held.greedy()
    assert result.accuracy == 0.5
    assert [(i, response) for i, response, _ in result.misses] == [(2, "answer 2"), (3, "answer 3")]
    assert result.unscored == {"timeout": 1}
    held.correct_at = 0.5
    assert held.greedy().accuracy == 0.75
