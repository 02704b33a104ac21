"""How field values travel in the Ray bus: inline through a shard, or by reference.

A field value smaller than ``inline_bytes`` (token ids, log-probs, rewards: a few KB) travels
inline with its ``add_rows``/``write`` call: the shard keeps it in its heap and returns it inline
in claims, so small fields cost no object-store round trip. Larger values (images, embeddings,
hidden states) never pass through a shard: the writer puts all of a call's large values into
Ray's object store as one object and the shard stores only ``Slot``s (reference + index) into
it; readers fetch the object directly, from the writer's node.

Who owns that object decides what a crash loses. An object lives only as long as the process
that owns it, and ``ray.put`` makes the caller the owner (Ray >= 2.56 has no ``_owner=``):

- ``"keeper"`` (default): the writer hands its object to the ``PayloadKeeper`` actor of its
  node (one per node and bus, created by shard 0 and living as long as the bus). The keeper
  reads it from node-local shared memory and puts it again, as the owner; only references
  cross the keeper's message loop. A writer that dies after ``write`` returned loses nothing.
  Cost: one more memory copy on the writer's node and one more call per write.
- ``"writer"``: the writer's object is stored as is. Cheaper, but if the writer process dies,
  rows whose large values it wrote can no longer be read (claims of them raise Ray's
  ``OwnerDiedError``): only for writers whose death ends the run anyway.

Inline values are as safe as the shard: when a call is large enough for Ray to pass it through
the object store, the shard's copies are zero-copy views that keep that memory alive.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import ray

PayloadOwner = Literal["keeper", "writer"]
PAYLOAD_OWNERS: tuple[str, ...] = ("keeper", "writer")

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one field value lives: element ``index`` of the list stored under ``ref``.

    Wrapping the ObjectRef keeps Ray from resolving it when it is passed to or returned by an
    actor, so only the reader fetches the bytes.
    """

    ref: ray.ObjectRef
    index: int


@dataclass(frozen=True, slots=True)
class WireSlot:
    """A ``Slot`` as sent to a reader: position of its ref in the claim's list of unique refs.

    Sending each distinct ObjectRef once per claim (not once per field of every row) keeps
    Ray's per-reference bookkeeping off the hot path.
    """

    ref_pos: int
    index: int


class PayloadKeeper:
    """Ray actor that owns field payloads written on its node (see the module docstring)."""

    def adopt(self, holder: list[ray.ObjectRef]) -> list[ray.ObjectRef]:
        """Called by a writer with ``[ref]`` to an object it just put: returns ``[ref]`` to a
        copy owned by this actor. The writer's object is freed once the writer drops it."""
        return [ray.put(ray.get(holder[0]))]


def approx_nbytes(value: Any) -> int:
    """Rough serialized size of a field value: exact for arrays and tensors, an estimate for
    lists and nested containers (8 bytes per scalar)."""
    nbytes = getattr(value, "nbytes", None)  # numpy arrays and torch tensors
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(value, bytes | bytearray | str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(approx_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        # A list of containers or arrays is summed; a list of scalars is estimated by length.
        if value and (isinstance(value[0], list | tuple | Mapping) or hasattr(value[0], "nbytes")):
            return sum(approx_nbytes(v) for v in value)
        return 8 * len(value)
    return 8


def store(
    values_by_key: Mapping[K, Mapping[str, Any]],
    *,
    inline_bytes: int,
    adopt: Callable[[ray.ObjectRef], ray.ObjectRef] | None,
) -> dict[K, dict[str, Any]]:
    """Values of one write, ready to send to the shards: values under ``inline_bytes`` stay
    as they are; the others all go into one object-store object and are replaced by
    ``Slot``s into it.

    ``adopt``: hands the writer's object to its keeper and returns the keeper's copy; None
    keeps the writer as the owner.
    """
    out = {key: dict(values) for key, values in values_by_key.items()}
    large = [
        (key, name)
        for key, values in out.items()
        for name, value in values.items()
        if approx_nbytes(value) >= inline_bytes
    ]
    if not large:
        return out
    ref = ray.put([out[key][name] for key, name in large])
    if adopt is not None:
        ref = adopt(ref)
    for index, (key, name) in enumerate(large):
        out[key][name] = Slot(ref, index)
    return out


def to_wire(rows: list[dict[str, Any]]) -> list[ray.ObjectRef]:
    """In a shard: replace each ``Slot`` in ``rows`` by a ``WireSlot``; return the unique refs
    the wire slots point into."""
    refs: dict[ray.ObjectRef, int] = {}
    for row in rows:
        for name, value in row.items():
            if isinstance(value, Slot):
                row[name] = WireSlot(refs.setdefault(value.ref, len(refs)), value.index)
    return list(refs)


def resolve(rows: list[dict[str, Any]], refs: list[ray.ObjectRef]) -> None:
    """In a reader: replace every ``WireSlot`` in ``rows`` by its value, fetching each object
    once. Objects no row needs are not fetched."""
    needed = sorted({v.ref_pos for row in rows for v in row.values() if isinstance(v, WireSlot)})
    if not needed:
        return
    fetched = dict(zip(needed, ray.get([refs[pos] for pos in needed]), strict=True))
    for row in rows:
        for name, value in row.items():
            if isinstance(value, WireSlot):
                row[name] = fetched[value.ref_pos][value.index]
