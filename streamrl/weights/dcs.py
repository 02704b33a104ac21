"""Weight-sync services: in-process (inline and sync modes) and through Ray's object store.

Tensors are published in size-bounded buckets. In the Ray service the actor puts each bucket
into the object store itself (so the objects outlive the trainer process) and keeps only the
references; an engine that asks for a newer version gets the references and reads the buckets
straight from the object store.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np


def to_buckets(named_tensors: Mapping[str, Any], bucket_bytes: int) -> list[dict[str, np.ndarray]]:
    """Split tensors into dicts of numpy arrays of about `bucket_bytes` each (order kept)."""
    buckets: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in named_tensors.items():
        array = tensor.detach().cpu().numpy() if hasattr(tensor, "detach") else np.asarray(tensor)
        if size and size + array.nbytes > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = array
        size += array.nbytes
    return buckets


class InProcessWeights:
    """Holds the latest version in this process; engines in the same process share it.

    Thread-safe: in threads mode the trainer publishes from one thread while the rollout
    fetches, and the rollout's publish watcher and the feeder wait (`wait_newer`), in others.
    """

    def __init__(self) -> None:
        self._version = -1
        self._tensors: dict[str, Any] = {}
        self._published = threading.Condition()
        self.num_publishes = 0

    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        tensors = {
            k: v.detach().clone() if hasattr(v, "detach") else v for k, v in named_tensors.items()
        }
        with self._published:
            if version <= self._version:
                raise ValueError(
                    f"published version {version} is not newer than held version {self._version}"
                )
            self._version, self._tensors = version, tensors
            self.num_publishes += 1
            self._published.notify_all()

    def latest_version(self) -> int:
        return self._version

    def fetch_newer(self, have_version: int) -> tuple[int, Mapping[str, Any]] | None:
        with self._published:
            if self._version <= have_version:
                return None
            return self._version, self._tensors

    def wait_newer(self, have_version: int, timeout_s: float) -> int:
        """Block until a version newer than `have_version` is held, or `timeout_s` passes;
        return the newest version held."""
        with self._published:
            self._published.wait_for(lambda: self._version > have_version, timeout_s)
            return self._version


class _WeightStoreActor:
    """Ray actor body: the newest version and the object references of its buckets.

    An asyncio actor: a caller waiting in `wait_newer` (each rollout replica's publish watcher
    and admission wait, the feeder) holds no thread, so any number of them can wait while a
    publish runs. Every other method is plain and quick and runs on the actor's event loop;
    subclasses hold a version through `_hold` (a plain method, so they need not be async).
    """

    def __init__(self) -> None:
        self.version = -1
        self.refs: list[Any] = []
        self._published: asyncio.Event | None = None  # set, and replaced, by every new version

    def _event(self) -> asyncio.Event:
        if self._published is None:  # made on the actor's event loop, by its first caller
            self._published = asyncio.Event()
        return self._published

    def _hold(self, version: int, buckets: list[dict[str, Any]]) -> bool:
        """Hold `version` and wake its waiters if it is newer than the held one."""
        import ray

        if version <= self.version:
            return False
        # Put by the actor, so the actor owns the objects and they outlive the trainer.
        self.refs, self.version = [ray.put(b) for b in buckets], version
        published, self._published = self._event(), asyncio.Event()
        published.set()
        return True

    async def set(self, version: int, buckets: list[dict[str, Any]]) -> None:
        self._hold(version, buckets)

    async def wait_newer(self, have_version: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self.version <= have_version and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._event().wait(), left)
            except TimeoutError:
                break
        return self.version

    def get_if_newer(self, have_version: int) -> tuple[int, list[list[Any]]] | None:
        if self.version <= have_version:
            return None
        return self.version, [[r] for r in self.refs]  # wrapped: Ray must not resolve them here

    def latest_version(self) -> int:
        return self.version


class RayWeights:
    """Client of the Ray weight store; cheap to pass to other actors (holds only a handle)."""

    def __init__(self, handle, bucket_bytes: int = 64 * 2**20):
        self.handle = handle
        self.bucket_bytes = bucket_bytes

    @classmethod
    def create(cls, bucket_bytes: int = 64 * 2**20) -> RayWeights:
        import ray

        # An asyncio actor (its waits hold no thread): Ray runs up to 1,000 of its calls at once.
        actor = ray.remote(num_cpus=0)(_WeightStoreActor).remote()
        return cls(actor, bucket_bytes)

    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        import ray

        ray.get(self.handle.set.remote(version, to_buckets(named_tensors, self.bucket_bytes)))

    def latest_version(self) -> int:
        import ray

        return ray.get(self.handle.latest_version.remote())

    def wait_newer(self, have_version: int, timeout_s: float) -> int:
        """Block (inside the store) until a version newer than `have_version` is published or
        `timeout_s` passes; return the newest version."""
        import ray

        return ray.get(self.handle.wait_newer.remote(have_version, timeout_s))

    def fetch_newer(self, have_version: int) -> tuple[int, Mapping[str, Any]] | None:
        import ray

        found = ray.get(self.handle.get_if_newer.remote(have_version))
        if found is None:
            return None
        version, holders = found
        tensors: dict[str, Any] = {}
        for bucket in ray.get([h[0] for h in holders]):
            tensors.update(bucket)
        return version, tensors
