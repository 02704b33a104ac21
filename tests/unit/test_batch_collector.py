"""BatchCollector's deferred acks: batches done but not yet saved stay leased, are acked by
`commit`, and come back after a crash (the runtime hands the role's leases back)."""

from __future__ import annotations

import numpy as np

from streamrl.api import fields as F
from streamrl.bus.batches import BatchCollector
from streamrl.bus.local import LocalBus
from streamrl.weights.dcs import InProcessWeights

CONSUMER = "critic_train"


def rows(b: int) -> list[dict]:
    return [
        {
            "sample_id": f"b{b}-s{k}",
            "group_id": f"b{b}",
            "group_size": 2,
            "batch_index": b,
            "fields": {F.PROMPT_IDS: np.arange(3)},
        }
        for k in range(2)
    ]


def pipeline(num_batches: int, *consumers: str) -> LocalBus:
    bus = LocalBus()
    for consumer in (CONSUMER, *consumers):
        bus.register_consumer(consumer)
    for b in range(num_batches):
        bus.add_rows(rows(b))
    return bus


def collector(bus: LocalBus, defer: bool) -> BatchCollector:
    return BatchCollector(
        bus,
        InProcessWeights(),
        consumer=CONSUMER,
        fields=[F.RETURNS],
        groups_per_batch=1,
        max_staleness=10,
        max_rows=64,
        lease_s=60,
        defer_acks=defer,
    )


def ready(bus: LocalBus, b: int) -> None:
    bus.write({r["sample_id"]: {F.RETURNS: np.zeros(2)} for r in rows(b)})


def claimable(bus: LocalBus) -> list[str]:
    lease = bus.claim(CONSUMER, [F.RETURNS], 64)
    if lease is None:
        return []
    bus.release_consumer(CONSUMER)
    return sorted(r["sample_id"] for r in lease.rows)


def test_done_batches_are_acked_only_by_commit_and_shared_leases_keep_their_rows() -> None:
    bus = pipeline(2)
    ready(bus, 0)
    ready(bus, 1)
    c = collector(bus, defer=True)
    key, got = c.poll()  # one lease holds both batches
    assert key == (0, 0) and len(got) == 2
    c.ack_batch(key)
    assert bus.stats()["rows_live"] == 4  # nothing acked yet
    key, got = c.poll()  # batch 1 is still this collector's: no claim needed
    assert key == (1, 0) and [r["sample_id"] for r in got] == ["b1-s0", "b1-s1"]
    assert c.commit() == 1
    assert bus.stats()["rows_live"] == 2  # batch 0 acked; batch 1 went back to the bus
    assert claimable(bus) == ["b1-s0", "b1-s1"]
    key, got = c.poll()  # claimed anew
    assert key == (1, 0) and len(got) == 2
    c.ack_batch(key)
    assert c.poll() is None  # nothing is collected twice
    c.commit()
    assert bus.stats()["rows_live"] == 0


def test_a_crash_before_the_commit_gives_the_done_batches_back() -> None:
    bus = pipeline(1)
    ready(bus, 0)
    c = collector(bus, defer=True)
    key, _ = c.poll()
    c.ack_batch(key)
    bus.release_consumer(CONSUMER)  # the runtime, when the role is lost
    again = collector(bus, defer=True)  # the restarted role, from its saved state
    key, got = again.poll()
    assert key == (0, 0) and len(got) == 2
    again.ack_batch(key)
    again.commit()
    assert bus.stats()["rows_live"] == 0


def test_without_deferral_ack_batch_acks_at_once() -> None:
    bus = pipeline(2)
    ready(bus, 0)
    ready(bus, 1)
    c = collector(bus, defer=False)
    key, _ = c.poll()
    c.ack_batch(key)
    assert bus.stats()["rows_live"] == 2
    assert claimable(bus) == ["b1-s0", "b1-s1"]  # the shared lease's other rows went back
    assert c.commit() == 0


def test_ack_batch_writes_the_outputs_of_every_row_then_acks() -> None:
    bus = pipeline(2, "trainer")  # the trainer reads what the role writes
    ready(bus, 0)
    ready(bus, 1)
    c = collector(bus, defer=False)
    key, got = c.poll()
    c.ack_batch(key, writes={r["sample_id"]: {F.ADVANTAGES: np.ones(2)} for r in got})
    lease = bus.claim("trainer", [F.ADVANTAGES], 64)
    assert sorted(r["sample_id"] for r in lease.rows) == ["b0-s0", "b0-s1"]
    assert claimable(bus) == ["b1-s0", "b1-s1"]  # batch 0 acked by this consumer
