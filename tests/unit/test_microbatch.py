"""Token-budget micro-batches: every row exactly once, every micro-batch within the budget,
deterministic, and the same number of micro-batches on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from streamrl.trainer.logprobs import pack
from streamrl.trainer.microbatch import (
    deal_to_ranks,
    micro_batch_cost,
    padding_free_logprobs,
    plan_step,
    split_by_token_budget,
)

lengths = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=0, max_size=40)


@given(lengths, st.integers(80, 400), st.booleans())
def test_split_covers_every_row_once_within_budget(
    rows: list[tuple[int, int]], max_tokens: int, padded: bool
) -> None:
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    micro_batches = split_by_token_budget(prompts, responses, max_tokens, padded=padded)
    assert sorted(i for mb in micro_batches for i in mb) == list(range(len(rows)))
    assert all(mb for mb in micro_batches)
    for mb in micro_batches:
        assert mb == sorted(mb)
        assert micro_batch_cost(prompts, responses, mb, padded=padded) <= max_tokens
    assert micro_batches == split_by_token_budget(prompts, responses, max_tokens, padded=padded)


@given(lengths, st.integers(80, 400), st.integers(1, 5))
def test_plan_gives_every_rank_the_same_number_of_micro_batches(
    rows: list[tuple[int, int]], max_tokens: int, num_ranks: int
) -> None:
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    plan = plan_step(prompts, responses, max_tokens, num_ranks)
    assert len(plan) == num_ranks
    assert len({len(per_rank) for per_rank in plan}) == 1
    assert sorted(i for per_rank in plan for mb in per_rank for i in mb) == list(range(len(rows)))
    num_micro = len(split_by_token_budget(prompts, responses, max_tokens))
    assert len(plan[0]) == -(-num_micro // num_ranks)  # ceil: no rank idles a whole round extra


def test_padded_cost_is_the_packed_batch_size() -> None:
    prompts, responses = [[5, 6, 7], [8]], [[9], [10, 11, 12, 13]]
    batch = pack(prompts, responses, pad_token_id=0)
    cost = micro_batch_cost([3, 1], [1, 4], [0, 1], padded=True)
    assert cost == batch.input_ids_bt.numel() == 2 * (3 + 4)
    assert micro_batch_cost([3, 1], [1, 4], [0, 1], padded=False) == 9


def test_first_fit_decreasing_packs_a_known_case() -> None:
    # Totals 9, 2, 7, 3, 5, budget 10, padding-free. Longest first: 9 opens a micro-batch, 7
    # and 5 open their own, 3 joins the 7, 2 fits only next to the 5.
    prompts, responses = [4, 1, 3, 1, 2], [5, 1, 4, 2, 3]
    assert split_by_token_budget(prompts, responses, 10, padded=False) == [[0], [2, 3], [1, 4]]


def test_deal_balances_work_and_pads_the_last_round() -> None:
    # Rounds: 50 -> r0, 40 -> r1; then r1 is lighter: 30 -> r1, 20 -> r0; at 70 each the tie
    # goes to r0: 10 -> r0, and r1 gets an empty micro-batch.
    plan = deal_to_ranks([[0], [1], [2], [3], [4]], [50, 40, 30, 20, 10], num_ranks=2)
    assert plan == [[[0], [3], [4]], [[1], [2], []]]


def test_a_row_over_the_budget_is_an_error() -> None:
    with pytest.raises(ValueError, match="max_tokens=8"):
        split_by_token_budget([4, 5], [1, 4], 8)


def test_padding_free_logprobs_equal_the_padded_computation(tmp_path) -> None:
    from streamrl.models.loading import load_causal_lm
    from streamrl.models.tiny import build_tiny_model_dir
    from streamrl.trainer.logprobs import response_logprobs

    model_dir = build_tiny_model_dir(tmp_path, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    model = load_causal_lm(model_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 100, size=n).tolist() for n in (3, 7, 1, 5)]
    responses = [rng.integers(5, 100, size=n).tolist() for n in (4, 1, 6, 0)]
    padded = response_logprobs(model, pack(prompts, responses, 0), 0.7, with_entropy=True)
    free = padding_free_logprobs(model, prompts, responses, 0.7, with_entropy=True)
    for got, expected in zip(free, padded, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert float(padded[0].detach().abs().sum()) > 1.0  # not all zeros
    # Gradients flow the same way too.
    model.zero_grad()
    padding_free_logprobs(model, prompts, responses).sum().backward()
    grads_free = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    response_logprobs(model, pack(prompts, responses, 0)).sum().backward()
    for got, expected in zip(grads_free, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
