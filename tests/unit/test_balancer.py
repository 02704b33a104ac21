"""Least-loaded routing over several engines (`streamrl/rollout/balancer.py`): groups stay whole,
work spreads by tokens in flight, full engines take nothing, finished work frees room."""

from __future__ import annotations

import pytest

from streamrl.rollout.balancer import LeastLoaded, Unit, group_by_prompt, spread


def test_samples_of_a_prompt_travel_together_in_first_seen_order() -> None:
    items = [("p1", 5), ("p2", 3), ("p1", 5), ("p3", 4), ("p2", 3)]
    units = group_by_prompt(items, prompt_of=lambda i: i[0], cost_of=lambda i: i[1])
    assert [[i[0] for i in u.items] for u in units] == [["p1", "p1"], ["p2", "p2"], ["p3"]]
    assert [u.cost for u in units] == [10, 6, 4]


def test_equal_groups_alternate_between_engines() -> None:
    units = [Unit([f"g{i}"] * 8, 8 * 30) for i in range(6)]
    out = spread(units, num_engines=2, capacity=512)
    assert [len(e) for e in out] == [3, 3]
    assert [u.items[0] for u in out[0]] == ["g0", "g2", "g4"]


def test_routing_follows_tokens_not_request_counts() -> None:
    # One long request loads engine 0; the short ones go to engine 1 until it carries more
    # tokens (120 > 100), then engine 0 takes the next.
    units = [Unit(["long"], 100)] + [Unit([name], 30) for name in "abcde"]
    out = spread(units, num_engines=2, capacity=512)
    assert [u.items for u in out[0]] == [["long"], ["e"]]
    assert [u.items for u in out[1]] == [["a"], ["b"], ["c"], ["d"]]


def test_full_engines_take_no_more_work_until_some_finishes() -> None:
    balancer = LeastLoaded(num_engines=2, capacity=4)
    balancer.start(0, 4, 40)
    assert balancer.pick() == 1
    balancer.start(1, 5, 10)  # a whole group may overshoot the capacity
    assert balancer.pick() is None
    balancer.finish(1, 2, 4)
    assert balancer.pick() == 1
    balancer.finish(0, 4, 40)
    assert balancer.pick() == 0  # empty again: fewest tokens
    assert balancer.routed == [4, 5]


def test_one_engine_takes_everything_up_to_its_capacity() -> None:
    units = [Unit([i], 10) for i in range(5)]
    assert [len(e) for e in spread(units, num_engines=1, capacity=3)] == [3]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="num_engines >= 1"):
        LeastLoaded(num_engines=0, capacity=4)
