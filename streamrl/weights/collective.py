"""The `collective` weight channel: torch.distributed broadcast from trainer rank 0 to engines.

One process group of its own (NCCL on GPUs, gloo on CPU), separate from any group the trainer
uses for training, joins the trainer's rank 0 (rank 0 here, the sender) and every engine (ranks
1..world_size-1, the receivers). Ranks meet through a store at `tcp://host:port` that the sender
serves (`weights/store.py`, not torch's TCPStore): it listens on `host` only, and admits a
receiver only once it proved the shared token, by the tcp channel's handshake. A receiver with
another token is refused at once (PermissionError); the sender then times out waiting for it
and says so. Without a token `host` must be loopback. Gloo's own sockets listen on `host` (the
sender) and on the address each receiver reaches the store from, not on every interface. A
publish runs, in this order:

    sender                                        each receiver
    store: publish/<seq> = len(header)  ───────►  sees the key (polls the store while idle)
    broadcast header: JSON {version, layout} ───► checks version and layout, allocates buckets
    broadcast bucket 0 .. bucket n-1  ──────────► views the buckets as named tensors (no copy)

Announcing each publish in the store first means an idle receiver waits on the store, not inside
a collective, so long gaps between versions never trip the collective timeout and `close()`
can stop a waiting receiver. A broadcast is a collective: `publish` returns once every receiver
has the bytes, so receivers must be receiving (`receive()`, or `start()` for a background thread).
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from streamrl.weights.layout import Layout, as_flat, flatten_bucket, unflatten_bucket
from streamrl.weights.store import LocalStore, RemoteStore, StoreServer
from streamrl.weights.tcp import MAX_CONNECTIONS

log = logging.getLogger(__name__)

_KEY = "streamrl/weights/publish/"
_CLOSED = b"closed"
_CLOSED_ACKS = "streamrl/weights/closed_acks"
LINGER_S = 5.0  # a store closed without waiting still serves this long


def parse_init_method(init_method: str) -> tuple[str, int]:
    """`tcp://127.0.0.1:29600` -> ("127.0.0.1", 29600)."""
    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise ValueError(
            f"init_method must look like tcp://host:port (the sender's address), got {init_method!r}"
        )
    return parts.hostname, parts.port


_OPEN_GROUPS: weakref.WeakSet = weakref.WeakSet()


def release_at_exit(group: object) -> None:
    """Have `group.release()` (which destroys its process group) run at interpreter exit unless
    it ran before. A gloo group destroyed during interpreter finalization can free tensors from
    its worker threads with no interpreter left, and the process aborts ("terminate called
    without an active exception") after its work is done."""
    _OPEN_GROUPS.add(group)


@atexit.register
def _release_open_groups() -> None:
    for group in list(_OPEN_GROUPS):
        group.release()


class _Group:
    """Store + process group + the device its buffers live on, for one rank."""

    def __init__(
        self,
        init_method: str,
        world_size: int,
        rank: int,
        backend: str,
        timeout_s: float,
        store: StoreServer | None = None,
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(
                f"need world_size >= 2 (the sender and at least one engine) and 0 <= rank < "
                f"world_size, got world_size={world_size}, rank={rank}"
            )
        host, port = parse_init_method(init_method)
        if host in ("0.0.0.0", "::"):
            raise ValueError(
                f"init_method {init_method!r}: give the address the engines connect to (it is "
                f"the only one listened on), not an unspecified one"
            )
        self.rank, self.world_size = rank, world_size
        timeout = timedelta(seconds=timeout_s)
        self.server: StoreServer | None = None
        self.pg: dist.ProcessGroup | None = None
        self.store: LocalStore | RemoteStore
        if rank == 0:
            self.server = store or StoreServer(
                host, port, token=token, max_connections=max_connections
            )
            self.store, listen = self.server.store(timeout), host
        else:
            try:
                self.store = RemoteStore(host, port, token=token, timeout=timeout)
            except PermissionError as e:
                raise PermissionError(
                    f"weight-sync group at {init_method} refused rank {rank}: {e}"
                ) from e
            except dist.DistError as e:
                raise TimeoutError(
                    f"weight-sync rendezvous at {init_method} failed for rank {rank} of "
                    f"{world_size}: {e}"
                ) from e
            listen = self.store.local_address
        try:
            self.pg, self.device = _process_group(
                backend, self.store, rank, world_size, timeout, listen
            )
        except BaseException as e:
            self.close()
            if not isinstance(e, dist.DistError):
                raise
            refused = self.server.refused if self.server is not None else []
            why = (
                f"; {len(refused)} connection(s) were refused for a wrong token (from "
                f"{', '.join(str(p[0]) for p in refused[:4])}): every engine needs the "
                f"trainer's token"
                if refused
                else ""
            )
            raise TimeoutError(
                f"weight-sync rendezvous at {init_method} failed for rank {rank} of {world_size} "
                f"within {timeout_s:g} s: start the sender (rank 0) and all {world_size - 1} "
                f"engine ranks with the same init_method and world_size{why} ({e})"
            ) from e
        release_at_exit(self)

    def close(self, linger_s: float = 0.0) -> None:
        """Leave the process group and drop this rank's end of the store: the sender stops
        serving it (after `linger_s`, in the background, so receivers can still read its last
        keys), a receiver disconnects."""
        self.release()
        if self.server is not None:
            if linger_s > 0:
                timer = threading.Timer(linger_s, self.server.close)
                timer.daemon = True
                timer.start()
            else:
                self.server.close()
        elif isinstance(self.store, RemoteStore):
            self.store.close()

    def release(self) -> None:
        """Destroy the process group now (joining its worker threads), not whenever the last
        reference goes, which may be during interpreter shutdown."""
        self.pg = None
        _OPEN_GROUPS.discard(self)

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting `tensor` from rank 0 (bytes, so every dtype works on every backend)."""
        if self.pg is None:
            raise RuntimeError("the weight-sync group was closed")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.pg.broadcast([tensor.view(torch.uint8)], options)


def _process_group(
    backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta, listen: str
) -> tuple[dist.ProcessGroup, torch.device]:
    """The group over `store`; gloo's sockets listen on `listen` (not on whatever address the
    host name resolves to, nor everywhere)."""
    pg_store = dist.PrefixStore("streamrl/weights/pg/", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=listen)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(pg_store, rank, world_size, options), torch.device("cpu")
    if backend == "nccl":
        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ValueError("backend='nccl' needs CUDA and an NCCL build of torch; use 'gloo'")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(pg_store, rank, world_size, options)
        return pg, torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")


def _wait(work: dist.Work, what: str, timeout_s: float) -> None:
    try:
        work.wait()
    except dist.DistError as e:
        raise RuntimeError(
            f"weight broadcast of {what} failed (timeout {timeout_s:g} s): a rank of the "
            f"weight-sync group died or stopped taking part ({e})"
        ) from e


class _Staging:
    """Flat buffers reused from publish to publish, one per slot, grown on demand: no allocation
    (nor first-touch page faults) per version."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slots: dict[int, torch.Tensor] = {}

    def get(self, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        buffer = self._slots.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._slots[slot] = buffer
        return buffer[:nbytes].view(dtype)


class CollectiveWeightSender:
    """Rank 0 of the weight-sync group, in the trainer's rank-0 process.

    `publish` is the `WeightPublisher` call; the held version lives with the receivers, so this
    side keeps only the version number. A tensor of at least `alone_bytes` is broadcast straight
    from its own memory (when contiguous and on the group's device); smaller ones are packed
    into buckets of up to `bucket_bytes`, copied into `max_in_flight` reused staging buffers,
    the next one filled while the previous one is on the wire.
    """

    def __init__(
        self,
        init_method: str,
        world_size: int,
        *,
        backend: str = "gloo",
        bucket_bytes: int = 64 * 2**20,
        alone_bytes: int | None = 2**20,
        timeout_s: float = 300.0,
        max_in_flight: int = 2,
        store: StoreServer | None = None,
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        """Blocks until all `world_size - 1` receivers joined (or `timeout_s` passed).
        `alone_bytes=None` packs every tensor into buckets. `store`: the rendezvous store this
        process already serves at `init_method` (e.g. on port 0, to learn a free port before the
        receivers are told where to join); else one is served there, admitting only receivers
        that hold `token` (required unless the host is loopback), at most `max_connections`."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.bucket_bytes = bucket_bytes
        self.alone_bytes = alone_bytes
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self._group = _Group(
            init_method, world_size, 0, backend, timeout_s, store, token, max_connections
        )
        self._staging = _Staging(self._group.device)
        self._version = -1
        self._num_publishes = 0

    def publish(self, version: int, named_tensors: Mapping[str, torch.Tensor]) -> None:
        """Broadcast `version` to every receiver; returns when they all hold it."""
        if version <= self._version:
            raise ValueError(f"published version {version} is not newer than {self._version}")
        layout = Layout.plan(named_tensors, self.bucket_bytes, self.alone_bytes)
        doc = {"version": version, "layout": layout.to_dict()}
        header = torch.frombuffer(bytearray(json.dumps(doc).encode()), dtype=torch.uint8)
        self._group.store.set(f"{_KEY}{self._num_publishes}", str(header.numel()))
        self._num_publishes += 1
        what = f"version {version}"
        _wait(self._group.broadcast(header.to(self._group.device)), what, self.timeout_s)
        tensors = list(named_tensors.values())
        in_flight: deque[tuple[dist.Work, int | None]] = deque()  # (broadcast, staging slot)
        num_staged = 0
        for b, indices in enumerate(layout.buckets):
            members = [tensors[i] for i in indices]
            flat = self._in_place(layout, b, members)
            slot = None
            if flat is None:
                slot, num_staged = num_staged % self.max_in_flight, num_staged + 1
                while any(busy == slot for _, busy in in_flight):  # slot still on the wire
                    _wait(in_flight.popleft()[0], what, self.timeout_s)
                out = self._staging.get(slot, layout.bucket_numel(b), layout.bucket_dtype(b))
                flat = flatten_bucket(members, out)
            in_flight.append((self._group.broadcast(flat), slot))
        for work, _ in in_flight:
            _wait(work, what, self.timeout_s)
        self._version = version

    def _in_place(self, layout: Layout, b: int, members: list[torch.Tensor]) -> torch.Tensor | None:
        if len(members) != 1:
            return None
        return as_flat(members[0], layout.bucket_dtype(b), self._group.device)

    def latest_version(self) -> int:
        return self._version

    def close(self, wait_s: float = 10.0) -> None:
        """Tell the receivers no more versions come (their `receive` returns None), and give
        them up to `wait_s` to see it before the store stops (0: do not wait; the store then
        stops LINGER_S later, in the background)."""
        self._group.store.set(f"{_KEY}{self._num_publishes}", _CLOSED)
        if wait_s <= 0:
            self._group.close(linger_s=LINGER_S)
            return
        deadline = time.monotonic() + wait_s
        num_receivers = self._group.world_size - 1
        while self._group.store.add(_CLOSED_ACKS, 0) < num_receivers:
            if time.monotonic() > deadline:
                log.warning("weight receivers did not all acknowledge close within %g s", wait_s)
                break
            time.sleep(0.01)
        self._group.close()


class CollectiveWeightReceiver:
    """An engine's end of the weight-sync group (rank >= 1).

    Either call `receive()` in step with the sender's `publish`, or `start()` a background thread
    that receives every version and use the subscriber calls `latest_version` and
    `fetch_newer`, which then never block on the network.
    """

    def __init__(
        self,
        init_method: str,
        world_size: int,
        rank: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        reference: Mapping[str, torch.Tensor] | None = None,
        max_in_flight: int = 2,
        poll_s: float = 0.002,
        token: str | None = None,
    ) -> None:
        """`reference` (e.g. the engine model's state_dict): every version is checked against
        its names, shapes and dtypes. Blocks until the whole group joined. `token`: the
        sender's; with another one this raises PermissionError at once."""
        if rank == 0:
            raise ValueError("rank 0 is the sender (the trainer); engines take ranks 1..N-1")
        self.timeout_s = timeout_s
        self.reference = reference
        self.max_in_flight = max_in_flight
        self.poll_s = poll_s
        self._group = _Group(init_method, world_size, rank, backend, timeout_s, token=token)
        self._staging = _Staging(self._group.device)
        self._num_received = 0
        self._closed = False
        self._lock = threading.Lock()
        self._latest: tuple[int, dict[str, torch.Tensor]] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def receive(
        self, timeout_s: float | None = None, into: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Wait for the next publish (at most `timeout_s`, default forever) and return
        (version, named tensors), or None once the sender closed.

        Without `into`, the tensors are views into freshly allocated buckets on the group's
        device. With `into` (e.g. the engine model's state_dict, which must hold every published
        name with the same shape and dtype) the weights are written into those tensors, large
        ones in place and packed ones through reused staging buffers, and those tensors are
        returned.
        """
        header_len = self._wait_for_publish(timeout_s)
        if header_len is None:
            return None
        version, layout = self._receive_header(header_len)
        if into is not None:
            layout.check_fits(into)
        named: dict[str, torch.Tensor] = {}
        # (broadcast, bucket, target, staging slot), oldest first
        pending: deque[tuple[dist.Work, int, torch.Tensor, int | None]] = deque()
        num_staged = 0
        for b in range(len(layout.buckets)):
            target, slot = self._target(layout, b, into), None
            if target is None:
                slot, num_staged = num_staged % self.max_in_flight, num_staged + 1
                while any(entry[3] == slot for entry in pending):  # slot not unpacked yet
                    self._unpack(*pending.popleft()[:3], layout, into, named)
                target = self._staging.get(slot, layout.bucket_numel(b), layout.bucket_dtype(b))
            pending.append((self._group.broadcast(target), b, target, slot))
        while pending:
            self._unpack(*pending.popleft()[:3], layout, into, named)
        named = {spec.name: named[spec.name] for spec in layout.specs}  # publisher's order
        with self._lock:
            self._latest = (version, named)
        return version, named

    def _receive_header(self, header_len: int) -> tuple[int, Layout]:
        header = torch.empty(header_len, dtype=torch.uint8, device=self._group.device)
        _wait(self._group.broadcast(header), "a version header", self.timeout_s)
        doc = json.loads(header.cpu().numpy().tobytes())
        version, layout = int(doc["version"]), Layout.from_dict(doc["layout"])
        held = self._latest[0] if self._latest is not None else -1
        if version <= held:
            raise RuntimeError(f"sender published version {version} after version {held}")
        if self.reference is not None:
            layout.check_fits(self.reference, require_all=True)
        return version, layout

    def _target(
        self, layout: Layout, b: int, into: Mapping[str, torch.Tensor] | None
    ) -> torch.Tensor | None:
        """Where bucket `b` lands: a fresh buffer, or its one destination tensor itself, or None
        for a staging buffer."""
        dtype = layout.bucket_dtype(b)
        if into is None:
            return torch.empty(layout.bucket_numel(b), dtype=dtype, device=self._group.device)
        specs = layout.bucket_specs(b)
        if len(specs) != 1:
            return None
        return as_flat(into[specs[0].name], dtype, self._group.device)

    def _unpack(
        self,
        work: dist.Work,
        b: int,
        target: torch.Tensor,
        layout: Layout,
        into: Mapping[str, torch.Tensor] | None,
        named: dict[str, torch.Tensor],
    ) -> None:
        _wait(work, f"bucket {b}", self.timeout_s)
        for name, view in unflatten_bucket(target, layout.bucket_specs(b)).items():
            if into is None:
                named[name] = view
                continue
            dest = into[name]
            if view.data_ptr() != dest.data_ptr():  # else received in place
                dest.detach().copy_(view)
            named[name] = dest

    def _wait_for_publish(self, timeout_s: float | None) -> int | None:
        """Header length of the next publish, or None if the sender closed (or `close()`)."""
        key = f"{_KEY}{self._num_received}"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # Polling `check` (not `wait`) so `close()` can stop an idle receiver at any moment.
        while not self._store_check(key):
            if self._closed:
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no weight version published within {timeout_s:g} s")
            time.sleep(self.poll_s)
        self._num_received += 1
        value = self._group.store.get(key)
        if value == _CLOSED:
            self._group.store.add(_CLOSED_ACKS, 1)
            return None
        return int(value)

    def _store_check(self, key: str) -> bool:
        try:
            return self._group.store.check([key])
        except dist.DistError as e:
            raise ConnectionError(
                "lost the weight-sync store served by the sender: the trainer exited without "
                "closing its CollectiveWeightSender"
            ) from e

    def start(self, into: Mapping[str, torch.Tensor] | None = None) -> CollectiveWeightReceiver:
        """Receive every version in a background thread until the sender closes (`into`: as in
        `receive`; the destinations then change whenever a version arrives)."""
        self._thread = threading.Thread(
            target=self._run, args=(into,), name="weight-receiver", daemon=True
        )
        self._thread.start()
        return self

    def _run(self, into: Mapping[str, torch.Tensor] | None) -> None:
        try:
            while self.receive(into=into) is not None:
                pass
        except BaseException as e:  # surfaced by the next latest_version / fetch_newer
            self._error = e

    def latest_version(self) -> int:
        self._raise_thread_error()
        with self._lock:
            return self._latest[0] if self._latest is not None else -1

    def fetch_newer(self, have_version: int) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        """The newest received version if newer than `have_version`, else None (never blocks)."""
        self._raise_thread_error()
        with self._lock:
            if self._latest is None or self._latest[0] <= have_version:
                return None
            return self._latest

    def _raise_thread_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the background weight receiver failed") from self._error

    def close(self) -> None:
        """Stop waiting for versions (a broadcast already under way finishes first)."""
        self._closed = True
        if self._thread is not None:
            self._thread.join()
        self._group.close()
