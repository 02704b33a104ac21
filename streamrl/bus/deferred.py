"""The trainer's view of the bus under in-place recovery: acks held until a checkpoint holds
their rows.

A trainer that restarts in place resumes at its latest checkpoint, so the bus must still hold
every row it trained since: its acks wait for `commit()`, called once a checkpoint is on disk,
while their leases are renewed so the rows stay the trainer's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from streamrl.bus.leases import LeaseKeeper

log = logging.getLogger(__name__)

COMMIT_THREADS = 8  # acks in flight at once when a checkpoint releases the held ones


class DeferredAcks:
    """The trainer's view of the bus: acks wait for `commit()`, called once a checkpoint is on
    disk; meanwhile their leases are renewed so the rows stay the trainer's. Everything else
    goes straight to the bus."""

    def __init__(self, bus, lease_s: float):
        self._bus = bus
        self.lease_s = lease_s
        self._held: list[tuple[str, Sequence[str] | None]] = []
        # A lease that expired while the trainer stalled: the held ack still counts.
        self._keeper = LeaseKeeper(
            bus, lease_s, on_expired=lambda lease_id, e: log.debug("%s: %s", lease_id, e)
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)

    def ack(
        self,
        lease_id: str,
        sample_ids: Sequence[str] | None = None,
        *,
        writes: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if writes:  # fields go out now; only the ack waits for the checkpoint
            self._bus.write(writes)
        self._held.append((lease_id, sample_ids))

    def claim(self, *args: Any, **kwargs: Any):
        self._keeper.keep(lease_id for lease_id, _ in self._held)
        return self._bus.claim(*args, **kwargs)

    def commit(self) -> int:
        """Send the held acks (the latest checkpoint covers their rows); returns how many.

        A checkpoint's worth of leases (`checkpoint_every` steps of micro-batches) is acked
        several at a time: one after the other, their round trips held the trainer up for most
        of a step at each checkpoint."""
        held, self._held = self._held, []
        with ThreadPoolExecutor(max_workers=min(COMMIT_THREADS, max(len(held), 1))) as pool:
            for done in [pool.submit(self._bus.ack, *ack) for ack in held]:
                done.result()  # a failed ack raises here, after the others were sent
        return len(held)
