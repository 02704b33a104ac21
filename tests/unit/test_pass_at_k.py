"""pass@k from n samples: the unbiased estimator against counting every k-subset."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamrl.trainer.evaluate import SampledResult, pass_at_k, report_ks


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
