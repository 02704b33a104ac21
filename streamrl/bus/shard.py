"""ShardBus: the state of one shard of a sharded bus (see ``streamrl.bus.ray_bus``).

A sharded bus splits its rows over N ``LocalBus``-like stores by group, so a group never spans
shards. Each shard answers for its own rows exactly as a ``LocalBus`` would; the client merges
the shards' answers. That needs a few operations ``LocalBus`` does not offer, added here:

- ``plan_add`` / ``add_rows_at``: two-phase add. The coordinator first asks every shard how
  many groups the rows would create and whether it already knows their sample ids under
  another group (validating without adding anything), checks the global capacity, then adds
  them with creation numbers (``seq``) drawn from one global counter, so creation order holds
  across shards.
- ``claim_as``: a claim under a lease id chosen by the client (the same id on every shard a
  claim touches) that also returns the ``RowView`` of each row, so the client can re-run the
  sampler over the union of the shards' picks.
- ``keep_only``: gives back the rows of a lease that lost in that merge.
- ``wait_ready``: a long poll that leases nothing: it returns True once the sampler would pick
  something here. The client waits on every shard and claims again as soon as one says yes.
- ``locate``, ``lease_ids``, ``release_consumer_ids``: routing and counting across shards.
- ``restore``: a shard whose process was lost and restarted comes back empty; it takes the
  consumers and the freed ids it is given, and from then on forgives what its clients still
  send about the rows it lost (``lost_calls``): an ack or release of a lease it never issued
  and a write or drop of a row it does not hold are counted and ignored, since those rows
  are regenerated under their own ids (``runtime/recovery.py``).

Merging is exact: every sampler walks the candidates in one order that all shards share
(creation order, or oldest version then creation order) and takes a prefix of it (whole groups,
for the group samplers) within ``max_rows`` and its budget. So the rows it would take from one
shard out of the union are among that shard's own pick, and re-running it over the union of
the picks gives what one store holding every row would give.

This subclass reads ``LocalBus`` internals (rows, groups, leases, waiters, the lock); the shared
contract suite runs both, which is what keeps the two in step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.api.bus import Lease
from streamrl.bus import samplers
from streamrl.bus.local import LocalBus, _Row, _Waiter
from streamrl.bus.validate import parse_row, where_predicates


class ShardBus(LocalBus):
    """One shard's rows; every ``LocalBus`` method works unchanged on them."""

    def __init__(self, capacity_groups: int | None = None, closed_leases_kept: int = 10_000):
        super().__init__(capacity_groups=capacity_groups, closed_leases_kept=closed_leases_kept)
        self._seqs: Mapping[str, int] | None = None  # creation numbers for the add in progress
        self._restored = False  # set by `restore`: forgive calls about the rows that were lost

    # -- a shard restarted after its process was lost ------------------------------------

    def restore(self, consumers: Sequence[str], freed: Sequence[str], next_seq: int) -> None:
        """Come back after a loss: register ``consumers``, remember ``freed`` (the ids a
        checkpoint says were consumed) and number new rows from ``next_seq`` on."""
        with self._locked(changes=True):
            for name in consumers:
                self._register(name)
            self._freed.update(freed)
            self._next_seq = max(self._next_seq, next_seq)
            self._counters.setdefault("lost_calls", 0)
            self._restored = True

    def next_seq(self) -> int:
        with self._locked():
            return self._next_seq

    def ack(self, lease_id: str, sample_ids=None, *, writes=None, summaries=None) -> None:
        with self._locked():
            if self._forgiven_lease(lease_id):
                return
            super().ack(lease_id, sample_ids, writes=writes, summaries=summaries)

    def release(self, lease_id: str) -> None:
        with self._locked():
            if self._forgiven_lease(lease_id):
                return
            super().release(lease_id)

    def write(self, updates, *, summaries=None) -> None:
        with self._locked():
            super().write(self._known(updates), summaries=summaries)

    def drop(self, sample_ids: Sequence[str], reason: str) -> None:
        with self._locked():
            super().drop(list(self._known(dict.fromkeys(sample_ids))), reason)

    def _forgiven_lease(self, lease_id: str) -> bool:
        """A restored shard: a lease issued by its lost predecessor (the caller's work on
        those rows is void; they are regenerated)."""
        known = lease_id in self._leases or lease_id in self._closed_leases
        if self._restored and not known:
            self._counters["lost_calls"] += 1
            return True
        return False

    def _known(self, by_id: Mapping[str, Any]) -> dict[str, Any]:
        """``by_id`` without the rows a restored shard never saw (lost with its predecessor)."""
        if not self._restored:
            return dict(by_id)
        kept = {s: v for s, v in by_id.items() if s in self._rows or s in self._freed}
        self._counters["lost_calls"] += len(by_id) - len(kept)
        return kept

    # -- two-phase add ---------------------------------------------------------------------

    def plan_add(
        self, rows: Sequence[Mapping[str, Any]], other_ids: Sequence[str] = ()
    ) -> tuple[int, int, dict[str, tuple[str, int] | None]]:
        """Phase one of an add: validate ``rows`` (the rows of this shard) as ``add_rows`` would,
        raising what it would raise, and change nothing.

        Returns how many new groups they would create here, how many groups are live here,
        and which of ``other_ids`` (sample ids of the same add routed to other shards) this
        shard has seen: ``(group_id, batch_index)`` if live, None if freed. A sample id seen
        here but routed elsewhere was re-added with another group.
        """
        parsed = [parse_row(row) for row in rows]
        with self._locked():
            if not self._pending:
                raise ValueError(
                    "add_rows() before any register_consumer(): rows would be freed at once "
                    "because no consumer waits for them; register the consuming roles first"
                )
            new_rows, _ = self._new_rows(parsed)
            num_new = len({r["group_id"] for r in new_rows} - self._groups.keys())
            seen: dict[str, tuple[str, int] | None] = {}
            for sample_id in other_ids:
                row = self._rows.get(sample_id)
                if row is not None:
                    seen[sample_id] = (row.group_id, row.batch_index)
                elif sample_id in self._freed:
                    seen[sample_id] = None
            return num_new, len(self._groups), seen

    def add_rows_at(
        self,
        rows: Sequence[Mapping[str, Any]],
        seqs: Mapping[str, int],
        summaries: Mapping[str, Mapping[str, Any]] | None = None,
        num_skipped: int = 0,
    ) -> None:
        """Phase two: ``add_rows`` with each new row's creation number given
        (``seqs[sample_id]``); ``num_skipped`` retried adds of rows freed on another shard are
        counted as duplicates here."""
        with self._lock:
            self._seqs = seqs
            try:
                self.add_rows(rows, summaries=summaries)
            finally:
                self._seqs = None
            self._counters["duplicate_adds"] += num_skipped

    def _insert(self, r, consumers, summaries) -> None:
        if self._seqs is not None:
            self._next_seq = self._seqs[r["sample_id"]]
        super()._insert(r, consumers, summaries)

    # -- claims merged across shards -----------------------------------------------------

    def claim_as(
        self,
        lease_id: str,
        consumer: str,
        fields: Sequence[str],
        max_rows: int,
        **claim_kwargs: Any,
    ) -> tuple[Lease, list[samplers.RowView]] | None:
        """``claim`` (same keyword arguments), but the lease gets ``lease_id``; also returns the
        sampler's view of each leased row, in lease order."""
        with self._lock:  # re-entrant; a waiting claim still releases it while it waits
            lease = self.claim(consumer, fields, max_rows, **claim_kwargs)
            if lease is None:
                return None
            record = self._leases.pop(lease.lease_id)
            self._leases[lease_id] = record
            lease.lease_id = lease_id
            rows = [self._rows[sample_id] for sample_id in record.sample_ids]
            for row in rows:
                row.leased_by[consumer] = lease_id
            return lease, [self._view(consumer, row) for row in rows]

    def keep_only(self, lease_id: str, sample_ids: Sequence[str]) -> None:
        """Shrink an open lease to ``sample_ids``; its other rows are claimable again at once
        (not consumed). A lease left empty is closed. A lease already closed is left alone."""
        keep = set(sample_ids)
        with self._locked(changes=True):
            record = self._leases.get(lease_id)
            if record is None:
                return
            if not keep & set(record.sample_ids):
                self._close_lease(lease_id)
                return
            for sample_id in record.sample_ids:
                row = self._rows.get(sample_id)
                if sample_id not in keep and row is not None:
                    if row.leased_by.get(record.consumer) == lease_id:
                        del row.leased_by[record.consumer]
            record.sample_ids = [s for s in record.sample_ids if s in keep]

    def wait_ready(
        self,
        consumer: str,
        fields: Sequence[str],
        max_rows: int,
        *,
        sampler: str = "fifo",
        where: Mapping[str, tuple[str, Any]] | None = None,
        sampler_options: Mapping[str, Any] | None = None,
        timeout_s: float = 0.0,
    ) -> bool:
        """Block until a claim with these arguments would get rows here (True) or
        ``timeout_s`` passes (False). Leases nothing."""
        fields = tuple(fields)
        predicates = where_predicates(where)
        deadline = time.monotonic() + timeout_s
        with self._locked():
            waiter = _Waiter(consumer, frozenset(fields), threading.Condition(self._lock))
            self._waiters.append(waiter)
            try:
                while True:
                    pending = self._pending_of(consumer)
                    candidates = self._candidates(consumer, pending, fields, predicates)
                    if samplers.select(sampler, candidates, max_rows, sampler_options):
                        return True
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    # Woken as a claim is (`LocalBus.claim`).
                    waiter.condition.wait(self._wait_cap(remaining))
                    if self._closed:
                        raise RuntimeError("the bus is closed")
                    self._expire_leases()
            finally:
                self._waiters.remove(waiter)

    # -- routing and counting across shards ------------------------------------------------

    def locate(self, sample_ids: Sequence[str]) -> list[str]:
        """The ids among ``sample_ids`` that this shard has seen (live or freed)."""
        with self._locked():
            return [s for s in sample_ids if s in self._rows or s in self._freed]

    def lease_ids(self) -> list[str]:
        """Ids of the open leases (a lease spanning shards is open on each of them)."""
        with self._locked():
            return list(self._leases)

    def release_consumer_ids(self, consumer: str) -> list[str]:
        """``release_consumer``, returning the ids of the leases it closed."""
        return self._release_consumer(consumer)

    # -- internals (caller holds the lock) --------------------------------------------------

    def _view(self, consumer: str, row: _Row) -> samplers.RowView:
        grp = self._groups[row.group_id]
        return samplers.RowView(
            sample_id=row.sample_id,
            group_id=row.group_id,
            group_size=row.group_size,
            batch_index=row.batch_index,
            seq=row.seq,
            group_pending=grp.pending[consumer] + max(0, grp.size - grp.num_added),
            summary=row.summary,
        )
