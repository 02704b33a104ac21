"""A role that claims rows, computes new fields from them, writes the fields and acknowledges.

Reward, reference and advantage are all this loop with a different `compute`; they subclass
`TransformRole` and say which fields they read (`consumes`) and which sampler hands them rows.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.api.role import RoleBase


class TransformRole(RoleBase, abc.ABC):
    consumer: str = ""
    """Consumer name on the bus (one per role)."""
    consumes: tuple[str, ...] = ()
    """Fields a row must have to be claimed; they are also the values `compute` receives."""
    sampler: str = "fifo"
    """Bus sampler: "group" for roles that need whole groups."""

    def __init__(self, bus, *, max_rows: int, lease_s: float):
        self.bus = bus
        self.max_rows = max_rows
        self.lease_s = lease_s
        self.busy_s = 0.0

    @abc.abstractmethod
    def compute(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
        """Return {sample_id: {field: value}} for the claimed rows."""

    def step(self) -> bool:
        lease = self.bus.claim(
            self.consumer,
            self.consumes,
            self.max_rows,
            sampler=self.sampler,
            lease_s=self.lease_s,
            wait_s=self.long_poll_s,
        )
        if lease is None:
            return False
        start = time.perf_counter()
        self.bus.ack(lease.lease_id, writes=self.compute(lease.rows))  # one round trip
        self.busy_s += time.perf_counter() - start
        return True

    def stats(self) -> dict[str, Any]:
        return {"busy_s": self.busy_s}
