"""Contract suite for ``streamrl.api.bus.Bus``: every implementation must pass every test.

Each test runs against ``LocalBus`` ("local"), ``RayBus`` with one shard ("ray") and ``RayBus``
with its rows spread over several shards ("ray-sharded") over a live local Ray instance. Ray is
started once for the module, only if a Ray case runs. Tests at the end cover what only the Ray
bus promises (payload ownership, pickling the client, merging claims across shards).
"""

from __future__ import annotations

import json
import pickle
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from streamrl.api.bus import Bus, BusFullError, UnknownSampleError
from streamrl.bus import LocalBus, make_bus

LEASE_S = 0.25  # short leases for expiry tests; the sleep after is LEASE_S + margin


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    import ray

    # "local": a fresh instance even when another Ray cluster runs on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


# Three shards: the group ids used below ("a", "b", "g", "h", ...) then land on different shards,
# so claims, capacity and leases are exercised across shards.
SHARDS = 3
BUS_PARAMS = {
    "local": ("local", {}),
    "ray": ("ray", {}),
    "ray-sharded": ("ray", {"shards": SHARDS}),
}


@pytest.fixture(params=list(BUS_PARAMS))
def make(request: pytest.FixtureRequest) -> Iterator[Callable[..., Bus]]:
    kind, options = BUS_PARAMS[request.param]
    if kind == "ray":
        request.getfixturevalue("ray_cluster")
    created: list[Bus] = []

    def factory(**kwargs: Any) -> Bus:
        bus = make_bus(kind, **options, **kwargs)
        created.append(bus)
        return bus

    yield factory
    for bus in created:
        bus.close()


@pytest.fixture
def bus(make: Callable[..., Bus]) -> Bus:
    bus = make()
    bus.register_consumer("trainer")
    return bus


def group_rows(
    group_id: str, size: int, *, batch_index: int = 0, fields: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    return [
        {
            "sample_id": f"{group_id}/{i}",
            "group_id": group_id,
            "group_size": size,
            "batch_index": batch_index,
            "fields": dict(fields or {}),
        }
        for i in range(size)
    ]


def ids(lease: Any) -> list[str]:
    assert lease is not None
    return [row["sample_id"] for row in lease.rows]


# -- basics --------------------------------------------------------------------------------


def test_implements_protocol(bus: Bus) -> None:
    assert isinstance(bus, Bus)


def test_claim_returns_meta_and_requested_fields_only(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2, batch_index=3, fields={"prompt_ids": [1, 2], "extra": 7}))
    lease = bus.claim("trainer", ["prompt_ids"], 10)
    assert lease is not None and lease.consumer == "trainer"
    assert lease.rows == [
        {
            "sample_id": "g/0",
            "group_id": "g",
            "group_size": 2,
            "batch_index": 3,
            "prompt_ids": [1, 2],
        },
        {
            "sample_id": "g/1",
            "group_id": "g",
            "group_size": 2,
            "batch_index": 3,
            "prompt_ids": [1, 2],
        },
    ]
    assert abs(lease.expires_at - (time.monotonic() + 60.0)) < 5.0


def test_batch_index_defaults_to_zero(bus: Bus) -> None:
    bus.add_rows([{"sample_id": "s", "group_id": "g", "group_size": 1}])
    lease = bus.claim("trainer", [], 1)
    assert lease is not None and lease.rows[0]["batch_index"] == 0


def test_claim_returns_none_when_fields_missing(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2))
    assert bus.claim("trainer", ["reward"], 10) is None


def test_fifo_respects_max_rows_and_creation_order(bus: Bus) -> None:
    bus.add_rows(group_rows("a", 3))
    bus.add_rows(group_rows("b", 3))
    assert ids(bus.claim("trainer", [], 4)) == ["a/0", "a/1", "a/2", "b/0"]
    assert ids(bus.claim("trainer", [], 4)) == ["b/1", "b/2"]
    assert bus.claim("trainer", [], 4) is None


def test_max_rows_must_be_positive(bus: Bus) -> None:
    with pytest.raises(ValueError, match="max_rows"):
        bus.claim("trainer", [], 0)


# -- consumers -------------------------------------------------------------------------------


def test_unknown_consumer_is_rejected(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    with pytest.raises(ValueError, match="unknown consumer 'critic'"):
        bus.claim("critic", [], 1)


def test_register_consumer_is_idempotent(bus: Bus) -> None:
    bus.register_consumer("trainer")
    bus.add_rows(group_rows("g", 1))
    bus.ack(bus.claim("trainer", [], 1).lease_id)
    assert bus.stats()["rows_live"] == 0


def test_add_rows_needs_a_consumer(make: Callable[..., Bus]) -> None:
    bus = make()
    with pytest.raises(ValueError, match="register_consumer"):
        bus.add_rows(group_rows("g", 1))


def test_row_freed_only_when_every_consumer_registered_at_add_time_acked(bus: Bus) -> None:
    bus.register_consumer("reward")
    bus.add_rows(group_rows("g", 1))
    bus.register_consumer("late")  # registered after the row: neither sees it nor blocks it
    assert bus.claim("late", [], 1) is None
    bus.ack(bus.claim("trainer", [], 1).lease_id)
    assert bus.stats()["rows_live"] == 1
    bus.ack(bus.claim("reward", [], 1).lease_id)
    stats = bus.stats()
    assert (stats["rows_live"], stats["rows_freed"], stats["groups_live"]) == (0, 1, 0)
    assert stats["acked"] == {"trainer": 1, "reward": 1, "late": 0}


def test_consumers_are_independent(bus: Bus) -> None:
    bus.register_consumer("reward")
    bus.add_rows(group_rows("g", 2, fields={"response_ids": [5]}))
    reward = bus.claim("reward", ["response_ids"], 10)
    trainer = bus.claim("trainer", ["response_ids"], 10)
    assert ids(reward) == ids(trainer) == ["g/0", "g/1"]
    bus.ack(trainer.lease_id)
    assert bus.claim("trainer", [], 10) is None
    assert bus.claim("reward", [], 10) is None  # still leased to reward


# -- add_rows --------------------------------------------------------------------------------


def test_readding_a_live_row_is_a_noop(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1, fields={"prompt_ids": [1]}))
    bus.add_rows(group_rows("g", 1, fields={"prompt_ids": [9]}))
    stats = bus.stats()
    assert (stats["rows_added"], stats["rows_live"], stats["duplicate_adds"]) == (1, 1, 1)
    assert bus.claim("trainer", ["prompt_ids"], 5).rows[0]["prompt_ids"] == [1]


def test_readding_a_freed_row_is_a_noop(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    bus.ack(bus.claim("trainer", [], 1).lease_id)
    bus.add_rows(group_rows("g", 1))
    assert bus.claim("trainer", [], 1) is None
    assert bus.stats()["rows_live"] == 0


@pytest.mark.parametrize("change", [{"group_id": "other"}, {"batch_index": 5}])
def test_readding_with_different_meta_raises(bus: Bus, change: dict[str, Any]) -> None:
    bus.add_rows(group_rows("g", 1))
    with pytest.raises(ValueError, match="re-added"):
        bus.add_rows([{**group_rows("g", 1)[0], **change}])


def test_group_size_must_agree_within_a_group(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2)[:1])
    with pytest.raises(ValueError, match="group_size"):
        bus.add_rows([{"sample_id": "g/1", "group_id": "g", "group_size": 3}])


def test_capacity_backpressure(make: Callable[..., Bus]) -> None:
    bus = make(capacity_groups=2)
    bus.register_consumer("trainer")
    bus.add_rows(group_rows("a", 2) + group_rows("b", 2))
    assert bus.num_groups_live() == 2
    assert not bus.can_add(1)
    with pytest.raises(BusFullError):
        # One row joins a live group, one opens a third group: the whole call is refused.
        bus.add_rows(
            [
                {"sample_id": "a/9", "group_id": "a", "group_size": 2},
                {"sample_id": "c/0", "group_id": "c", "group_size": 1},
            ]
        )
    assert bus.stats()["rows_added"] == 4
    bus.add_rows([{"sample_id": "a/9", "group_id": "a", "group_size": 2}])  # no new group: fits
    lease = bus.claim("trainer", [], 10, where={"group_id": ("==", "a")})
    bus.ack(lease.lease_id)
    assert bus.num_groups_live() == 1
    assert bus.can_add(1) and not bus.can_add(2)
    bus.add_rows(group_rows("c", 1))
    assert bus.num_groups_live() == 2


# -- write -----------------------------------------------------------------------------------


def test_fields_written_in_any_order_by_any_role(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    bus.write({"g/0": {"reward": 1.0}})
    assert bus.claim("trainer", ["response_ids", "reward"], 1) is None
    bus.write({"g/0": {"response_ids": [3, 4]}})
    lease = bus.claim("trainer", ["response_ids", "reward"], 1)
    assert lease.rows[0]["reward"] == 1.0 and lease.rows[0]["response_ids"] == [3, 4]


def test_duplicate_write_keeps_first_value(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    bus.write({"g/0": {"reward": 1.0}})
    bus.write({"g/0": {"reward": 0.0, "advantages": [0.5]}})
    lease = bus.claim("trainer", ["reward", "advantages"], 1)
    assert lease.rows[0]["reward"] == 1.0 and lease.rows[0]["advantages"] == [0.5]
    assert bus.stats()["duplicate_writes"] == 1


def test_write_to_freed_row_is_ignored_and_counted(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    bus.ack(bus.claim("trainer", [], 1).lease_id)
    bus.write({"g/0": {"reward": 1.0, "x": 2}})
    stats = bus.stats()
    assert stats["late_writes"] == 2 and stats["rows_live"] == 0


def test_write_to_unknown_sample_raises_and_writes_nothing(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    with pytest.raises(UnknownSampleError, match="nope"):
        bus.write({"g/0": {"reward": 1.0}, "nope": {"reward": 2.0}})
    assert bus.claim("trainer", ["reward"], 1) is None


def test_reserved_field_names_are_rejected(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    with pytest.raises(ValueError, match="reserved"):
        bus.write({"g/0": {"group_id": "x"}})


def test_tensor_values_round_trip(bus: Bus) -> None:
    logprobs = torch.linspace(-2.0, 0.0, 5)
    ids_ = np.arange(7, dtype=np.int64)
    bus.add_rows(group_rows("g", 1, fields={"prompt_ids": ids_}))
    bus.write({"g/0": {"rollout_logprobs": logprobs}})
    row = bus.claim("trainer", ["prompt_ids", "rollout_logprobs"], 1).rows[0]
    assert torch.equal(row["rollout_logprobs"], logprobs)
    np.testing.assert_array_equal(row["prompt_ids"], ids_)


# -- leases ----------------------------------------------------------------------------------


def test_leased_rows_are_not_claimed_twice_by_one_consumer(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2))
    first = bus.claim("trainer", [], 1)
    assert ids(bus.claim("trainer", [], 5)) == ["g/1"]
    assert bus.claim("trainer", [], 5) is None
    assert ids(first) == ["g/0"]
    assert bus.stats()["leases_open"] == 2


def test_release_makes_rows_claimable_at_once(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2))
    lease = bus.claim("trainer", [], 5)
    bus.release(lease.lease_id)
    assert ids(bus.claim("trainer", [], 5)) == ["g/0", "g/1"]
    assert bus.stats()["acked"]["trainer"] == 0


def test_release_consumer_gives_back_every_lease_of_a_dead_role(bus: Bus) -> None:
    bus.register_consumer("reward")
    bus.add_rows(group_rows("g", 2) + group_rows("h", 2))
    bus.claim("trainer", [], 2)
    bus.claim("trainer", [], 2)
    kept = bus.claim("reward", [], 4)
    assert bus.claim("trainer", [], 4) is None
    assert bus.release_consumer("trainer") == 2
    assert ids(bus.claim("trainer", [], 4)) == ["g/0", "g/1", "h/0", "h/1"]
    bus.ack(kept.lease_id)  # the other consumer's lease was untouched
    assert bus.stats()["acked"]["reward"] == 4
    assert bus.release_consumer("trainer") == 1


def test_partial_ack_returns_the_rest(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 3))
    lease = bus.claim("trainer", [], 5)
    bus.ack(lease.lease_id, ["g/1"])
    assert ids(bus.claim("trainer", [], 5)) == ["g/0", "g/2"]
    assert bus.stats()["acked"]["trainer"] == 1


def test_ack_of_rows_outside_the_lease_raises(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2))
    lease = bus.claim("trainer", [], 1)
    with pytest.raises(ValueError, match="does not hold"):
        bus.ack(lease.lease_id, ["g/1"])


def test_ack_is_idempotent(bus: Bus) -> None:
    bus.register_consumer("reward")
    bus.add_rows(group_rows("g", 2))
    lease = bus.claim("trainer", [], 5)
    bus.ack(lease.lease_id)
    bus.ack(lease.lease_id)  # a retried ack call
    bus.ack(lease.lease_id, ["g/0"])
    stats = bus.stats()
    assert stats["acked"]["trainer"] == 2 and stats["rows_live"] == 2


def test_ack_with_writes_writes_then_acks(bus: Bus) -> None:
    bus.register_consumer("reward")
    bus.add_rows(group_rows("g", 2, fields={"prompt_ids": [1, 2]}))
    lease = bus.claim("reward", ["prompt_ids"], 5)
    bus.ack(lease.lease_id, writes={"g/0": {"reward": 1.0}, "g/1": {"reward": 0.0}})
    assert bus.stats()["acked"]["reward"] == 2
    assert bus.claim("reward", ["prompt_ids"], 5) is None  # consumed
    rows = bus.claim("trainer", ["reward"], 5).rows  # and the fields are there
    assert {r["sample_id"]: r["reward"] for r in rows} == {"g/0": 1.0, "g/1": 0.0}


def test_ack_with_writes_may_write_rows_outside_the_lease(bus: Bus) -> None:
    bus.register_consumer("reward")
    bus.add_rows(group_rows("a", 1) + group_rows("b", 1))
    lease = bus.claim("reward", [], 1)
    assert ids(lease) == ["a/0"]
    bus.ack(lease.lease_id, writes={"a/0": {"reward": 1.0}, "b/0": {"reward": 0.5}})
    rows = bus.claim("trainer", ["reward"], 5).rows
    assert {r["sample_id"]: r["reward"] for r in rows} == {"a/0": 1.0, "b/0": 0.5}
    assert ids(bus.claim("reward", [], 5)) == ["b/0"]  # only the lease's row was acked


def test_ack_with_a_bad_write_writes_and_acks_nothing(bus: Bus) -> None:
    bus.register_consumer("reward")
    bus.add_rows(group_rows("g", 1))
    lease = bus.claim("reward", [], 5)
    with pytest.raises(UnknownSampleError):
        bus.ack(lease.lease_id, writes={"g/0": {"reward": 1.0}, "nope": {"reward": 0.0}})
    assert bus.stats()["acked"].get("reward", 0) == 0
    assert bus.claim("trainer", ["reward"], 5) is None  # nothing written
    bus.ack(lease.lease_id, writes={"g/0": {"reward": 1.0}})  # the lease is still good
    assert bus.stats()["acked"]["reward"] == 1


@pytest.mark.parametrize("method", ["ack", "release", "renew"])
def test_unknown_lease_raises(bus: Bus, method: str) -> None:
    with pytest.raises(ValueError, match="unknown lease"):
        getattr(bus, method)("no-such-lease")


def test_expired_lease_makes_rows_claimable_again(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2))
    lease = bus.claim("trainer", [], 5, lease_s=LEASE_S)
    assert bus.claim("trainer", [], 5) is None
    time.sleep(LEASE_S + 0.15)
    again = bus.claim("trainer", [], 5)
    assert ids(again) == ids(lease)
    stats = bus.stats()
    assert stats["expired_leases"] == 1 and stats["leases_open"] == 1


def test_ack_of_expired_lease_is_accepted(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2))
    slow = bus.claim("trainer", [], 5, lease_s=LEASE_S)
    time.sleep(LEASE_S + 0.15)
    retry = bus.claim("trainer", [], 1)  # re-claims g/0 after the expiry
    bus.ack(slow.lease_id)  # the slow holder finishes after all: both rows consumed
    assert bus.stats()["rows_live"] == 0
    bus.ack(retry.lease_id)  # the second holder's ack is a no-op
    stats = bus.stats()
    assert stats["acked"]["trainer"] == 2 and stats["rows_freed"] == 2


def test_renew_extends_the_lease(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    lease = bus.claim("trainer", [], 5, lease_s=LEASE_S)
    bus.renew(lease.lease_id, lease_s=30.0)
    time.sleep(LEASE_S + 0.15)
    assert bus.claim("trainer", [], 5) is None
    assert bus.stats()["expired_leases"] == 0
    bus.ack(lease.lease_id)
    assert bus.stats()["rows_live"] == 0


def test_renew_of_a_closed_lease_raises(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    lease = bus.claim("trainer", [], 5)
    bus.release(lease.lease_id)
    with pytest.raises(ValueError, match="no longer open"):
        bus.renew(lease.lease_id)


# -- claim filters and samplers ------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "value", "expected"),
    [
        ("==", 2, ["b2/0"]),
        ("<=", 2, ["b1/0", "b2/0"]),
        ("<", 2, ["b1/0"]),
        (">=", 2, ["b2/0", "b3/0"]),
        (">", 2, ["b3/0"]),
    ],
)
def test_where_filters_on_meta(bus: Bus, op: str, value: int, expected: list[str]) -> None:
    for batch_index in (1, 2, 3):
        bus.add_rows(group_rows(f"b{batch_index}", 1, batch_index=batch_index))
    assert ids(bus.claim("trainer", [], 10, where={"batch_index": (op, value)})) == expected


def test_where_rejects_unknown_keys_and_ops(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    with pytest.raises(ValueError, match="not row meta"):
        bus.claim("trainer", [], 1, where={"reward": ("==", 1)})
    with pytest.raises(ValueError, match="unknown op"):
        bus.claim("trainer", [], 1, where={"batch_index": ("!=", 1)})


def test_unknown_sampler_lists_valid_names(bus: Bus) -> None:
    with pytest.raises(ValueError, match="'fifo'.*'group'"):
        bus.claim("trainer", [], 1, sampler="random")


def test_bad_sampler_options_raise(bus: Bus) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        bus.claim("trainer", [], 1, sampler="token_budget")


def test_group_sampler_waits_for_every_row_of_the_group(bus: Bus) -> None:
    bus.add_rows(group_rows("a", 2) + group_rows("b", 3)[:2])  # b: 2 of 3 rows added yet
    bus.write({"a/0": {"reward": 1.0}})
    assert bus.claim("trainer", ["reward"], 10, sampler="group") is None
    bus.write({"a/1": {"reward": 0.0}, "b/0": {"reward": 1.0}, "b/1": {"reward": 1.0}})
    assert ids(bus.claim("trainer", ["reward"], 10, sampler="group")) == ["a/0", "a/1"]
    bus.add_rows(group_rows("b", 3)[2:])
    bus.write({"b/2": {"reward": 0.5}})
    assert ids(bus.claim("trainer", ["reward"], 10, sampler="group")) == ["b/0", "b/1", "b/2"]


def test_group_sampler_serves_the_rest_of_a_partly_acked_group(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 3))
    lease = bus.claim("trainer", [], 10, sampler="group")
    bus.ack(lease.lease_id, ["g/0"])
    assert ids(bus.claim("trainer", [], 10, sampler="group")) == ["g/1", "g/2"]


def test_group_sampler_does_not_split_a_group_held_by_another_lease(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2))
    bus.claim("trainer", [], 1)  # fifo takes g/0
    assert bus.claim("trainer", [], 10, sampler="group") is None


def test_oldest_version_sampler(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 3))
    bus.write(
        {
            "g/0": {"versions": np.array([5, 6])},
            "g/1": {"versions": torch.tensor([2, 7])},
            "g/2": {"versions": [4, 3]},
        }
    )
    lease = bus.claim("trainer", [], 2, sampler="oldest_version")
    assert ids(lease) == ["g/1", "g/2"]


def test_token_budget_sampler(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 4, fields={"prompt_ids": [0] * 3}))
    bus.write({f"g/{i}": {"response_ids": [1] * 2} for i in range(4)})
    lease = bus.claim(
        "trainer", ["response_ids"], 10, sampler="token_budget", sampler_options={"max_tokens": 12}
    )
    assert ids(lease) == ["g/0", "g/1"]  # 5 tokens each


def test_group_token_budget_sampler(bus: Bus) -> None:
    bus.add_rows(group_rows("a", 2, fields={"prompt_ids": [0] * 4}))
    bus.add_rows(group_rows("b", 2, fields={"prompt_ids": [0] * 4}))
    options = {"max_tokens": 12}
    lease = bus.claim("trainer", [], 10, sampler="group_token_budget", sampler_options=options)
    assert ids(lease) == ["a/0", "a/1"]


# -- long-poll claims (wait_s) ---------------------------------------------------------------


def run_later(*steps: tuple[float, Callable[[], None]]) -> Callable[[], None]:
    """Run each (delay, action) in turn on another thread; returns a join that re-raises."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for delay, action in steps:
                time.sleep(delay)
                action()
        except BaseException as e:  # re-raised in the test thread by join()
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> None:
        thread.join(timeout=10)
        assert not thread.is_alive()
        if errors:
            raise errors[0]

    return join


def test_empty_claim_waits_up_to_wait_s(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    start = time.monotonic()
    assert bus.claim("trainer", ["reward"], 1, wait_s=0.3) is None
    elapsed = time.monotonic() - start
    assert 0.29 <= elapsed < 3.0  # generous: a loaded CI machine stretches wall time


def test_waiting_claim_returns_once_the_field_is_written(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 2))
    join = run_later((0.2, lambda: bus.write({"g/1": {"reward": 1.0}})))
    start = time.monotonic()
    lease = bus.claim("trainer", ["reward"], 10, wait_s=5.0)
    elapsed = time.monotonic() - start
    join()
    assert ids(lease) == ["g/1"] and lease.rows[0]["reward"] == 1.0
    assert 0.15 <= elapsed < 4.5  # woken by the change, not by wait_s running out


def test_waiting_claim_returns_once_rows_are_added(bus: Bus) -> None:
    join = run_later((0.2, lambda: bus.add_rows(group_rows("g", 1, fields={"prompt_ids": [7]}))))
    start = time.monotonic()
    lease = bus.claim("trainer", ["prompt_ids"], 10, wait_s=5.0)
    elapsed = time.monotonic() - start
    join()
    assert ids(lease) == ["g/0"] and lease.rows[0]["prompt_ids"] == [7]
    assert 0.15 <= elapsed < 4.5  # woken by the change, not by wait_s running out


def test_unrelated_write_does_not_end_a_waiting_claim(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    join = run_later(
        (0.1, lambda: bus.write({"g/0": {"advantages": 0.5}})),
        (0.3, lambda: bus.write({"g/0": {"reward": 1.0}})),
    )
    start = time.monotonic()
    lease = bus.claim("trainer", ["reward"], 10, wait_s=5.0)
    elapsed = time.monotonic() - start
    join()
    assert ids(lease) == ["g/0"] and lease.rows[0]["reward"] == 1.0
    assert "advantages" not in lease.rows[0]
    # Not returned (empty or unusable) at the first write; woken by the second, before wait_s.
    assert 0.35 <= elapsed < 4.5


def test_can_add_waits_for_a_group_to_be_freed(make: Callable[..., Bus]) -> None:
    bus = make(capacity_groups=2)
    bus.register_consumer("trainer")
    bus.add_rows(group_rows("a", 2) + group_rows("b", 1))
    lease = bus.claim("trainer", [], 10)
    start = time.monotonic()
    assert not bus.can_add(1, wait_s=0.3)  # nothing freed: waits the whole time
    assert 0.29 <= time.monotonic() - start < 3.0
    # Acking one row of "a" frees no group; acking the other one does, and ends the wait.
    join = run_later(
        (0.1, lambda: bus.ack(lease.lease_id, ["a/0"])),
        (0.2, lambda: bus.ack(bus.claim("trainer", [], 10).lease_id, ["a/1"])),
    )
    start = time.monotonic()
    assert bus.can_add(1, wait_s=5.0)
    elapsed = time.monotonic() - start
    join()
    assert 0.25 <= elapsed < 4.5
    assert bus.can_add(1) and not bus.can_add(2)


def test_a_waiting_claim_wakes_once_a_row_holds_all_its_fields(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    join = run_later(
        (0.1, lambda: bus.write({"g/0": {"reward": 1.0}})),
        (0.3, lambda: bus.write({"g/0": {"advantages": 0.5}})),
    )
    start = time.monotonic()
    lease = bus.claim("trainer", ["reward", "advantages"], 10, wait_s=5.0)
    elapsed = time.monotonic() - start
    join()
    assert ids(lease) == ["g/0"] and lease.rows[0]["advantages"] == 0.5
    assert 0.25 <= elapsed < 4.5  # not at the first write; at the second, before wait_s


def test_a_partial_ack_wakes_the_consumers_waiting_claim(bus: Bus) -> None:
    """Acking part of a lease closes it; the rows left unacked are claimable again at once, and
    a claim of the same consumer already waiting gets them (not only when its wait runs out)."""
    bus.add_rows(group_rows("g", 2))
    lease = bus.claim("trainer", [], 2, lease_s=60.0)
    join = run_later((0.2, lambda: bus.ack(lease.lease_id, ["g/0"])))
    start = time.monotonic()
    again = bus.claim("trainer", [], 10, wait_s=5.0)
    elapsed = time.monotonic() - start
    join()
    assert ids(again) == ["g/1"]
    assert elapsed < 4.5


def test_a_lease_expiry_wakes_a_waiting_claim(bus: Bus) -> None:
    bus.add_rows(group_rows("g", 1))
    bus.claim("trainer", [], 1, lease_s=LEASE_S)
    start = time.monotonic()
    again = bus.claim("trainer", [], 1, wait_s=5.0)
    elapsed = time.monotonic() - start
    assert ids(again) == ["g/0"]
    assert LEASE_S - 0.01 <= elapsed < 4.5


def test_close_ends_a_waiting_claim(make: Callable[..., Bus], request) -> None:
    if request.node.callspec.params["make"] != "local":
        pytest.skip("closing a Ray bus kills its shard actors, and the waiting call with them")
    bus = make()
    bus.register_consumer("trainer")
    join = run_later((0.2, bus.close))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="closed"):
        bus.claim("trainer", ["reward"], 1, wait_s=5.0)
    join()
    assert time.monotonic() - start < 4.5


def test_release_consumer_ends_its_waiting_claims_empty(bus: Bus, request) -> None:
    """A role killed while its claim waits inside the bus leaves that call behind. Once its
    leases are handed back (the supervisor's `release_consumer`), such a claim must not lease the
    next rows to the dead caller (they would be held until the lease expired): it returns empty,
    and the rows go to the next claim."""
    if request.node.callspec.params["make"] == "ray-sharded":
        pytest.skip("across shards the claim loop runs in the caller, which dies with it")
    bus.add_rows(group_rows("g", 1))
    join = run_later(
        (0.2, lambda: bus.release_consumer("trainer")),
        (0.2, lambda: bus.write({"g/0": {"reward": 1.0}})),
    )
    start = time.monotonic()
    assert bus.claim("trainer", ["reward"], 10, wait_s=5.0) is None
    elapsed = time.monotonic() - start
    join()
    assert elapsed < 4.5  # ended by the release, not by wait_s running out
    assert ids(bus.claim("trainer", ["reward"], 10)) == ["g/0"]
    # Claims made after the release wait as before.
    bus.add_rows(group_rows("h", 1))
    join = run_later((0.2, lambda: bus.write({"h/0": {"reward": 1.0}})))
    assert ids(bus.claim("trainer", ["reward"], 10, wait_s=5.0)) == ["h/0"]
    join()


# -- drop, stats, checkpoints, close ---------------------------------------------------------


def test_drop_frees_rows_for_everyone(bus: Bus) -> None:
    bus.register_consumer("reward")
    bus.add_rows(group_rows("g", 3))
    lease = bus.claim("reward", [], 10)
    bus.drop(["g/0", "g/1"], "stale")
    bus.drop(["g/0"], "stale")  # already freed: nothing more to count
    assert ids(bus.claim("trainer", [], 10)) == ["g/2"]
    bus.ack(lease.lease_id)  # acking a lease whose rows were dropped is fine
    stats = bus.stats()
    assert stats["dropped"] == {"stale": 2}
    assert stats["rows_freed"] == 2 and stats["rows_live"] == 1
    with pytest.raises(UnknownSampleError):
        bus.drop(["never"], "stale")


def test_stats_has_every_counter(bus: Bus) -> None:
    expected = {
        "rows_live",
        "groups_live",
        "rows_added",
        "rows_freed",
        "acked",
        "dropped",
        "duplicate_adds",
        "duplicate_writes",
        "late_writes",
        "expired_leases",
        "leases_open",
        "ready",
    }
    assert set(bus.stats()) == expected


def test_stats_count_the_rows_each_consumer_could_claim_now(bus: Bus) -> None:
    """`ready`: per consumer, rows it could claim with the fields of its latest claim (a role's
    queue depth, `judge/queue_depth`); rows leased to it are not counted."""
    bus.register_consumer("judge")
    bus.add_rows(group_rows("g", 4))
    bus.write({"g/0": {"r": 1}, "g/1": {"r": 1}, "g/2": {"r": 1}})
    lease = bus.claim("judge", ["r"], 1)
    assert bus.stats()["ready"] == {"judge": 2}
    bus.ack(lease.lease_id)
    assert bus.stats()["ready"] == {"judge": 2}
    bus.claim("judge", ["other"], 1)  # its latest claim asks for a field no row has
    assert bus.stats()["ready"] == {"judge": 0}


def test_state_dict_round_trip_recognises_consumed_ids(make: Callable[..., Bus]) -> None:
    bus = make()
    bus.register_consumer("trainer")
    bus.add_rows(group_rows("g", 2))
    bus.ack(bus.claim("trainer", [], 1).lease_id)
    state = json.loads(json.dumps(bus.state_dict()))
    assert state["freed"] == ["g/0"]

    resumed = make()
    resumed.register_consumer("reward")  # a role that registered before the state was loaded
    resumed.load_state_dict(state)
    resumed.add_rows(group_rows("g", 2))  # the feeder regenerates the in-flight group
    lease = resumed.claim("trainer", [], 10)
    assert ids(lease) == ["g/1"]
    resumed.ack(lease.lease_id)
    resumed.ack(resumed.claim("reward", [], 10).lease_id)
    stats = resumed.stats()
    assert stats["acked"] == {"trainer": 2, "reward": 1}
    assert (stats["rows_added"], stats["rows_freed"]) == (3, 2)
    resumed.add_rows(group_rows("h", 1))
    with pytest.raises(ValueError, match="live rows"):
        resumed.load_state_dict(state)


def test_close_is_idempotent_and_final(make: Callable[..., Bus]) -> None:
    bus = make()
    bus.register_consumer("trainer")
    bus.close()
    bus.close()
    with pytest.raises(RuntimeError, match="closed"):
        bus.stats()


# -- Ray only ------------------------------------------------------------------------------


@pytest.fixture(params=[1, SHARDS], ids=["1shard", f"{SHARDS}shards"])
def ray_bus(request: pytest.FixtureRequest, ray_cluster: None) -> Iterator[Any]:
    from streamrl.bus.ray_bus import RayBus

    bus = RayBus.create(shards=request.param)
    bus.register_consumer("trainer")
    yield bus
    bus.close()


def test_ray_bus_pickles_to_a_handle_and_works_from_a_task(ray_bus: Any) -> None:
    import ray

    assert len(pickle.dumps(ray_bus)) < 2_000

    # Remote code must not use this module's globals: workers cannot import test modules.
    row = group_rows("g", 1, fields={"prompt_ids": torch.arange(4)})[0]

    @ray.remote(num_cpus=0)
    def feeder(bus: Bus) -> None:
        bus.add_rows([row])

    ray.get(feeder.remote(ray_bus))
    lease = ray_bus.claim("trainer", ["prompt_ids"], 1)
    assert torch.equal(lease.rows[0]["prompt_ids"], torch.arange(4))


def test_ray_field_values_survive_the_writer(ray_bus: Any) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Writer:
        def write(self, bus: Bus, rows: list[dict[str, Any]]) -> None:
            bus.add_rows(rows)
            bus.write({"g/0": {"response_ids": np.arange(100_000)}})  # large: in the store

    writer = Writer.remote()
    ray.get(writer.write.remote(ray_bus, group_rows("g", 1)))
    ray.kill(writer)
    time.sleep(0.5)
    lease = ray_bus.claim("trainer", ["response_ids"], 1)
    np.testing.assert_array_equal(lease.rows[0]["response_ids"], np.arange(100_000))


def test_ray_attached_client_close_only_detaches(ray_bus: Any) -> None:
    from streamrl.bus.ray_bus import RayBus

    attached = RayBus.from_handle(ray_bus.handle)
    attached.close()
    with pytest.raises(RuntimeError, match="closed"):
        attached.stats()
    assert ray_bus.stats()["rows_live"] == 0


def test_local_bus_serves_claims_among_many_live_rows() -> None:
    # How fast is measured by benchmarks/bus.py, not asserted here.
    bus = LocalBus()
    bus.register_consumer("trainer")
    bus.register_consumer("reward")
    for g in range(2_500):
        bus.add_rows(group_rows(f"g{g}", 4, fields={"prompt_ids": [1, 2, 3]}))
    for _ in range(100):
        bus.ack(bus.claim("trainer", ["prompt_ids"], 64).lease_id)
    assert bus.stats()["acked"]["trainer"] == 6_400


def _num_store_objects() -> int:
    # Ray has no public API for object-store usage; this private one is stable in the pinned Ray.
    import ray
    from ray._private.internal_api import memory_summary

    # This test's own cluster, not whichever one Ray's auto-detection would find.
    summary = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    match = re.search(r"Plasma memory usage \d+ MiB, (\d+) objects", summary)
    assert match is not None
    return int(match.group(1))


def _wait_for_store_objects(expected: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (count := _num_store_objects()) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


def test_ray_payload_is_freed_with_its_rows(ray_bus: Any) -> None:
    baseline = _wait_for_store_objects(0)
    big = {"response_ids": np.zeros(1_000_000)}  # 8 MB: lives in the object store
    ray_bus.add_rows(group_rows("g", 2))
    ray_bus.write({"g/0": big, "g/1": big})  # one payload shared by both rows
    assert _wait_for_store_objects(baseline + 1) == baseline + 1
    lease = ray_bus.claim("trainer", ["response_ids"], 1)
    ray_bus.ack(lease.lease_id)
    del lease
    time.sleep(0.5)
    assert _num_store_objects() == baseline + 1  # g/1 still references the payload
    ray_bus.drop(["g/1"], "test")
    assert _wait_for_store_objects(baseline) == baseline


# -- Ray, several shards ---------------------------------------------------------------------


@pytest.fixture
def sharded(ray_cluster: None) -> Iterator[Any]:
    from streamrl.bus.ray_bus import RayBus

    bus = RayBus.create(shards=SHARDS, capacity_groups=None)
    bus.register_consumer("trainer")
    yield bus
    bus.close()


def _groups_per_shard(bus: Any) -> list[int]:
    import ray

    shards, _ = ray.get(bus.handle.topology.remote())
    return ray.get([shard.num_groups_live.remote() for shard in shards])


def test_sharded_claims_merge_shards_in_creation_order(sharded: Any) -> None:
    for g in range(6):
        sharded.add_rows(group_rows(f"g{g}", 2))
    assert sum(1 for n in _groups_per_shard(sharded) if n) > 1  # really spread
    created = [f"g{g}/{i}" for g in range(6) for i in range(2)]
    first = sharded.claim("trainer", [], 5)
    assert ids(first) == created[:5]
    assert ids(sharded.claim("trainer", [], 100)) == created[5:]  # the rest came back at once
    whole = sharded.claim("trainer", [], 3, sampler="group")
    assert whole is None  # every row is leased
    sharded.release(first.lease_id)
    assert ids(sharded.claim("trainer", [], 3, sampler="group")) == ["g0/0", "g0/1"]


def test_sharded_partial_ack_routes_by_sample_id(sharded: Any) -> None:
    from streamrl.bus.ray_bus import RayBus

    sharded.add_rows(group_rows("a", 2) + group_rows("b", 2))  # "a" and "b": different shards
    lease = sharded.claim("trainer", [], 10)
    assert lease.lease_id.count(".") == 1  # spans two shards
    other = RayBus.from_handle(sharded.handle)  # has never seen these rows: must look them up
    other.ack(lease.lease_id, ["a/0", "b/1"])
    assert ids(sharded.claim("trainer", [], 10)) == ["a/1", "b/0"]
    other.write({"b/0": {"reward": 1.0}})
    with pytest.raises(UnknownSampleError):
        other.write({"nope": {"reward": 1.0}, "a/1": {"reward": 0.0}})
    assert sharded.stats()["acked"]["trainer"] == 2


def test_sharded_ack_with_writes_routes_each_write_to_its_shard(sharded: Any) -> None:
    sharded.register_consumer("reward")
    sharded.add_rows(group_rows("a", 2) + group_rows("b", 2))  # "a" and "b": different shards
    lease = sharded.claim("reward", [], 10)
    assert lease.lease_id.count(".") == 1  # spans two shards
    writes = {sid: {"reward": float(i)} for i, sid in enumerate(ids(lease))}
    sharded.ack(lease.lease_id, writes=writes)
    rows = sharded.claim("trainer", ["reward"], 10).rows
    assert {r["sample_id"]: r["reward"] for r in rows} == {
        s: v["reward"] for s, v in writes.items()
    }
    assert sharded.stats()["acked"]["reward"] == 4


def test_sharded_capacity_is_exact_under_concurrent_feeders(ray_cluster: None) -> None:
    from streamrl.bus.ray_bus import RayBus

    bus = RayBus.create(shards=SHARDS, capacity_groups=5)
    try:
        bus.register_consumer("trainer")

        def feed(name: str) -> None:
            for g in range(8):
                try:
                    bus.add_rows(group_rows(f"{name}{g}", 1))
                except BusFullError:
                    pass

        threads = [threading.Thread(target=feed, args=(name,)) for name in ("x", "y", "z")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert bus.num_groups_live() == 5 and not bus.can_add(1)
        assert sum(_groups_per_shard(bus)) == 5
    finally:
        bus.close()


def test_sharded_long_poll_wakes_on_any_shard(sharded: Any) -> None:
    for g in range(6):
        sharded.add_rows(group_rows(f"g{g}", 1))
    join = run_later((0.3, lambda: sharded.write({"g4/0": {"reward": 1.0}})))
    start = time.monotonic()
    lease = sharded.claim("trainer", ["reward"], 10, wait_s=5.0)
    elapsed = time.monotonic() - start
    join()
    assert ids(lease) == ["g4/0"] and 0.25 <= elapsed < 4.5  # woken before wait_s ran out


def test_ray_small_values_travel_inline_and_survive_the_writer(ray_bus: Any) -> None:
    import ray

    @ray.remote(num_cpus=0)
    class Writer:
        def write(self, bus: Bus, rows: list[dict[str, Any]]) -> None:
            bus.add_rows(rows)
            bus.write({"g/0": {"response_ids": np.arange(100)}})  # small: kept by the shard

    writer = Writer.remote()
    ray.get(writer.write.remote(ray_bus, group_rows("g", 1)))
    ray.kill(writer)
    time.sleep(0.5)
    lease = ray_bus.claim("trainer", ["response_ids"], 1)
    np.testing.assert_array_equal(lease.rows[0]["response_ids"], np.arange(100))


def test_ray_writer_owned_payloads_die_with_the_writer(ray_cluster: None) -> None:
    import ray
    from ray.exceptions import ObjectLostError

    from streamrl.bus.ray_bus import RayBus

    bus = RayBus.create(payload_owner="writer")
    try:
        bus.register_consumer("trainer")

        @ray.remote(num_cpus=0)
        class Writer:
            def write(self, bus: Bus) -> None:
                bus.write({"g/0": {"response_ids": np.arange(100_000)}})  # large: by reference

        bus.add_rows(group_rows("g", 1))
        writer = Writer.remote()
        ray.get(writer.write.remote(bus))
        ray.kill(writer)
        # The payload is lost once Ray has noticed its owner's death, which takes a moment on a
        # loaded machine: until then a claim may still read it (with a short lease, so the row
        # is offered again).
        deadline = time.monotonic() + 60
        with pytest.raises(ObjectLostError):  # the documented price of payload_owner="writer"
            while time.monotonic() < deadline:
                bus.claim("trainer", ["response_ids"], 1, lease_s=0.05)
                time.sleep(0.2)
    finally:
        bus.close()
