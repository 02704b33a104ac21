"""Keeping held rows leased: a role that holds rows longer than a lease (a trainer step waiting
for its slowest group, acks deferred until a checkpoint) renews their leases every third of the
lease's length, so the bus never hands them to another claimer meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class LeaseKeeper:
    """`keep(lease_ids)` renews the leases for `lease_s` once a third of it has passed since the
    last renewal (a no-op otherwise: call it on every turn). A lease that expired meanwhile (the
    role stalled past it) raises the bus's `ValueError`, or goes to `on_expired(lease_id,
    error)` when given: the caller says whether its rows may be redone."""

    def __init__(
        self,
        bus,
        lease_s: float,
        *,
        on_expired: Callable[[str, ValueError], None] | None = None,
    ) -> None:
        self.bus = bus
        self.lease_s = lease_s
        self.on_expired = on_expired
        self._renewed = time.monotonic()

    def keep(self, lease_ids: Iterable[str]) -> None:
        if time.monotonic() - self._renewed < self.lease_s / 3:
            return
        self._renewed = time.monotonic()
        for lease_id in lease_ids:
            try:
                self.bus.renew(lease_id, self.lease_s)
            except ValueError as e:
                if self.on_expired is None:
                    raise
                self.on_expired(lease_id, e)
