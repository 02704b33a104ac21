"""Trainer recovery in place, on the in-process bus: the trainer's acks wait for a checkpoint,
and after its loss the rows it trained since that checkpoint are served to the next trainer
again while those the checkpoint covers are acked. The whole path (a SIGKILLed trainer while
the other roles run on) is tests/integration/test_faults.py."""

from __future__ import annotations

from streamrl.bus.deferred import DeferredAcks
from streamrl.bus.local import LocalBus
from streamrl.config import load_config
from streamrl.config.derived import held_groups
from streamrl.runtime.recovery import settle_trainer_rows


def batch(b: int) -> list[dict]:
    return [
        {
            "sample_id": f"b{b}-{i}",
            "group_id": f"b{b}",
            "group_size": 2,
            "batch_index": b,
            "fields": {"prompt_ids": [1, 2]},
        }
        for i in range(2)
    ]


def train(trainer_bus, b: int) -> list[str]:
    lease = trainer_bus.claim("trainer", ["prompt_ids"], 8, where={"batch_index": ("==", b)})
    assert lease is not None, f"batch {b} is not claimable"
    trainer_bus.ack(lease.lease_id)
    return sorted(r["sample_id"] for r in lease.rows)


def test_acks_wait_for_the_checkpoint():
    bus = LocalBus()
    bus.register_consumer("trainer")
    for b in range(3):
        bus.add_rows(batch(b))
    trainer_bus = DeferredAcks(bus, lease_s=60.0)
    train(trainer_bus, 0)
    train(trainer_bus, 1)
    assert bus.num_groups_live() == 3  # trained, but no checkpoint holds them yet
    assert trainer_bus.commit() == 2
    assert bus.num_groups_live() == 1
    assert trainer_bus.stats()["rows_live"] == 2  # everything else goes to the bus


def test_a_lost_trainer_leaves_the_rows_after_its_checkpoint_for_the_next_one():
    bus = LocalBus()
    bus.register_consumer("trainer")
    for b in range(4):
        bus.add_rows(batch(b))
    lost = DeferredAcks(bus, lease_s=60.0)
    for b in range(3):
        train(lost, b)  # the checkpoint after batch 0 (next_step=1) was written, not committed
    open_lease = lost.claim("trainer", ["prompt_ids"], 1, where={"batch_index": ("==", 3)})
    assert open_lease is not None  # mid-step when it died

    released, acked = settle_trainer_rows(bus, "trainer", next_step=1)
    assert released == 4  # three deferred acks' leases and the open one
    assert acked == 2  # batch 0: the checkpoint covers it
    assert bus.num_groups_live() == 3

    resumed = DeferredAcks(bus, lease_s=60.0)
    assert [train(resumed, b) for b in (1, 2, 3)] == [
        ["b1-0", "b1-1"],
        ["b2-0", "b2-1"],
        ["b3-0", "b3-1"],
    ]
    resumed.commit()
    assert bus.num_groups_live() == 0


def test_the_bus_grows_by_the_batches_a_checkpoint_may_leave_unacked():
    in_place = load_config(["trainer.checkpoint_every=5"])
    assert held_groups(in_place, groups_per_step=4) == 20
    every_role = load_config(
        ["trainer.checkpoint_every=5", "runtime.ray.trainer_recovery=restart_all"]
    )
    assert held_groups(every_role, groups_per_step=4) == 0
    assert held_groups(load_config(["trainer.checkpoint_every=0"]), groups_per_step=4) == 0


def test_only_ray_runs_keep_rows_for_recovery():
    inline = load_config(["trainer.checkpoint_every=5", "runtime.mode=inline"])
    assert held_groups(inline, groups_per_step=4) == 0
