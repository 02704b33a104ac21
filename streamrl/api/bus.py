"""The bus contract: the field store every role reads from and writes to.

A *row* is one sample. The feeder creates it (sample id, group id, group size, batch index);
any role may then write *fields* (named columns such as ``response_ids`` or ``reward``) in any
order, each exactly once. A role that consumes rows *claims* a lease over rows whose input
fields are ready, computes, writes its outputs and *acks* the lease. A lease that expires (its
holder died) makes its rows claimable again, so delivery is at-least-once and, because writes
are idempotent, the effect is exactly-once. A row is freed once every consumer registered when
it was added has acked it.

This module holds only the contract (no torch, no Ray) so that roles and tests can type against
it; ``streamrl.bus`` has the in-process and Ray-backed implementations, which pass one shared
contract test suite.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

#: Keys every row dict returned by ``claim`` carries besides the requested fields. They are
#: reserved: no field may use one of these names.
ROW_META_KEYS: tuple[str, ...] = ("sample_id", "group_id", "group_size", "batch_index")

#: Comparison operators accepted by ``claim(where=...)``.
WHERE_OPS: tuple[str, ...] = ("==", "<=", "<", ">=", ">")


@dataclass
class Lease:
    """Rows handed to one consumer until ``expires_at`` (a ``time.monotonic()`` deadline).

    Each row dict holds ``sample_id``, ``group_id``, ``group_size``, ``batch_index`` and the
    values of the fields that were asked for. Values are shared, not copied: treat them as
    read-only.
    """

    lease_id: str
    consumer: str
    rows: list[dict[str, Any]]
    expires_at: float

    @property
    def sample_ids(self) -> list[str]:
        return [row["sample_id"] for row in self.rows]


class BusFullError(RuntimeError):
    """Adding rows would put more groups in flight than the bus's ``capacity_groups``.

    This is backpressure, not a failure: the feeder waits for rows to be consumed and retries.
    """


class UnknownSampleError(KeyError):
    """A sample id the bus has never seen (neither live nor freed)."""

    def __init__(self, sample_id: str) -> None:
        # args stay (sample_id,) so the error pickles across process boundaries.
        super().__init__(sample_id)
        self.sample_id = sample_id

    def __str__(self) -> str:
        return (
            f"unknown sample id {self.sample_id!r}: the bus never had a row with this id; "
            "add it with add_rows() before writing fields to it"
        )


@runtime_checkable
class Bus(Protocol):
    """Field store shared by all roles. Implementations: ``LocalBus`` and ``RayBus``."""

    def register_consumer(self, name: str) -> None:
        """Called once by each consuming role at start-up, before the feeder adds rows.

        Every row added afterwards waits for ``name`` to ack it before it is freed; rows added
        before the call are not visible to ``name``. Registering twice is a no-op.
        """
        ...

    def add_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Called by the feeder to create rows (one call per group or batch of groups).

        Each mapping has ``sample_id``, ``group_id``, ``group_size``, optional ``batch_index``
        (default 0) and optional ``fields`` (initial values, e.g. ``prompt_ids``). Re-adding a
        live or freed sample id with the same meta is a silent no-op, so the feeder may retry.
        Raises ``BusFullError`` (and adds nothing) when the new groups would exceed the bus
        capacity; the feeder then waits and retries.
        """
        ...

    def can_add(self, num_groups: int, wait_s: float = 0.0) -> bool:
        """Called by the feeder before building new groups: whether ``num_groups`` new groups
        fit under the capacity, waiting up to ``wait_s`` for consumers to free enough groups
        (0: answer for right now). The feeder tries again later when this is False."""
        ...

    def num_groups_live(self) -> int:
        """Number of groups with at least one live row; used for admission control and
        progress reporting."""
        ...

    def write(self, updates: Mapping[str, Mapping[str, Any]]) -> None:
        """Called by any role to publish computed fields: ``{sample_id: {field: value}}``.

        A field keeps its first value; a repeated write (a retried task) is ignored and
        counted. Writes to freed rows are ignored and counted (late retries). A never-seen
        sample id raises ``UnknownSampleError`` and nothing is written.
        """
        ...

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
        """Called in each consuming role's loop to get work.

        Returns a lease over at most ``max_rows`` rows (the sampler may return more to keep a
        group whole) that have all ``fields`` written, that ``consumer`` has not acked and
        that no open lease of ``consumer`` holds; or None when nothing qualifies, in which
        case the caller waits briefly and claims again. ``where`` filters on row meta, e.g.
        ``{"batch_index": ("<=", 3)}``. The caller processes the rows, writes its output
        fields, then calls ``ack`` (or ``release`` to give them back, or ``renew`` if the work
        takes longer than ``lease_s``). ``wait_s > 0`` makes an empty claim wait up to that
        long for a change that could satisfy it (a long poll: no busy polling across processes).
        """
        ...

    def ack(
        self,
        lease_id: str,
        sample_ids: Sequence[str] | None = None,
        *,
        writes: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        """Called by the lease holder after its outputs are written: marks the lease's rows
        (or the given subset) consumed; the other rows of the lease become claimable again.
        Idempotent; also accepted after the lease expired.

        ``writes`` (``{sample_id: {field: value}}``) are written first, exactly as ``write``
        would write them, in the same call: a role's last write and its ack then cost one
        round trip instead of two. A write that raises (an unknown sample id) writes and acks
        nothing."""
        ...

    def release(self, lease_id: str) -> None:
        """Called by a holder that cannot process its rows (e.g. shutting down): gives them
        back unconsumed, claimable again at once."""
        ...

    def release_consumer(self, consumer: str) -> int:
        """Called by the supervisor when the process of a role died: gives back every open
        lease of ``consumer`` at once (instead of waiting for them to expire) and returns how
        many there were. Only safe when no live replica of the role holds leases."""
        ...

    def renew(self, lease_id: str, lease_s: float | None = None) -> None:
        """Called periodically by a holder whose work outlasts the lease: pushes the deadline
        to ``lease_s`` (default: the lease's original duration) from now. Raises ValueError
        if the lease is no longer open (its rows may already be with someone else)."""
        ...

    def drop(self, sample_ids: Sequence[str], reason: str) -> None:
        """Called by a role that decides rows must not be used (e.g. too stale): frees them
        now, for every consumer, and counts them under ``reason``."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: rows_live, groups_live, rows_added, rows_freed, acked (per
        consumer), dropped (per reason), duplicate_adds, duplicate_writes, late_writes,
        expired_leases, leases_open."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Called by the checkpointing role: JSON-serialisable consumption state (counters,
        consumers and freed sample ids). Live rows are not included; the feeder regenerates
        in-flight work on resume."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Called on resume, on a bus with no live rows, before the feeder adds rows, so that
        re-added ids that were already consumed are recognised and skipped."""
        ...

    def close(self) -> None:
        """Called by whoever created the bus at shutdown; frees everything it holds."""
        ...
