"""Collecting whole batches from the bus, for roles that need all of a batch at once.

A batch is complete when every one of its groups has been claimed. Batches complete in any
order (the rows of batch k+1 may be ready before those of batch k), so claimed rows are kept per
batch until their batch is complete; then `ack_batch` writes the caller's outputs and acks
exactly that batch's rows (rows of other batches that shared a lease become claimable again and
are claimed anew). The only bound used is the trainer's version v: admission control keeps
every live batch at or below v + max_staleness. Nothing else is remembered, so a role restarted
after a crash picks up wherever the pipeline is, with no saved state.

A role whose work on a batch lives in a state file it saves only now and then (the critic) sets
`defer_acks`: `ack_batch` then only marks the batch done, its leases are kept (and renewed), and
`commit` acks every done batch once the state file holds them. A crash in between loses
nothing: the runtime hands the role's leases back, and the restarted role, loaded from that
file, collects and trains those batches again.

Under dynamic sampling a training step may add refill rounds to its batch (same batch index,
group ids `b<k>-r<round>-p<j>`); each round is collected and returned on its own, keyed
`(batch_index, round)`, since it has as many groups as the feeder's batch.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.api.fields import group_round
from streamrl.bus.leases import LeaseKeeper

log = logging.getLogger(__name__)

BatchKey = tuple[int, int]
"""(batch index, refill round)."""


class BatchCollector:
    def __init__(
        self,
        bus,
        weights,
        *,
        consumer: str,
        fields: Sequence[str],
        groups_per_batch: int,
        max_staleness: int,
        max_rows: int,
        lease_s: float,
        defer_acks: bool = False,
    ):
        self.bus = bus
        self.weights = weights
        self.consumer = consumer
        self.fields = tuple(fields)
        self.groups_per_batch = groups_per_batch
        self.max_staleness = max_staleness
        self.max_rows = max_rows
        self.lease_s = lease_s
        self.claimed = False
        # batch key -> rows held; lease id -> (batch key -> sample ids of that lease)
        self._rows: dict[BatchKey, list[Mapping[str, Any]]] = defaultdict(list)
        self._leases: dict[str, dict[BatchKey, list[str]]] = {}
        self.defer_acks = defer_acks
        self._done: dict[str, list[str]] = defaultdict(list)  # lease id -> rows of done batches
        # Leases of done batches are held until `commit`; one that expired while the role
        # stalled lets its rows be redone.
        self._keeper = LeaseKeeper(
            bus, lease_s, on_expired=lambda lease_id, e: log.warning("%s: %s", lease_id, e)
        )

    def poll(self, wait_s: float = 0.0) -> tuple[BatchKey, list[Mapping[str, Any]]] | None:
        """Claim what is ready; return ((batch index, round), rows) of the oldest complete batch,
        or None. `claimed` tells whether this call took any rows."""
        self._keeper.keep(self._done)
        top = max(self.weights.latest_version(), 0) + self.max_staleness
        lease = self.bus.claim(
            self.consumer,
            self.fields,
            self.max_rows,
            sampler="group",
            where={"batch_index": ("<=", top)},
            lease_s=self.lease_s,
            wait_s=wait_s,
        )
        self.claimed = lease is not None
        if lease is not None:
            by_batch: dict[BatchKey, list[str]] = defaultdict(list)
            for row in lease.rows:
                key = (row["batch_index"], group_round(row["group_id"]))
                self._rows[key].append(row)
                by_batch[key].append(row["sample_id"])
            self._leases[lease.lease_id] = dict(by_batch)
        for b in sorted(self._rows):
            if len({r["group_id"] for r in self._rows[b]}) >= self.groups_per_batch:
                return b, list(self._rows[b])
        return None

    def ack_batch(self, b: BatchKey, writes: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Ack batch `b`'s rows; rows of other batches in the same leases go back to the bus.
        `writes` (the role's output fields) go out with the first ack, before any row is acked.
        With `defer_acks`, the writes go out now and the rows are only marked done: `commit`
        acks them."""
        if writes and self.defer_acks:
            self.bus.write(writes)
            writes = None
        for lease_id, by_batch in list(self._leases.items()):
            if b not in by_batch:
                continue
            if self.defer_acks:  # the lease keeps its other batches' rows until the commit
                self._done[lease_id].extend(by_batch.pop(b))
            else:
                self._ack_lease(lease_id, by_batch[b], writes)
                writes = None
        self._rows.pop(b, None)
        if writes:  # no lease of `b` left to carry them (not expected): write them anyway
            self.bus.write(writes)

    def commit(self) -> int:
        """Ack the rows of every done batch (the caller's saved state now holds them); rows of
        unfinished batches that shared their leases go back to the bus. Returns leases acked."""
        done, self._done = self._done, defaultdict(list)
        for lease_id, sample_ids in done.items():
            self._ack_lease(lease_id, sample_ids)
        return len(done)

    def _ack_lease(self, lease_id: str, sample_ids: list[str], writes=None) -> None:
        self.bus.ack(lease_id, sample_ids, writes=writes)
        for other, ids in self._leases.pop(lease_id).items():
            gone = set(ids)
            kept = [r for r in self._rows.get(other, []) if r["sample_id"] not in gone]
            if kept:
                self._rows[other] = kept
            else:
                self._rows.pop(other, None)
