"""A restartable Ray bus whose shard process is SIGKILLed: Ray brings the shard back empty under the
same handle, calls wait until it is restored, work its predecessor leased out is forgiven, and
its rows can be re-added under their own ids while the other shards keep theirs."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest

from tests.contract.test_bus_contract import group_rows, ray_cluster  # noqa: F401 - fixture

GROUPS = ["a", "b", "g", "h", "p", "q"]


def restarted_pid(shard: Any, old_pid: int, timeout_s: float = 60.0) -> int:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = ray.get(shard.ping.remote(), timeout=timeout_s)
        if pid != old_pid:
            return pid
        time.sleep(0.1)
    raise AssertionError("the shard was not restarted")


@pytest.mark.parametrize("shards", [1, 3])
def test_a_lost_shard_restarts_empty_holds_calls_until_restored_and_forgives_lost_work(
    ray_cluster: None,  # noqa: F811 - the fixture
    shards: int,
) -> None:
    import ray

    from streamrl.bus.ray_bus import RayBus

    bus = RayBus.create(shards=shards, restartable=True)
    try:
        bus.register_consumer("trainer")
        rows = [row for g in GROUPS for row in group_rows(g, 2, fields={"prompt": g})]
        bus.add_rows(rows)
        lease = bus.claim("trainer", ["prompt"], 100)
        assert len(lease.rows) == len(rows)
        k = bus.shard_of("a")
        lost = [r for r in rows if bus.shard_of(r["group_id"]) == k]
        kept = [r for r in rows if bus.shard_of(r["group_id"]) != k]
        assert kept or shards == 1

        shard = bus._shards[k]
        old_pid = ray.get(shard.ping.remote())
        os.kill(old_pid, signal.SIGKILL)
        restarted_pid(shard, old_pid)

        answers: list[Any] = []
        waiting = threading.Thread(target=lambda: answers.append(bus.stats()))
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and not answers, "a call went through before the restore"
        bus.restore_shard(k, ["trainer"], freed=["old/0"])
        waiting.join(timeout=60)
        assert answers[0]["rows_live"] == len(kept)

        # The lease's rows on the lost shard are void: acking it is forgiven there (counted)
        # and real elsewhere; writes to the lost rows are dropped the same way.
        bus.write({lost[0]["sample_id"]: {"reward": 1.0}})
        bus.ack(lease.lease_id)
        stats = bus.stats()
        assert stats["rows_live"] == 0 and stats["rows_freed"] == len(kept)
        assert stats["lost_calls"] == 2

        # The lost rows come back under their own ids; the others (consumed) are skipped.
        bus.restore_rows(rows)
        again = bus.claim("trainer", ["prompt"], 100)
        assert sorted(r["sample_id"] for r in again.rows) == sorted(r["sample_id"] for r in lost)
        assert [r["prompt"] for r in again.rows] == [r["fields"]["prompt"] for r in lost]
        assert bus.stats()["duplicate_adds"] == len(kept)
        bus.ack(again.lease_id)
        assert bus.stats()["rows_live"] == 0
    finally:
        bus.close()


def test_payloads_outlive_shard_0_whose_process_owned_their_keeper(
    ray_cluster: None,  # noqa: F811 - the fixture
) -> None:
    """Large values are owned by a keeper that shard 0 started; on a restartable bus it is a
    named, detached actor, so rows on the other shards stay readable when shard 0 is lost."""
    import ray
    import torch

    from streamrl.bus.ray_bus import RayBus

    bus = RayBus.create(shards=3, restartable=True, inline_bytes=64)
    try:
        bus.register_consumer("trainer")
        big = {g: torch.full((256,), float(i)) for i, g in enumerate(GROUPS)}
        bus.add_rows([row for g in GROUPS for row in group_rows(g, 1, fields={"x": big[g]})])
        kept = [g for g in GROUPS if bus.shard_of(g) != 0]
        assert kept

        shard = bus._shards[0]
        old_pid = ray.get(shard.ping.remote())
        os.kill(old_pid, signal.SIGKILL)
        restarted_pid(shard, old_pid)
        bus.restore_shard(0, ["trainer"])

        lease = bus.claim("trainer", ["x"], 100)
        assert sorted(r["group_id"] for r in lease.rows) == sorted(kept)
        for row in lease.rows:
            assert torch.equal(row["x"], big[row["group_id"]])
        bus.add_rows(group_rows("new", 1, fields={"x": torch.ones(256)}))  # a keeper again
        assert torch.equal(bus.claim("trainer", ["x"], 1).rows[0]["x"], torch.ones(256))
    finally:
        bus.close()
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not any(n.startswith("streamrl-keeper-") for n in names), names
