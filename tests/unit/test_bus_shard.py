"""ShardBus (one shard of the sharded Ray bus) and the payload helpers, without Ray.

The full behaviour of a sharded bus is covered by the contract suite ("ray-sharded"); these
tests pin the per-shard operations the client builds on.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from streamrl.bus.payload import approx_nbytes, store
from streamrl.bus.shard import ShardBus


def rows(group_id: str, size: int, **fields: object) -> list[dict]:
    return [
        {"sample_id": f"{group_id}/{i}", "group_id": group_id, "group_size": size, "fields": fields}
        for i in range(size)
    ]


@pytest.fixture
def shard() -> ShardBus:
    bus = ShardBus()
    bus.register_consumer("trainer")
    return bus


def test_plan_add_validates_and_changes_nothing(shard: ShardBus) -> None:
    shard.add_rows(rows("a", 2))
    shard.ack(shard.claim("trainer", [], 1).lease_id)  # a/0 freed, a/1 live
    assert shard.plan_add(rows("a", 2) + rows("b", 1), ["a/0", "a/1", "zz"]) == (
        1,
        1,
        {"a/0": None, "a/1": ("a", 0)},
    )
    assert shard.stats()["rows_added"] == 2
    with pytest.raises(ValueError, match="group_size"):
        shard.plan_add([{"sample_id": "a/7", "group_id": "a", "group_size": 5}])
    with pytest.raises(ValueError, match="register_consumer"):
        ShardBus().plan_add(rows("c", 1))


def test_add_rows_at_uses_the_given_creation_numbers(shard: ShardBus) -> None:
    shard.add_rows_at(rows("a", 2), {"a/0": 10, "a/1": 11}, num_skipped=1)
    shard.add_rows_at(rows("b", 1), {"b/0": 40})
    lease, views = shard.claim_as("L1", "trainer", [], 10)
    assert [v.seq for v in views] == [10, 11, 40]
    assert [v.group_pending for v in views] == [2, 2, 1]
    assert lease.lease_id == "L1" and shard.lease_ids() == ["L1"]
    assert shard.stats()["duplicate_adds"] == 1


def test_keep_only_gives_back_the_rest(shard: ShardBus) -> None:
    shard.add_rows(rows("a", 3))
    shard.claim_as("L1", "trainer", [], 10)
    shard.keep_only("L1", ["a/1"])
    assert shard.claim("trainer", [], 10).sample_ids == ["a/0", "a/2"]
    shard.ack("L1")
    assert shard.stats()["acked"]["trainer"] == 1
    shard.keep_only("L1", [])  # already closed: nothing happens
    shard.add_rows(rows("b", 1))
    shard.claim_as("L2", "trainer", [], 10)
    shard.keep_only("L2", [])  # nothing kept: the lease closes
    assert "L2" not in shard.lease_ids()
    assert shard.claim("trainer", [], 10).sample_ids == ["b/0"]


def test_wait_ready_returns_on_a_matching_write_and_leases_nothing(shard: ShardBus) -> None:
    shard.add_rows(rows("a", 1))
    timer = threading.Timer(0.1, lambda: shard.write({"a/0": {"advantages": 0.5}}))
    timer.start()
    threading.Timer(0.3, lambda: shard.write({"a/0": {"reward": 1.0}})).start()
    start = time.monotonic()
    assert shard.wait_ready("trainer", ["reward"], 1, timeout_s=5.0)
    assert 0.25 <= time.monotonic() - start < 2.0  # the unrelated write did not end it
    assert shard.lease_ids() == []
    start = time.monotonic()
    assert not shard.wait_ready("trainer", ["missing"], 1, timeout_s=0.2)
    assert time.monotonic() - start >= 0.2


def test_wait_ready_applies_the_sampler(shard: ShardBus) -> None:
    shard.add_rows(rows("a", 2)[:1])  # one of two rows: no whole group yet
    assert shard.wait_ready("trainer", [], 1, timeout_s=0.0)
    assert not shard.wait_ready("trainer", [], 1, sampler="group", timeout_s=0.1)


def test_locate_and_release_consumer_ids(shard: ShardBus) -> None:
    shard.add_rows(rows("a", 2))
    shard.ack(shard.claim("trainer", [], 1).lease_id)
    assert shard.locate(["a/0", "a/1", "zz"]) == ["a/0", "a/1"]
    shard.claim_as("L1", "trainer", [], 10)
    assert shard.release_consumer_ids("trainer") == ["L1"]


def test_approx_nbytes() -> None:
    assert approx_nbytes(np.zeros(10, dtype=np.int64)) == 80
    assert approx_nbytes(torch.zeros(10, dtype=torch.float32)) == 40
    assert approx_nbytes([1, 2, 3]) == 24
    assert approx_nbytes({"a": np.zeros(4, dtype=np.int8), "b": [np.zeros(2)]}) == 20
    assert approx_nbytes("abc") == 3 and approx_nbytes(1.5) == 8


def test_store_keeps_small_values_inline_without_touching_ray() -> None:
    values = {"s": {"response_ids": np.arange(10), "reward": 1.0}}
    out = store(values, inline_bytes=1024, adopt=None)
    assert out["s"]["reward"] == 1.0 and out["s"]["response_ids"] is values["s"]["response_ids"]
    assert out["s"] is not values["s"]
