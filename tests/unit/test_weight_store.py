"""The Ray weight store (`weights/dcs.py`): versions round-trip, and `wait_newer` blocks inside
the store until a publish instead of the caller polling; the feeder uses it when the policy
version holds it back."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray

from streamrl.api.role import LoopPolicy
from streamrl.api.weights import poll_newer
from streamrl.data.role import FeederRole
from streamrl.weights.collective_channel import GroupDirectory
from streamrl.weights.dcs import InProcessWeights, RayStoreClient, RayWeights


@pytest.fixture(scope="module")
def weights() -> Iterator[RayWeights]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield RayWeights.create()
    finally:
        ray.shutdown()


def test_publish_then_fetch_newer(weights: RayWeights) -> None:
    weights.publish(3, {"w": np.arange(4, dtype=np.float32)})  # arrays too: they become tensors
    assert weights.latest_version() == 3
    version, tensors = weights.fetch_newer(2)
    assert version == 3 and np.array_equal(tensors["w"], np.arange(4, dtype=np.float32))
    assert weights.fetch_newer(3) is None


def test_a_killed_store_restarts_under_its_handle_and_its_callers_see_no_error(
    weights: RayWeights,
) -> None:
    store = RayWeights.create()
    store.publish(3, {"w": np.ones(4, dtype=np.float32)})
    first = ray.get(store.handle.incarnation.remote())
    held = ray.get(store.handle.get_if_newer.remote(-1))  # its buckets: objects it owns
    waiter = store.handle.wait_newer.remote(3, 60.0)  # in flight when the process dies
    os.kill(first["pid"], signal.SIGKILL)

    second = ray.get(store.handle.incarnation.remote(), timeout=60)
    assert second["pid"] != first["pid"] and second["version"] == -1  # empty until republished
    assert store.fetch_newer(-1) is None

    class AnsweredBeforeItDied:  # a fetch that got the old process's answer, then lost it
        class get_if_newer:
            @staticmethod
            def remote(have_version: int) -> ray.ObjectRef:
                return ray.put(held)

    # The old process's objects are freed some time after its death (the owner's death reaches
    # the object store asynchronously): wait until they are, so the fetch below meets the loss.
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get([h[0] for h in held[1]], timeout=5)
        except ray.exceptions.ObjectLostError:
            break
        except ray.exceptions.GetTimeoutError:
            pass
        assert time.monotonic() < deadline, "the dead store's objects were never freed"
        time.sleep(0.1)
    assert RayStoreClient(AnsweredBeforeItDied()).fetch_newer(-1) is None

    store.publish(4, {"w": np.full(4, 2.0, dtype=np.float32)})  # what the trainer does
    assert ray.get(waiter, timeout=60) == 4
    version, tensors = store.fetch_newer(3)
    assert version == 4 and float(tensors["w"][0]) == 2.0
    ray.kill(store.handle)


def test_wait_newer_returns_when_a_version_is_published(weights: RayWeights) -> None:
    have = weights.latest_version()
    publisher = threading.Timer(0.5, weights.publish, (have + 1, {"w": np.zeros(2)}))
    started = time.monotonic()
    publisher.start()
    try:
        assert weights.wait_newer(have, 30.0) == have + 1
    finally:
        publisher.join()
    assert 0.4 < time.monotonic() - started < 25.0  # woken by the publish, not the timeout


def test_wait_newer_times_out_with_the_held_version(weights: RayWeights) -> None:
    have = weights.latest_version()
    started = time.monotonic()
    assert weights.wait_newer(have, 0.3) == have
    assert time.monotonic() - started >= 0.29
    assert weights.wait_newer(have - 1, 30.0) == have  # already newer: no wait


def test_many_waiters_do_not_hold_up_the_publish_that_wakes_them(weights: RayWeights) -> None:
    # More waiters than a threaded actor's 64 threads (the store was one): each would hold a
    # thread until its timeout, and the publish would queue behind them.
    have = weights.latest_version()
    waits = [weights.handle.wait_newer.remote(have, 60.0) for _ in range(150)]
    time.sleep(0.5)  # let them all start waiting
    weights.publish(have + 1, {"w": np.zeros(2)})
    assert ray.get(waits, timeout=30) == [have + 1] * 150


def test_the_collective_directory_holds_tagged_versions_on_the_same_async_actor(
    weights: RayWeights,
) -> None:
    # Its actor subclasses the store's: holding a version must stay a plain call there (an async
    # `set` called from `set_tagged` would be a coroutine nobody awaits, holding nothing).
    directory = GroupDirectory.create()
    assert directory.publish_tagged(4, {"w": np.ones(3)}, epoch=2)
    assert directory.call("state") == (4, 2)
    version, tensors = directory.fetch_newer(3)
    assert version == 4 and np.array_equal(tensors["w"], np.ones(3))
    assert not directory.publish_tagged(4, {"w": np.zeros(3)}, epoch=None)  # not newer


def test_poll_newer_asks_until_a_newer_version_or_the_timeout() -> None:
    answers = iter([3, 3, 4])  # a channel that cannot block: its service answers versions
    assert poll_newer(lambda: next(answers), 3, 30.0, interval_s=0.01) == 4
    started = time.monotonic()
    assert poll_newer(lambda: 3, 3, 0.2, interval_s=0.01) == 3
    assert time.monotonic() - started >= 0.19
    assert InProcessWeights().wait_newer(-1, 0.0) == -1  # nothing published, no wait


class _RoomyBus:
    def can_add(self, num_groups: int, wait_s: float = 0.0) -> bool:
        return True

    def add_rows(self, rows) -> None:
        raise AssertionError("the batch is not admissible yet")


class _Feeder:
    batch_prompts = 2

    def prompts(self, batch_index: int) -> list[int]:
        return [0, 1]


def test_feeder_waits_for_a_newer_version_when_the_bound_holds_it_back() -> None:
    waits: list[tuple[int, float]] = []
    role = FeederRole(
        _RoomyBus(),
        _Feeder(),
        start_batch=5,
        end_batch=10,
        newest_batch=lambda: 4,
        wait_for_batch=lambda batch, wait_s: waits.append((batch, wait_s)),
    )
    assert role.step() is True  # batch 5's prompts encoded while it may not be added yet
    assert role.step() is False
    assert waits == []  # wait_s = 0 (inline mode): never block
    role.configure(LoopPolicy(wait_s=0.05))
    assert role.step() is False
    assert waits == [(5, 0.05)]


def test_only_roles_that_the_bus_gives_work_to_wait_long() -> None:
    from streamrl.api.registry import role_spec
    from streamrl.runtime.roles import loop_policy

    for name in ("reward", "advantage", "feeder", "reference", "logp"):
        spec = role_spec(name)
        assert loop_policy(spec, 0.05, 1.0, True).wait_s == 1.0
        assert loop_policy(spec, 0.0, 1.0, False).wait_s == 0.0  # inline mode: never block
        assert loop_policy(spec, 0.05, None, True).wait_s == 0.05
    for name in ("rollout", "trainer", "critic"):  # they need a version or a step of their own
        assert loop_policy(role_spec(name), 0.05, 1.0, True).wait_s == 0.05


class _CountingWeights:
    """The Ray store, counting the rollout's `fetch_newer` round trips."""

    def __init__(self, inner: RayWeights):
        self.inner, self.fetches = inner, 0

    def wait_newer(self, have: int, timeout_s: float) -> int:
        return self.inner.wait_newer(have, timeout_s)

    def fetch_newer(self, have: int):
        self.fetches += 1
        return self.inner.fetch_newer(have)


class _VersionedEngine:
    def __init__(self, version: int):
        self.version = version


def test_rollout_asks_for_inflight_weights_only_after_a_publish(weights: RayWeights) -> None:
    """With a weight service that can wait, the decode loop's in-flight poll makes no round trip
    until the watcher has seen a newer version; then one fetch returns it."""
    from streamrl.api.engine import SamplingParams
    from streamrl.rollout.service import RolloutRole

    have = weights.latest_version()
    counting = _CountingWeights(weights)
    role = RolloutRole(
        None,
        counting,
        _VersionedEngine(have),
        params=SamplingParams(max_new_tokens=1),
        max_staleness=1,
        max_rows=1,
        inflight_updates=True,
        lease_s=10.0,
    )
    role.configure(LoopPolicy(wait_s=0.5))
    role._start_watcher()
    try:
        for _ in range(50):
            assert role.poll_inflight() is None
        assert counting.fetches == 0
        weights.publish(have + 1, {"w": np.ones(2)})
        deadline = time.monotonic() + 20.0
        update = None
        while update is None and time.monotonic() < deadline:
            update = role.poll_inflight()
            time.sleep(0.01)
        assert update is not None and update[0] == have + 1
        assert counting.fetches == 1
    finally:
        role.close()
