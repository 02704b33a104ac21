"""RayBus: the bus for multi-process runs, a thin client over one Ray actor.

The actor (``BusActor``) holds a ``LocalBus`` whose field values are not the values themselves
but ``_Slot``s: an ObjectRef to a payload in Ray's object store and an index into it. So
tensors never sit in the actor's heap and are never re-serialised per claim.

Data path::

    writer ──write(meta, payload)──► BusActor: ref = ray.put(payload); rows get _Slot(ref, i)
    reader ◄──claim: rows of _Slots── BusActor
    reader: one ray.get(unique refs) ──► rows with values

Ownership: an object in Ray's store lives as long as its owner process. The actor calls
``ray.put`` itself, once per ``add_rows``/``write`` call, so the actor owns every payload and
field values survive the death of the role that wrote them. (Ray 2.56 removed
``ray.put(_owner=...)``, which would have let the writer put on the actor's behalf; passing the
payload as an argument of the same call costs one extra copy on the way in.) When a row is
freed, its slots are dropped and Ray frees a payload once no row references it.

Every client method is exactly one actor call. ``RayBus`` holds only the actor handle, so it
pickles cheaply and can be passed to other actors and tasks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayTaskError

from streamrl.api.bus import Lease
from streamrl.bus import samplers
from streamrl.bus.local import LocalBus


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one field value lives: element ``index`` of the payload list behind ``ref``.

    Wrapping the ObjectRef keeps Ray from resolving it when it is passed as an argument or
    returned, so only the reader fetches the bytes.
    """

    ref: ray.ObjectRef
    index: int


@dataclass(frozen=True, slots=True)
class _WireSlot:
    """A `_Slot` as sent to a client: position of its ref in the claim's list of unique refs.

    Sending each distinct ObjectRef once per claim (not once per field of every row) keeps
    Ray's per-reference bookkeeping off the hot path.
    """

    ref_pos: int
    index: int


class BusActor:
    """Ray actor holding the bus state; each method is one call from a ``RayBus`` client."""

    def __init__(self, **bus_kwargs: Any) -> None:
        self._bus = LocalBus(**bus_kwargs)

    def register_consumer(self, name: str) -> None:
        self._bus.register_consumer(name)

    def add_rows(
        self,
        rows: list[dict[str, Any]],
        payload: list[Any],
        summaries: dict[str, dict[str, Any]],
    ) -> None:
        slots = self._own(payload)
        for row in rows:
            row["fields"] = {name: slots[i] for name, i in row["fields"].items()}
        self._bus.add_rows(rows, summaries=summaries)

    def can_add(self, num_groups: int) -> bool:
        return self._bus.can_add(num_groups)

    def num_groups_live(self) -> int:
        return self._bus.num_groups_live()

    def write(
        self,
        updates: dict[str, dict[str, int]],
        payload: list[Any],
        summaries: dict[str, dict[str, Any]],
    ) -> None:
        slots = self._own(payload)
        resolved = {sid: {name: slots[i] for name, i in v.items()} for sid, v in updates.items()}
        self._bus.write(resolved, summaries=summaries)

    def claim(self, consumer: str, fields: list[str], max_rows: int, **kwargs: Any) -> Any:
        """Returns (lease or None, the unique payload refs its rows point into, this process's
        time.monotonic()) so the client can rebase ``expires_at`` onto its own clock."""
        lease = self._bus.claim(consumer, fields, max_rows, **kwargs)
        refs: dict[ray.ObjectRef, int] = {}
        if lease is not None:
            for row in lease.rows:
                for name, value in row.items():
                    if isinstance(value, _Slot):
                        pos = refs.setdefault(value.ref, len(refs))
                        row[name] = _WireSlot(pos, value.index)
        return lease, [[r] for r in refs], time.monotonic()

    def ack(self, lease_id: str, sample_ids: list[str] | None) -> None:
        self._bus.ack(lease_id, sample_ids)

    def release(self, lease_id: str) -> None:
        self._bus.release(lease_id)

    def renew(self, lease_id: str, lease_s: float | None) -> None:
        self._bus.renew(lease_id, lease_s)

    def release_consumer(self, consumer: str) -> int:
        return self._bus.release_consumer(consumer)

    def drop(self, sample_ids: list[str], reason: str) -> None:
        self._bus.drop(sample_ids, reason)

    def stats(self) -> dict[str, Any]:
        return self._bus.stats()

    def state_dict(self) -> dict[str, Any]:
        return self._bus.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bus.load_state_dict(state)

    def close(self) -> None:
        self._bus.close()

    def _own(self, payload: list[Any]) -> list[_Slot]:
        if not payload:
            return []
        ref = ray.put(payload)
        return [_Slot(ref, i) for i in range(len(payload))]


# Threaded: a claim waiting for rows (wait_s) must not block the writes that would satisfy it.
_RemoteBusActor = ray.remote(max_concurrency=32)(BusActor)


class RayBus:
    """Client implementing ``streamrl.api.bus.Bus`` over a ``BusActor``.

    Build one with ``RayBus.create(...)`` (starts the actor; this client then owns it and
    ``close()`` stops it) or ``RayBus.from_handle(handle)`` (attaches to a running actor;
    ``close()`` only detaches this client). Copies sent to other processes attach.
    """

    def __init__(self, handle: ray.actor.ActorHandle, *, owns_actor: bool = False) -> None:
        self._handle = handle
        self._owns_actor = owns_actor
        self._closed = False

    @classmethod
    def create(cls, name: str | None = None, **bus_kwargs: Any) -> RayBus:
        """Start a ``BusActor`` (no CPU reserved: it mostly waits) holding a
        ``LocalBus(**bus_kwargs)``; ``name`` makes it a named actor others can look up."""
        handle = _RemoteBusActor.options(name=name, num_cpus=0).remote(**bus_kwargs)
        return cls(handle, owns_actor=True)

    @classmethod
    def from_handle(cls, handle: ray.actor.ActorHandle) -> RayBus:
        """Attach to a running ``BusActor``, e.g. one found with ``ray.get_actor(name)``."""
        return cls(handle)

    @property
    def handle(self) -> ray.actor.ActorHandle:
        return self._handle

    def __reduce__(self) -> tuple[Any, ...]:
        return (RayBus.from_handle, (self._handle,))

    # -- Bus protocol ---------------------------------------------------------------------

    def register_consumer(self, name: str) -> None:
        self._call("register_consumer", name)

    def add_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        payload: list[Any] = []
        summaries: dict[str, dict[str, Any]] = {}
        meta_rows = []
        for row in rows:
            meta = dict(row)
            fields = meta.get("fields") or {}
            meta["fields"] = _index_into(payload, fields)
            if fields and "sample_id" in meta:
                summaries[meta["sample_id"]] = samplers.summarize(fields)
            meta_rows.append(meta)
        self._call("add_rows", meta_rows, payload, summaries)

    def can_add(self, num_groups: int) -> bool:
        return self._call("can_add", num_groups)

    def num_groups_live(self) -> int:
        return self._call("num_groups_live")

    def write(self, updates: Mapping[str, Mapping[str, Any]]) -> None:
        payload: list[Any] = []
        indexed = {sid: _index_into(payload, values) for sid, values in updates.items()}
        summaries = {sid: samplers.summarize(values) for sid, values in updates.items()}
        self._call("write", indexed, payload, summaries)

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
        sent_at = time.monotonic()
        lease, ref_holders, actor_now = self._call(
            "claim",
            consumer,
            fields if isinstance(fields, str) else list(fields),
            max_rows,
            sampler=sampler,
            where=dict(where) if where else None,
            lease_s=lease_s,
            sampler_options=dict(sampler_options) if sampler_options else None,
            wait_s=wait_s,
        )
        if lease is None:
            return None
        # Rebase onto this process's clock, counting from before the call (errs early).
        lease.expires_at = sent_at + (lease.expires_at - actor_now)
        _resolve_slots(lease.rows, [h[0] for h in ref_holders])
        return lease

    def ack(self, lease_id: str, sample_ids: Sequence[str] | None = None) -> None:
        self._call("ack", lease_id, None if sample_ids is None else list(sample_ids))

    def release(self, lease_id: str) -> None:
        self._call("release", lease_id)

    def renew(self, lease_id: str, lease_s: float | None = None) -> None:
        self._call("renew", lease_id, lease_s)

    def release_consumer(self, consumer: str) -> int:
        return self._call("release_consumer", consumer)

    def drop(self, sample_ids: Sequence[str], reason: str) -> None:
        self._call("drop", list(sample_ids), reason)

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def close(self) -> None:
        """Owner: empty the bus and stop the actor. Attached client: detach. Idempotent."""
        if self._closed:
            return
        if self._owns_actor:
            self._call("close")
            ray.kill(self._handle)
        self._closed = True

    # -- internals ----------------------------------------------------------------------

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("the bus is closed")
        try:
            return ray.get(getattr(self._handle, method).remote(*args, **kwargs))
        except RayTaskError as err:
            # Surface the bus's own exception (ValueError, BusFullError, ...) to the caller.
            raise err.cause from err


def _index_into(payload: list[Any], values: Mapping[str, Any]) -> dict[str, int]:
    """Append ``values`` to ``payload``; return {field: index in payload}."""
    indices = {}
    for name, value in values.items():
        indices[name] = len(payload)
        payload.append(value)
    return indices


def _resolve_slots(rows: list[dict[str, Any]], refs: list[ray.ObjectRef]) -> None:
    """Replace every ``_WireSlot`` in ``rows`` with its value, fetching each payload once."""
    if not refs:
        return
    payloads = ray.get(refs)
    for row in rows:
        for name, value in row.items():
            if isinstance(value, _WireSlot):
                row[name] = payloads[value.ref_pos][value.index]
