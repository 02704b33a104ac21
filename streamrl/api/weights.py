"""Contract of the weight-sync channels (the DCS): the trainer publishes versions, engines pull them.

A channel has two sides. The trainer holds a `WeightPublisher`; every other role (rollout
engines, pi_old, the feeder's and the trainers' staleness bounds) holds a `WeightSubscriber`.
Where one store serves both sides (in-process, Ray's object store) one object is both. The
channel keeps the latest version in host memory, so an engine that starts or restarts gets
current weights without a disk checkpoint, and a subscriber rides out a trainer restarted in
place. `weights/channels.py` chooses the channel; `tests/contract/test_weight_channel_contract.py`
is what every channel must pass. Imports no torch.

Tensors travel in their own dtype and shape, bit for bit (bf16 included), and nothing is pickled
across a network boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class WeightPublisher(Protocol):
    """The trainer's side."""

    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        """Called by the trainer after each optimizer step with the full weights (torch tensors;
        the call copies what it keeps, so the caller may go on training at once). From its
        return, `version` is what subscribers get. A version not newer than the held one is
        refused (ValueError) or, by a channel whose store outlives the trainer, ignored: a
        trainer resumed from a checkpoint replays versions the store already has."""
        ...

    def latest_version(self) -> int:
        """The newest version published through this channel (-1 before the first publish)."""
        ...


@runtime_checkable
class WeightSubscriber(Protocol):
    """An engine's side (and that of any role that only needs to know the policy version).

    May be used from two threads at once: the rollout's publish watcher waits in `wait_newer`
    while its decode loop calls `fetch_newer`. Handles are picklable (they are made in the
    driver and sent to the role processes) and connect on first use.
    """

    def latest_version(self) -> int:
        """The newest version published (-1 before the first publish). Called by roles bounded
        by the policy version (the feeder, the trainer's batch collector) to know how far
        ahead they may go; cheap (no tensors move), needs no torch."""
        ...

    def fetch_newer(self, have_version: int) -> tuple[int, Mapping[str, Any]] | None:
        """Called by an engine between batches or decode steps with the version it holds:
        (version, tensors) of the newest version available to it if that is newer than
        `have_version`, else None (cheap: no tensors move). Behind by several versions, the
        caller gets the newest, not the next. A version may be published (`latest_version`)
        a moment before it is available here (the collective channel: while its broadcast is
        on the way); `wait_newer` waits for that moment.

        The tensors are torch tensors in the published dtypes and shapes, in the publisher's
        order. They may be views into the channel's own buffers: the caller reads or copies
        them (loads them into its model) and never writes into them."""
        ...

    def wait_newer(self, have_version: int, timeout_s: float) -> int:
        """Block until `fetch_newer(have_version)` has a version to return, or `timeout_s`
        passes (<= 0: do not wait); return the newest version available: more than
        `have_version` when one came, at most `have_version` on a timeout.

        Called instead of polling by roles held back by the policy version: the rollout when
        admission control admits nothing until newer weights, its publish watcher thread (the
        decode loop then fetches only once this returned a newer version), and the feeder.
        The caller fetches (an engine) or re-checks its bound, and calls again on a timeout.
        A channel whose service can block waits there, so the caller wakes within one call's
        latency of the publish; one that cannot polls its service at a short interval
        (`poll_newer`). Needs no torch."""
        ...


def poll_newer(
    newest: Callable[[], int], have_version: int, timeout_s: float, interval_s: float
) -> int:
    """`wait_newer` for a channel whose service cannot block: call `newest()` (the newest
    version available) every `interval_s` until it is more than `have_version` or `timeout_s`
    passed; return its last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        version = newest()
        left = deadline - time.monotonic()
        if version > have_version or left <= 0:
            return version
        time.sleep(min(interval_s, left))
