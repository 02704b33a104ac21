"""Unit tests for the pure samplers in ``streamrl.bus.samplers``."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from streamrl.bus import samplers
from streamrl.bus.samplers import RowView


def view(
    sample_id: str,
    group_id: str = "g",
    *,
    seq: int = 0,
    group_size: int = 1,
    group_pending: int | None = None,
    **summary: int,
) -> RowView:
    return RowView(
        sample_id=sample_id,
        group_id=group_id,
        group_size=group_size,
        batch_index=0,
        seq=seq,
        group_pending=group_size if group_pending is None else group_pending,
        summary=summary,
    )


def grouped(sizes: list[int], ready: list[int] | None = None) -> list[RowView]:
    """Rows of groups g0, g1, ... with the given sizes; ``ready[i]`` of group i are candidates."""
    ready = sizes if ready is None else ready
    rows, seq = [], 0
    for g, (size, num_ready) in enumerate(zip(sizes, ready, strict=True)):
        for i in range(num_ready):
            rows.append(view(f"g{g}/{i}", f"g{g}", seq=seq, group_size=size))
            seq += 1
    return rows


def test_fifo_takes_the_oldest_in_order() -> None:
    rows = [view(f"s{i}", seq=i) for i in range(5)]
    assert samplers.fifo(rows, 3) == ["s0", "s1", "s2"]


def test_fifo_reads_only_what_it_needs() -> None:
    def endless() -> Iterator[RowView]:
        i = 0
        while True:
            yield view(f"s{i}", seq=i)
            i += 1

    assert samplers.fifo(endless(), 2) == ["s0", "s1"]


def test_group_skips_incomplete_groups() -> None:
    rows = grouped([2, 3, 2], ready=[2, 2, 2])
    assert samplers.group(rows, 10) == ["g0/0", "g0/1", "g2/0", "g2/1"]


def test_group_stops_at_max_rows_but_always_returns_the_first_group() -> None:
    rows = grouped([3, 2, 1])
    assert samplers.group(rows, 2) == ["g0/0", "g0/1", "g0/2"]
    assert samplers.group(rows, 5) == ["g0/0", "g0/1", "g0/2", "g1/0", "g1/1"]
    assert samplers.group(rows, 4) == ["g0/0", "g0/1", "g0/2"]  # stops, does not skip to g2


def test_group_pending_counts_rows_not_yet_consumable() -> None:
    # Both rows are ready, but the consumer still has a third row of the group to consume.
    rows = [view("a", "g", group_size=3, group_pending=3), view("b", "g", group_size=3)]
    assert samplers.group(rows, 10) == []


def test_oldest_version_orders_by_min_version_then_creation() -> None:
    rows = [
        view("none", seq=0),
        view("v5", seq=1, versions=5),
        view("v2_late", seq=3, versions=2),
        view("v2_early", seq=2, versions=2),
    ]
    assert samplers.oldest_version(rows, 3) == ["v2_early", "v2_late", "v5"]
    assert samplers.oldest_version(rows, 10)[-1] == "none"


def test_token_budget_stops_before_the_budget() -> None:
    rows = [view(f"s{i}", seq=i, prompt_ids=3, response_ids=2) for i in range(5)]
    assert samplers.token_budget(rows, 10, max_tokens=14) == ["s0", "s1"]
    assert samplers.token_budget(rows, 10, max_tokens=15) == ["s0", "s1", "s2"]
    assert samplers.token_budget(rows, 2, max_tokens=100) == ["s0", "s1"]


def test_token_budget_returns_one_oversized_row() -> None:
    rows = [view("big", prompt_ids=1000), view("small", seq=1, prompt_ids=1)]
    assert samplers.token_budget(rows, 10, max_tokens=10) == ["big"]


def test_num_tokens_counts_whichever_fields_are_present() -> None:
    assert samplers.num_tokens(view("a", prompt_ids=4)) == 4
    assert samplers.num_tokens(view("a", response_ids=6)) == 6
    assert samplers.num_tokens(view("a", prompt_ids=4, response_ids=6)) == 10
    assert samplers.num_tokens(view("a")) == 0


def test_group_token_budget() -> None:
    rows = [
        view(f"g{g}/{i}", f"g{g}", seq=2 * g + i, group_size=2, prompt_ids=5)
        for g in range(3)
        for i in range(2)
    ]
    assert samplers.group_token_budget(rows, 10, max_tokens=25) == ["g0/0", "g0/1", "g1/0", "g1/1"]
    assert samplers.group_token_budget(rows, 10, max_tokens=3) == ["g0/0", "g0/1"]
    assert samplers.group_token_budget(rows, 3, max_tokens=100) == ["g0/0", "g0/1"]


@pytest.mark.parametrize(
    ("versions", "expected"),
    [([3, 1, 2], 1), (np.array([7, 4]), 4), (torch.tensor([9, 8]), 8), ([], None)],
)
def test_summarize_versions(versions: object, expected: int | None) -> None:
    assert samplers.summarize({"versions": versions, "reward": 1.0}) == {"versions": expected}


def test_missing_versions_rank_last() -> None:
    assert samplers.min_version(view("a")) == math.inf


def test_select_rejects_unknown_names_and_bad_options() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        samplers.select("random", [], 1)
    with pytest.raises(ValueError, match="max_tokens"):
        samplers.select("token_budget", [], 1)
    with pytest.raises(ValueError, match="no options"):
        samplers.select("fifo", [], 1, {"max_tokens": 3})


# -- properties ------------------------------------------------------------------------------

group_layouts = st.lists(
    st.integers(min_value=1, max_value=6).flatmap(
        lambda size: st.tuples(st.just(size), st.integers(min_value=0, max_value=size))
    ),
    max_size=12,
)


@given(layout=group_layouts, max_rows=st.integers(min_value=1, max_value=20))
def test_group_never_returns_a_partial_group(layout: list[tuple[int, int]], max_rows: int) -> None:
    sizes, ready = [s for s, _ in layout], [r for _, r in layout]
    rows = grouped(sizes, ready)
    chosen = samplers.group(rows, max_rows)
    per_group = Counter(sample_id.split("/")[0] for sample_id in chosen)
    for group_id, count in per_group.items():
        assert count == sizes[int(group_id[1:])] == ready[int(group_id[1:])]
    complete = [g for g, (s, r) in enumerate(layout) if s == r]
    if complete:  # progress: the oldest complete group always goes out
        assert f"g{complete[0]}" in per_group
        assert len(chosen) <= max(max_rows, sizes[complete[0]])
    else:
        assert chosen == []


@given(
    lengths=st.lists(st.integers(min_value=0, max_value=50), max_size=30),
    max_rows=st.integers(min_value=1, max_value=40),
    max_tokens=st.integers(min_value=1, max_value=200),
)
def test_token_budget_is_a_fifo_prefix_within_budget(
    lengths: list[int], max_rows: int, max_tokens: int
) -> None:
    rows = [view(f"s{i}", seq=i, response_ids=n) for i, n in enumerate(lengths)]
    chosen = samplers.token_budget(rows, max_rows, max_tokens=max_tokens)
    assert chosen == [f"s{i}" for i in range(len(chosen))]
    assert len(chosen) <= max_rows
    if lengths:
        assert chosen
        total = sum(lengths[: len(chosen)])
        assert len(chosen) == 1 or total <= max_tokens
        if len(chosen) < min(max_rows, len(lengths)):  # stopped by the budget, not by rows
            assert total + lengths[len(chosen)] > max_tokens
