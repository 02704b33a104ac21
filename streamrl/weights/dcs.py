"""Weight channels that share one store between the trainer and the engines: in-process (inline,
threads and sync modes) and Ray's object store (`runtime.weights.channel=object_store`). Each
class is both a `WeightPublisher` and a `WeightSubscriber` (`api/weights.py`).

The Ray store publishes in size-bounded buckets. The actor puts each bucket into the object store
itself (so the objects outlive the trainer process) and keeps only the references; an engine
that asks for a newer version gets the references and reads the buckets straight from the
object store. A bucket is a JSON header (each tensor's name, dtype and shape) and each tensor's
raw bytes as a flat uint8 array: every dtype (bf16 too) travels bit for bit, and no tensor is
pickled. Torch is imported only to publish and to fetch tensors: the feeder, which only follows
versions, never imports it.

The store actor of the object-store channel is supervised (`runtime/supervisor.py`): Ray restarts
a killed one under the same handle (`max_restarts=-1`) and re-runs the calls that were in flight
(`max_task_retries=-1`), so no caller sees the loss. The new process holds nothing (version -1)
until the trainer publishes again, which the supervisor asks of it at once (`incarnation` tells
it that the process changed); meanwhile engines keep the version they hold, and a fetch whose
buckets died with the old process finds nothing newer.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

Bucket = tuple[str, list[np.ndarray]]  # JSON [[name, dtype, shape], ...], raw bytes of each


def to_buckets(named_tensors: Mapping[str, Any], bucket_bytes: int) -> list[Bucket]:
    """Split tensors (or arrays) into buckets of about `bucket_bytes` each, order kept. A
    contiguous CPU tensor's bytes are not copied here."""
    import torch

    from streamrl.weights.layout import dtype_name

    buckets: list[tuple[list[list[Any]], list[np.ndarray]]] = [([], [])]
    size = 0
    for name, value in named_tensors.items():
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
        else:
            tensor = torch.from_numpy(np.ascontiguousarray(value))
        raw = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        if size and size + raw.nbytes > bucket_bytes:
            buckets.append(([], []))
            size = 0
        specs, arrays = buckets[-1]
        specs.append([name, dtype_name(tensor.dtype), list(tensor.shape)])
        arrays.append(raw)
        size += raw.nbytes
    return [(json.dumps(specs), arrays) for specs, arrays in buckets]


def from_buckets(buckets: list[Bucket]) -> dict[str, Any]:
    """The tensors of `to_buckets`' buckets, in order: fresh writable copies (the arrays Ray
    returns are read-only views into the object store)."""
    import torch

    from streamrl.weights.layout import dtype_from_name

    tensors: dict[str, Any] = {}
    for header, arrays in buckets:
        specs = json.loads(header)
        if len(specs) != len(arrays):
            raise ValueError(f"weight bucket holds {len(arrays)} tensors, its header {len(specs)}")
        for (name, dtype, shape), raw in zip(specs, arrays, strict=True):
            flat = torch.empty(raw.size, dtype=torch.uint8)
            flat.numpy()[:] = raw
            tensors[name] = flat.view(dtype_from_name(dtype)).view(shape)
    return tensors


class InProcessWeights:
    """Holds the latest version in this process; the trainer and the engines share it.

    Thread-safe: in threads mode the trainer publishes from one thread while the rollout
    fetches, and the rollout's publish watcher and the feeder wait (`wait_newer`), in others.
    `fetch_newer` hands out the held tensors themselves (the publish cloned them).
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
        """Blocks on the store's condition until a publish wakes it."""
        with self._published:
            self._published.wait_for(lambda: self._version > have_version, max(timeout_s, 0.0))
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
        self._started = time.time()

    def _event(self) -> asyncio.Event:
        if self._published is None:  # made on the actor's event loop, by its first caller
            self._published = asyncio.Event()
        return self._published

    def _hold(self, version: int, buckets: list[Bucket]) -> bool:
        """Hold `version` and wake its waiters if it is newer than the held one."""
        import ray

        if version <= self.version:
            return False
        # Put by the actor, so the actor owns the objects and they outlive the trainer.
        self.refs, self.version = [ray.put(b) for b in buckets], version
        published, self._published = self._event(), asyncio.Event()
        published.set()
        return True

    async def set(self, version: int, buckets: list[Bucket]) -> None:
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

    def incarnation(self) -> dict[str, Any]:
        """This process: its pid, when it started, and the version it holds (the supervisor's
        health check; a new pid means Ray restarted the store)."""
        return {"pid": os.getpid(), "started": self._started, "version": self.version}


class RayStoreClient:
    """The subscribing side of a store actor (`_WeightStoreActor` or a subclass); picklable
    (holds only the actor's handle). Its waits block inside the actor."""

    def __init__(self, handle, bucket_bytes: int = 64 * 2**20):
        self.handle = handle
        self.bucket_bytes = bucket_bytes

    def latest_version(self) -> int:
        import ray

        return ray.get(self.handle.latest_version.remote())

    def wait_newer(self, have_version: int, timeout_s: float) -> int:
        """Blocks inside the store until a version newer than `have_version` is held."""
        import ray

        return ray.get(self.handle.wait_newer.remote(have_version, timeout_s))

    def fetch_newer(self, have_version: int) -> tuple[int, Mapping[str, Any]] | None:
        import ray

        found = ray.get(self.handle.get_if_newer.remote(have_version))
        if found is None:
            return None
        version, holders = found
        try:
            buckets = ray.get([h[0] for h in holders])
        except ray.exceptions.ObjectLostError:
            # The store died after answering (its objects die with it): nothing newer for now;
            # its successor holds the trainer's next publish.
            return None
        return version, from_buckets(buckets)


class RayWeights(RayStoreClient):
    """The object-store channel: one handle for the trainer (publish) and every engine."""

    @classmethod
    def create(cls, bucket_bytes: int = 64 * 2**20) -> RayWeights:
        import ray

        # An asyncio actor (its waits hold no thread): Ray runs up to 1,000 of its calls at once.
        # Restarted in place when its process dies, calls in flight re-run on the new one (see
        # the module's docstring).
        actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(
            _WeightStoreActor
        ).remote()
        return cls(actor, bucket_bytes)

    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        """Held from its return on; a version not newer than the held one is ignored (a trainer
        resumed from a checkpoint replays versions the store outlived it with)."""
        import ray

        ray.get(self.handle.set.remote(version, to_buckets(named_tensors, self.bucket_bytes)))
