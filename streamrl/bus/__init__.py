"""The field store every role reads from and writes to (see ``streamrl.api.bus`` for the
contract): ``LocalBus`` in one process, ``RayBus`` across processes, and the samplers that
choose which ready rows a claim hands out.

``make_bus(kind, **kwargs)`` builds one by config name. The Ray implementation is imported only
when asked for, so inline mode does not import Ray.
"""

from __future__ import annotations

from typing import Any

from streamrl.api.bus import Bus, BusFullError, Lease, UnknownSampleError
from streamrl.bus.local import LocalBus

BUS_KINDS: tuple[str, ...] = ("local", "ray")


def make_bus(kind: str, **kwargs: Any) -> Bus:
    """Build a bus: ``"local"`` -> ``LocalBus(**kwargs)``; ``"ray"`` -> ``RayBus.create(**kwargs)``
    (needs ``ray.init()`` first; ``name=`` names its shard 0, ``shards=`` spreads the rows over
    that many actors)."""
    if kind == "local":
        return LocalBus(**kwargs)
    if kind == "ray":
        from streamrl.bus.ray_bus import RayBus

        return RayBus.create(**kwargs)
    raise ValueError(f"unknown bus kind {kind!r}; expected one of {BUS_KINDS}")


__all__ = [
    "BUS_KINDS",
    "Bus",
    "BusFullError",
    "Lease",
    "LocalBus",
    "UnknownSampleError",
    "make_bus",
]
