"""LocalBus: the in-process field store.

Used directly in inline mode and in tests, and as the state inside the Ray bus actor. One lock
guards everything, so roles running in threads can share one instance.

Row lifecycle::

    add_rows ──► live ──(every consumer registered at add time has acked)──► freed
                  └─────────────────────(drop)─────────────────────────────► freed

Per consumer, a live row is *pending* (not yet acked) and, while pending, either claimable or
held by one open lease of that consumer. Each consumer keeps an index of its pending rows in
creation order, so a claim scans only that consumer's pending rows. Freed rows keep only their
sample id (to recognise retried adds and late writes); their field values are dropped.

Leases expire lazily: every public call first returns expired leases' rows to claimable.
Closed leases (acked, released or expired) are remembered for a while so that a late or
retried ``ack`` still lands.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from streamrl.api.bus import ROW_META_KEYS, BusFullError, Lease, UnknownSampleError
from streamrl.bus import samplers
from streamrl.bus.validate import Predicate, check_field_names, parse_row, where_predicates

_STATE_VERSION = 1


@dataclass(slots=True)
class _Row:
    sample_id: str
    group_id: str
    group_size: int
    batch_index: int
    seq: int
    values: dict[str, Any]
    summary: dict[str, Any]
    waiting_on: set[str]  # consumers that still have to ack this row
    leased_by: dict[str, str] = field(default_factory=dict)  # consumer -> open lease id


@dataclass(slots=True)
class _Group:
    size: int
    num_added: int = 0
    num_live: int = 0
    pending: dict[str, int] = field(default_factory=dict)  # consumer -> live rows not acked


@dataclass(slots=True)
class _Waiter:
    """A claim waiting for rows: whose, which fields it needs, and how to wake it."""

    consumer: str
    fields: frozenset[str]
    condition: threading.Condition


@dataclass(slots=True)
class _LeaseRecord:
    consumer: str
    sample_ids: list[str]
    lease_s: float
    expires_at: float


class LocalBus:
    """In-process implementation of ``streamrl.api.bus.Bus``.

    Args:
        capacity_groups: at most this many groups live at once (None: unbounded).
        closed_leases_kept: how many closed leases to remember for late acks.
    """

    def __init__(self, capacity_groups: int | None = None, closed_leases_kept: int = 10_000):
        if capacity_groups is not None and capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1 or None, got {capacity_groups}")
        self._capacity_groups = capacity_groups
        self._closed_leases_kept = closed_leases_kept
        self._lock = threading.RLock()
        # Claims waiting (wait_s > 0) for rows. A change wakes only the waiters it may let
        # claim something, so idle roles cost nothing.
        self._waiters: list[_Waiter] = []
        self._room = threading.Condition(self._lock)  # notified when a group is freed
        # Per consumer, how many times its leases were handed back wholesale (`release_consumer`,
        # when one of its processes died): a claim that was already waiting then gives up
        # instead of leasing rows to a caller that may be gone.
        self._releases: dict[str, int] = {}
        self._closed = False
        self._next_seq = 0
        self._rows: dict[str, _Row] = {}
        self._freed: set[str] = set()
        self._groups: dict[str, _Group] = {}
        self._pending: dict[str, dict[str, _Row]] = {}  # consumer -> pending rows, oldest first
        # Consumer -> the fields of its latest claim: `stats()["ready"]` counts the rows it
        # could claim now (a role's queue depth).
        self._claim_fields: dict[str, tuple[str, ...]] = {}
        self._leases: dict[str, _LeaseRecord] = {}
        self._closed_leases: OrderedDict[str, _LeaseRecord] = OrderedDict()
        self._counters = _new_counters()

    # -- consumers and rows ------------------------------------------------------------

    def register_consumer(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"consumer name must be a non-empty string, got {name!r}")
        with self._locked(changes=True):
            self._register(name)

    def add_rows(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        summaries: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """See ``Bus.add_rows``. ``summaries`` ({sample_id: {field: summary}}) is for callers
        whose field values are handles the bus cannot inspect (the Ray actor)."""
        parsed = [parse_row(row) for row in rows]
        with self._locked():
            if not self._pending:
                raise ValueError(
                    "add_rows() before any register_consumer(): rows would be freed at once "
                    "because no consumer waits for them; register the consuming roles first"
                )
            new_rows, num_duplicates = self._new_rows(parsed)
            new_groups = {r["group_id"] for r in new_rows if r["group_id"] not in self._groups}
            if not self._fits(len(new_groups)):
                raise BusFullError(
                    f"adding {len(new_groups)} groups would exceed capacity_groups="
                    f"{self._capacity_groups} ({len(self._groups)} live); wait for rows to be "
                    "consumed (can_add) and retry"
                )
            self._counters["duplicate_adds"] += num_duplicates
            consumers = set(self._pending)
            for r in new_rows:
                self._insert(r, consumers, summaries)
            self._wake({name for r in new_rows for name in r["fields"]})

    def can_add(self, num_groups: int, wait_s: float = 0.0) -> bool:
        deadline = time.monotonic() + wait_s
        with self._locked():
            # Woken when a group is freed (the last of its rows acked or dropped) or on close.
            while not self._fits(num_groups):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._room.wait(remaining)
                if self._closed:
                    raise RuntimeError("the bus is closed")
            return True

    def num_groups_live(self) -> int:
        with self._locked():
            return len(self._groups)

    def write(
        self,
        updates: Mapping[str, Mapping[str, Any]],
        *,
        summaries: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """See ``Bus.write``. ``summaries`` as in ``add_rows``."""
        written: list[_Row] = []
        with self._locked():
            for sample_id, values in updates.items():
                if sample_id not in self._rows and sample_id not in self._freed:
                    raise UnknownSampleError(sample_id)
                check_field_names(values)
            for sample_id, values in updates.items():
                row = self._rows.get(sample_id)
                if row is None:
                    self._counters["late_writes"] += len(values)
                    continue
                fresh = {k: v for k, v in values.items() if k not in row.values}
                self._counters["duplicate_writes"] += len(values) - len(fresh)
                row.values.update(fresh)
                row.summary.update(_summaries_for(sample_id, fresh, summaries))
                if fresh:
                    written.append(row)
            self._wake_for(written)

    # -- leases --------------------------------------------------------------------------

    def claim(
        self,
        consumer: str,
        fields: Sequence[str],
        max_rows: int,
        *,
        sampler: str = "fifo",
        where: Mapping[str, tuple[str, Any]] | None = None,
        lease_s: float = 60.0,
        sampler_options: Mapping[str, Any] | None = None,
        wait_s: float = 0.0,
    ) -> Lease | None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if isinstance(fields, str):
            raise TypeError(f"fields must be a sequence of field names, got the string {fields!r}")
        fields = tuple(fields)
        predicates = where_predicates(where)
        deadline = time.monotonic() + wait_s
        with self._locked():
            self._claim_fields[consumer] = fields
            lease = self._try_claim(
                consumer, fields, max_rows, sampler, predicates, lease_s, sampler_options
            )
            if lease is not None or wait_s <= 0:
                return lease
            waiter = _Waiter(consumer, frozenset(fields), threading.Condition(self._lock))
            self._waiters.append(waiter)
            releases = self._releases.get(consumer, 0)
            try:
                while lease is None and (remaining := deadline - time.monotonic()) > 0:
                    # Woken by a write, add or release that may make rows claimable, by
                    # `close`, or at the next lease expiry.
                    waiter.condition.wait(self._wait_cap(remaining))
                    if self._closed:
                        raise RuntimeError("the bus is closed")
                    if self._releases.get(consumer, 0) != releases:
                        # The consumer's leases were handed back while this claim waited: its
                        # caller may have died with the call still here (a lease granted now
                        # would hold rows until it expires). A live caller just claims again.
                        return None
                    self._expire_leases()
                    lease = self._try_claim(
                        consumer, fields, max_rows, sampler, predicates, lease_s, sampler_options
                    )
            finally:
                self._waiters.remove(waiter)
            return lease

    def _try_claim(
        self, consumer, fields, max_rows, sampler, predicates, lease_s, sampler_options
    ) -> Lease | None:
        """One claim attempt; the caller holds the lock."""
        pending = self._pending_of(consumer)
        candidates = self._candidates(consumer, pending, fields, predicates)
        chosen = samplers.select(sampler, candidates, max_rows, sampler_options)
        if not chosen:
            return None
        assert len(set(chosen)) == len(chosen), f"sampler {sampler!r} repeated rows"
        lease_id = uuid.uuid4().hex
        now = time.monotonic()
        record = _LeaseRecord(consumer, list(chosen), lease_s, now + lease_s)
        self._leases[lease_id] = record
        out_rows = []
        for sample_id in chosen:
            row = pending[sample_id]
            row.leased_by[consumer] = lease_id
            out = {k: getattr(row, k) for k in ROW_META_KEYS}
            out.update((f, row.values[f]) for f in fields)
            out_rows.append(out)
        return Lease(lease_id, consumer, out_rows, record.expires_at)

    def ack(
        self,
        lease_id: str,
        sample_ids: Sequence[str] | None = None,
        *,
        writes: Mapping[str, Mapping[str, Any]] | None = None,
        summaries: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """See ``Bus.ack``. ``summaries`` as in ``write``."""
        with self._locked():
            record = self._lease_record(lease_id)
            if sample_ids is None:
                acked = list(record.sample_ids)
            else:
                acked = list(sample_ids)
                unknown = set(acked) - set(record.sample_ids)
                if unknown:
                    raise ValueError(
                        f"ack of lease {lease_id!r} names sample ids it does not hold: "
                        f"{sorted(unknown)}"
                    )
            if writes:
                self.write(writes, summaries=summaries)  # raises before anything is acked
            for sample_id in acked:
                self._ack_row(record.consumer, sample_id)
            if lease_id in self._leases:
                self._close_lease(lease_id)
            # Only the acking consumer's own claims can gain: rows of the lease left unacked
            # are claimable again, and a group it has partly consumed may now be whole.
            self._wake_consumer(record.consumer)

    def release(self, lease_id: str) -> None:
        with self._locked(changes=True):
            self._lease_record(lease_id)
            if lease_id in self._leases:
                self._close_lease(lease_id)

    def release_consumer(self, consumer: str) -> int:
        """Hand back every open lease of `consumer` (one of its processes died), and make its
        claims that are waiting right now return empty."""
        return len(self._release_consumer(consumer))

    def _release_consumer(self, consumer: str) -> list[str]:
        """`release_consumer`, returning the ids of the leases it closed."""
        with self._locked(changes=True):
            self._releases[consumer] = self._releases.get(consumer, 0) + 1
            held = [lid for lid, rec in self._leases.items() if rec.consumer == consumer]
            for lease_id in held:
                self._close_lease(lease_id)
            return held

    def renew(self, lease_id: str, lease_s: float | None = None) -> None:
        if lease_s is not None and lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        with self._locked():
            self._lease_record(lease_id)
            record = self._leases.get(lease_id)
            if record is None:
                raise ValueError(
                    f"lease {lease_id!r} is no longer open (acked, released or expired); its "
                    "rows may be with another holder: ack what you finished and claim again"
                )
            record.expires_at = time.monotonic() + (lease_s or record.lease_s)

    def drop(self, sample_ids: Sequence[str], reason: str) -> None:
        with self._locked(changes=True):
            for sample_id in sample_ids:
                if sample_id not in self._rows and sample_id not in self._freed:
                    raise UnknownSampleError(sample_id)
            dropped = self._counters["dropped"]
            for sample_id in dict.fromkeys(sample_ids):
                row = self._rows.get(sample_id)
                if row is not None:
                    self._free(row)
                    dropped[reason] = dropped.get(reason, 0) + 1

    # -- reporting and checkpoints ---------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._locked():
            counters = self._counters
            return {
                "rows_live": len(self._rows),
                "groups_live": len(self._groups),
                "leases_open": len(self._leases),
                **{k: v for k, v in counters.items() if not isinstance(v, dict)},
                "acked": dict(counters["acked"]),
                "dropped": dict(counters["dropped"]),
                "ready": {
                    consumer: self._num_ready(consumer, fields)
                    for consumer, fields in self._claim_fields.items()
                },
            }

    def _num_ready(self, consumer: str, fields: tuple[str, ...]) -> int:
        """Rows `consumer` could claim now with `fields`, leased to it or not yet; the caller
        holds the lock."""
        return sum(
            consumer not in row.leased_by and all(f in row.values for f in fields)
            for row in self._pending.get(consumer, {}).values()
        )

    def state_dict(self) -> dict[str, Any]:
        with self._locked():
            return {
                "version": _STATE_VERSION,
                "consumers": list(self._pending),
                "counters": {
                    k: dict(v) if isinstance(v, dict) else v for k, v in self._counters.items()
                },
                "freed": sorted(self._freed),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"bus state version {state.get('version')!r} is not supported "
                f"(expected {_STATE_VERSION})"
            )
        with self._locked(changes=True):
            if self._rows:
                raise ValueError(
                    f"load_state_dict() on a bus with {len(self._rows)} live rows; load the "
                    "state before the feeder adds rows"
                )
            counters = _new_counters()
            for k, v in state["counters"].items():
                counters[k] = dict(v) if isinstance(v, dict) else v
            self._counters = counters
            self._freed = set(state["freed"])
            for name in [*self._pending, *state["consumers"]]:
                self._pending.setdefault(name, {})
                counters["acked"].setdefault(name, 0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake(None)  # waiting claims and adds see the bus closed
            self._room.notify_all()
            self._rows.clear()
            self._groups.clear()
            self._pending.clear()
            self._leases.clear()
            self._closed_leases.clear()

    # -- internals (caller holds the lock) --------------------------------------------------

    @contextmanager
    def _locked(self, *, changes: bool = False) -> Iterator[None]:
        """Take the lock, refuse a closed bus, and expire overdue leases first. `changes`: the
        block may make any row claimable (a release, a drop), so wake every waiting claim."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the bus is closed")
            self._expire_leases()
            yield
            if changes:
                self._wake(None)

    def _wake(self, fields: set[str] | None) -> None:
        """Wake waiting claims that need one of `fields` (None: all). Caller holds the lock."""
        for waiter in self._waiters:
            if fields is None or waiter.fields & fields:
                waiter.condition.notify()

    def _wake_for(self, rows: list[_Row]) -> None:
        """Wake the waiting claims for which one of `rows`, just written, now holds every
        field they need: a write that leaves each row short of a claim's fields (a rollout
        write, for a trainer that needs advantages too) cannot make that claim succeed."""
        for waiter in self._waiters:
            if any(all(f in row.values for f in waiter.fields) for row in rows):
                waiter.condition.notify()

    def _wake_consumer(self, consumer: str) -> None:
        for waiter in self._waiters:
            if waiter.consumer == consumer:
                waiter.condition.notify()

    def _wait_cap(self, remaining: float) -> float:
        """How long a waiting claim may sleep: until its deadline or the next lease expiry,
        whichever is first (an expiry can free rows; nothing else does so without a wake)."""
        if self._leases:
            next_expiry = min(r.expires_at for r in self._leases.values()) - time.monotonic()
            remaining = min(remaining, max(next_expiry, 0.0) + 0.001)
        return remaining

    def _register(self, name: str) -> None:
        if name not in self._pending:
            self._pending[name] = {}
            self._counters["acked"].setdefault(name, 0)

    def _pending_of(self, consumer: str) -> dict[str, _Row]:
        pending = self._pending.get(consumer)
        if pending is None:
            raise ValueError(
                f"unknown consumer {consumer!r}; registered: {sorted(self._pending)}. Call "
                "register_consumer() before the feeder adds the rows it should see"
            )
        return pending

    def _fits(self, num_groups: int) -> bool:
        cap = self._capacity_groups
        return cap is None or len(self._groups) + num_groups <= cap

    def _new_rows(self, parsed: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """Validate ``parsed`` against the live rows; return those not seen before and the
        number of retried adds."""
        new_rows: dict[str, dict[str, Any]] = {}
        num_duplicates = 0
        group_sizes: dict[str, int] = {gid: g.size for gid, g in self._groups.items()}
        for r in parsed:
            sample_id = r["sample_id"]
            existing = self._rows.get(sample_id) or new_rows.get(sample_id)
            if existing is not None:
                old = (_get(existing, "group_id"), _get(existing, "batch_index"))
                if old != (r["group_id"], r["batch_index"]):
                    raise ValueError(
                        f"sample {sample_id!r} re-added with (group_id, batch_index)="
                        f"{(r['group_id'], r['batch_index'])}, but it exists with {old}"
                    )
                num_duplicates += 1
                continue
            if sample_id in self._freed:
                num_duplicates += 1
                continue
            size = group_sizes.setdefault(r["group_id"], r["group_size"])
            if size != r["group_size"]:
                raise ValueError(
                    f"sample {sample_id!r} says group {r['group_id']!r} has group_size="
                    f"{r['group_size']}, but the group has group_size={size}"
                )
            new_rows[sample_id] = r
        return list(new_rows.values()), num_duplicates

    def _insert(
        self,
        r: dict[str, Any],
        consumers: set[str],
        summaries: Mapping[str, Mapping[str, Any]] | None,
    ) -> None:
        sample_id, group_id = r["sample_id"], r["group_id"]
        values = dict(r["fields"])
        row = _Row(
            sample_id=sample_id,
            group_id=group_id,
            group_size=r["group_size"],
            batch_index=r["batch_index"],
            seq=self._next_seq,
            values=values,
            summary=_summaries_for(sample_id, values, summaries),
            waiting_on=set(consumers),
        )
        self._next_seq += 1
        self._rows[sample_id] = row
        grp = self._groups.get(group_id)
        if grp is None:
            grp = self._groups[group_id] = _Group(size=row.group_size)
        grp.num_added += 1
        grp.num_live += 1
        for consumer in consumers:
            self._pending[consumer][sample_id] = row
            grp.pending[consumer] = grp.pending.get(consumer, 0) + 1
        self._counters["rows_added"] += 1

    def _candidates(
        self,
        consumer: str,
        pending: dict[str, _Row],
        fields: tuple[str, ...],
        predicates: list[Predicate],
    ) -> Iterator[samplers.RowView]:
        groups = self._groups
        for row in pending.values():
            if consumer in row.leased_by:
                continue
            if not all(f in row.values for f in fields):
                continue
            if not all(op(getattr(row, key), value) for key, op, value in predicates):
                continue
            grp = groups[row.group_id]
            missing = max(0, grp.size - grp.num_added)
            yield samplers.RowView(
                sample_id=row.sample_id,
                group_id=row.group_id,
                group_size=row.group_size,
                batch_index=row.batch_index,
                seq=row.seq,
                group_pending=grp.pending[consumer] + missing,
                summary=row.summary,
            )

    def _lease_record(self, lease_id: str) -> _LeaseRecord:
        record = self._leases.get(lease_id) or self._closed_leases.get(lease_id)
        if record is None:
            raise ValueError(
                f"unknown lease id {lease_id!r}: never issued by this bus, or closed too long "
                f"ago (the last {self._closed_leases_kept} closed leases are remembered)"
            )
        return record

    def _close_lease(self, lease_id: str) -> None:
        """Close an open lease; rows it still holds become claimable by its consumer."""
        record = self._leases.pop(lease_id)
        for sample_id in record.sample_ids:
            row = self._rows.get(sample_id)
            if row is not None and row.leased_by.get(record.consumer) == lease_id:
                del row.leased_by[record.consumer]
        self._closed_leases[lease_id] = record
        while len(self._closed_leases) > self._closed_leases_kept:
            self._closed_leases.popitem(last=False)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        expired = [lid for lid, rec in self._leases.items() if rec.expires_at <= now]
        for lease_id in expired:
            self._close_lease(lease_id)
        self._counters["expired_leases"] += len(expired)
        if expired:
            self._wake(None)

    def _ack_row(self, consumer: str, sample_id: str) -> None:
        row = self._rows.get(sample_id)
        if row is None or consumer not in row.waiting_on:
            return  # freed, or already acked by this consumer: acks are idempotent
        row.waiting_on.discard(consumer)
        row.leased_by.pop(consumer, None)
        del self._pending[consumer][sample_id]
        self._groups[row.group_id].pending[consumer] -= 1
        self._counters["acked"][consumer] += 1
        if not row.waiting_on:
            self._free(row)

    def _free(self, row: _Row) -> None:
        del self._rows[row.sample_id]
        self._freed.add(row.sample_id)
        grp = self._groups[row.group_id]
        for consumer in row.waiting_on:
            del self._pending[consumer][row.sample_id]
            grp.pending[consumer] -= 1
        grp.num_live -= 1
        if grp.num_live == 0:
            del self._groups[row.group_id]
            self._room.notify_all()
        row.values.clear()  # drop payloads (and, in the Ray actor, object refs) now
        self._counters["rows_freed"] += 1


def _new_counters() -> dict[str, Any]:
    return {
        "rows_added": 0,
        "rows_freed": 0,
        "duplicate_adds": 0,
        "duplicate_writes": 0,
        "late_writes": 0,
        "expired_leases": 0,
        "acked": {},
        "dropped": {},
    }


def _get(row: _Row | dict[str, Any], key: str) -> Any:
    return getattr(row, key) if isinstance(row, _Row) else row[key]


def _summaries_for(
    sample_id: str,
    values: Mapping[str, Any],
    summaries: Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, Any]:
    if summaries is None:
        return samplers.summarize(values)
    given = summaries.get(sample_id, {})
    return {k: given[k] for k in values if k in given}
