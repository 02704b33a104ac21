"""Contract of the weight-sync service (DCS): the trainer publishes versions, engines pull them.

The service keeps the latest version in host memory, so an engine that starts or restarts gets
current weights without a disk checkpoint. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class WeightService(Protocol):
    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        """Called by the trainer after each optimizer step; replaces the held version."""
        ...

    def latest_version(self) -> int:
        """The newest published version (-1 before the first publish)."""
        ...

    def fetch_newer(self, have_version: int) -> tuple[int, Mapping[str, Any]] | None:
        """Called by an engine between batches or decode steps: the newest (version, tensors) if
        it is newer than `have_version`, else None (cheap: no tensors move)."""
        ...


def wait_newer(weights: WeightService, have_version: int, timeout_s: float) -> None:
    """Block until a version newer than `have_version` is published or `timeout_s` passes, for
    services that can wait inside the service (an optional method `wait_newer` with the same
    arguments); return at once for the others. Roles held back by the policy version (the
    rollout's admission bound, the feeder's) call it instead of polling, so they start within
    one call's latency of the publish."""
    wait = getattr(weights, "wait_newer", None)
    if wait is not None and timeout_s > 0:
        wait(have_version, timeout_s)
