"""`LeaseKeeper` (streamrl/bus/leases.py): held rows stay leased past their lease's length, and
a lease that expired anyway is reported as the caller asks. The bus and the keeper both read
`time.monotonic`, which these tests drive by hand: no sleeps, no timing luck."""

from __future__ import annotations

import time

import pytest

from streamrl.bus.leases import LeaseKeeper
from streamrl.bus.local import LocalBus

LEASE_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


def held_lease(bus: LocalBus) -> str:
    bus.register_consumer("trainer")
    bus.add_rows(
        [{"sample_id": "g-0", "group_id": "g", "group_size": 1, "batch_index": 0, "fields": {}}]
    )
    lease = bus.claim("trainer", [], 1, lease_s=LEASE_S)
    assert lease is not None
    return lease.lease_id


def test_a_kept_lease_outlives_its_length(clock: Clock) -> None:
    bus = LocalBus()
    lease_id = held_lease(bus)
    keeper = LeaseKeeper(bus, LEASE_S)
    for _ in range(40):  # four lease lengths, a turn every tenth of one
        clock.now += LEASE_S / 10
        keeper.keep([lease_id])
    assert bus.claim("trainer", [], 1) is None  # still ours: nobody else may take the row
    bus.ack(lease_id)  # and it still acks


def test_a_lease_left_alone_expires(clock: Clock) -> None:
    bus = LocalBus()
    held_lease(bus)
    clock.now += LEASE_S * 1.5
    assert bus.claim("trainer", [], 1) is not None  # so the check above can fail


def test_an_expired_lease_raises_or_goes_to_the_callback(clock: Clock) -> None:
    bus = LocalBus()
    lease_id = held_lease(bus)
    strict = LeaseKeeper(bus, LEASE_S)
    expired: list[str] = []
    lenient = LeaseKeeper(bus, LEASE_S, on_expired=lambda lid, e: expired.append(lid))
    clock.now += LEASE_S * 1.5
    assert bus.claim("trainer", [], 1) is not None  # the row has a new holder
    with pytest.raises(ValueError, match="no longer open"):
        strict.keep([lease_id])
    lenient.keep([lease_id])
    assert expired == [lease_id]
