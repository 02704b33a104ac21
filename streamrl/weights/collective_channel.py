"""The `collective` weight channel of a Ray run (`runtime.weights.channel=collective`): a
torch.distributed broadcast (gloo) from the trainer to the engines in the steady state, and the
DCS host copy in Ray's object store for everything a fixed-size group cannot do.

```
 trainer  publish(v) ─► directory actor: host copy of v (object store), tagged "v goes over group e"
    └──── broadcast v over group e (weights/collective.py) ─────► engines that are members of e
 engine   fetch_newer(have): v from the group when a member of e, else the host copy
```

A torch.distributed group has a fixed world size, while engines restart, are added by
`streamrl scale` and are drained. So groups come in epochs:

- An engine becomes a member on its first `fetch_newer`: a thread of its own heartbeats to the
  directory (the Ray actor that holds the host copy) twice a second; a member silent for 3 s is
  gone.
- At each publish the trainer compares the live members with its group's. When they differ it
  closes the group (its receivers see `closed` and leave) and, in a background thread, forms
  epoch e+1: a rendezvous store on a free port (or `weight_port + e % 16`), announced through the
  directory and joined by every member's receiver thread. Meanwhile publishes go through the
  host copy alone.
- Every version is written to the host copy first, tagged with the epoch it is also broadcast
  over (or none). An engine takes a version from the host copy unless it is a member of that
  epoch; a member waits for the broadcast (at most 30 s, then it takes the host copy anyway).
- A broadcast that fails (a member died; gloo notices at once) untags the version and drops the
  group; the trainer forms a new one once the dead member's heartbeat has lapsed. A group that
  does not form within 30 s (a member died while joining, or cannot reach the rendezvous
  address) is retried after 4 s, then 8, 16, ... up to 2 minutes. With a loopback `weight_bind`
  only engines on the trainer's node are asked to join.
- A restarted trainer starts with no group and forms a new epoch with the live members; the
  receivers of the old one see its store vanish and leave. Versions not newer than the host copy
  (a trainer resumed from a checkpoint replays steps) are neither stored nor broadcast.

No engine ever waits for a group to (re)form and no version is lost: the host copy holds it. The
price is one copy per version into the object store, which is what lets an engine start, restart
or fall behind without a disk checkpoint. Nothing on the group's sockets is pickled (a JSON
header, then raw bytes).

Joining takes the tcp channel's token (`runtime.weights.token` or $STREAMRL_WEIGHT_TOKEN, in
the handles, never in the directory's record): the rendezvous store (`weights/store.py`) listens
on the configured address only and admits an engine only once it proved the token; one with
another token is refused ("could not join weight group ...: holds a different token") and takes
the host copy, and the group does not form with it (the trainer's rendezvous times out, naming
the refused connections, and retries later). A non-loopback `bind` needs a token. What is not
covered: once formed, gloo's (or NCCL's) own sockets carry the weights unauthenticated, so keep
the group on a network you trust; gloo's listen on the rendezvous address (the trainer) and the
address each engine reaches it from, NCCL's where NCCL_SOCKET_IFNAME says.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streamrl.api.weights import poll_newer
from streamrl.weights.dcs import Bucket, RayStoreClient, _WeightStoreActor, to_buckets
from streamrl.weights.tcp import MAX_CONNECTIONS, is_loopback, require_token_beyond_loopback

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
MEMBER_TIMEOUT_S = 3.0
RETRY_S = 4.0  # after a group failed to form, doubling up to RETRY_MAX_S
RETRY_MAX_S = 120.0
TIMEOUT_S = 30.0  # joining a group, and each broadcast
GRACE_S = 30.0
POLL_S = 0.05  # how often a member's `wait_newer` looks for a version that came over its group
PORTS_PER_RANGE = 16


class _DirectoryActor(_WeightStoreActor):
    """Ray actor body: the host copy (as the object-store channel's), the epoch its version is
    broadcast over, the members' heartbeats and the epoch engines should join."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch_of_version: int | None = None
        self.members: dict[str, tuple[str, float]] = {}  # member -> (node ip, last heartbeat)
        self.record: dict[str, Any] | None = None
        self.num_epochs = 0

    def set_tagged(self, version: int, buckets: list[Bucket], epoch: int | None) -> bool:
        """Hold `version` if newer than the held one; False (nothing done) otherwise."""
        if not self._hold(version, buckets):
            return False
        self.epoch_of_version = epoch
        return True

    def untag(self, version: int) -> None:
        if version == self.version:
            self.epoch_of_version = None

    def state(self) -> tuple[int, int | None]:
        return self.version, self.epoch_of_version

    def heartbeat(self, member: str, node: str) -> dict[str, Any] | None:
        self.members[member] = (node, time.monotonic())
        return self.record

    def live_members(self, max_age_s: float, node: str | None) -> list[str]:
        now = time.monotonic()
        for member, (_, seen) in list(self.members.items()):
            if now - seen > 10 * max_age_s:
                del self.members[member]  # long gone
        return sorted(
            member
            for member, (on, seen) in self.members.items()
            if now - seen <= max_age_s and node in (None, on)
        )

    def new_epoch(self) -> int:
        self.num_epochs += 1
        return self.num_epochs

    def announce(self, record: dict[str, Any] | None) -> None:
        self.record = record


class GroupDirectory(RayStoreClient):
    """Client of the directory actor; picklable (holds only the actor handle). Its
    `wait_newer` wakes at the host copy's write: right for an engine that takes the host copy,
    too early for a member of the group the version goes over (`CollectiveSubscriber`)."""

    @classmethod
    def create(cls, bucket_bytes: int = 64 * 2**20) -> GroupDirectory:
        import ray

        return cls(ray.remote(num_cpus=0)(_DirectoryActor).remote(), bucket_bytes)

    def publish_tagged(
        self, version: int, named_tensors: Mapping[str, Any], epoch: int | None
    ) -> bool:
        buckets = to_buckets(named_tensors, self.bucket_bytes)
        return self.call("set_tagged", version, buckets, epoch)

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(getattr(self.handle, method).remote(*args))


# -- the trainer's side -------------------------------------------------------------------------


class CollectivePublisher:
    """The trainer's handle: host copy first, then a broadcast when a group is live."""

    def __init__(
        self,
        directory: GroupDirectory,
        bind: str,
        port: int,
        timeout_s: float = TIMEOUT_S,
        backend: str = "gloo",
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ):
        require_token_beyond_loopback(bind, token, "serve the weight-sync group")
        self.directory, self.bind, self.port, self.timeout_s = directory, bind, port, timeout_s
        self.backend, self.token, self.max_connections = backend, token, max_connections
        self._sender: _GroupSender | None = None

    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        if self._sender is None:  # created in the trainer's process, not where the handle is made
            self._sender = _GroupSender(
                self.directory,
                self.bind,
                self.port,
                self.timeout_s,
                self.backend,
                self.token,
                self.max_connections,
            )
        self._sender.publish(version, named_tensors)

    def latest_version(self) -> int:
        return self.directory.latest_version()

    def close(self) -> None:
        """End this process's group (its receivers leave), as the trainer's exit does; the host
        copy stays in the directory. Publishing again starts a new group."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_sender": None}


@dataclass
class _Epoch:
    number: int
    members: tuple[str, ...]
    sender: Any  # CollectiveWeightSender


class _GroupSender:
    """In the trainer's process: the live group, the one being formed, and when to retry."""

    def __init__(
        self,
        directory: GroupDirectory,
        bind: str,
        port: int,
        timeout_s: float,
        backend: str = "gloo",
        token: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ):
        import ray

        self.directory = directory
        self.token, self.max_connections = token, max_connections
        self.loopback = is_loopback(bind)
        self.node = ray.util.get_node_ip_address()
        if self.loopback:
            self.host = "127.0.0.1"
        else:
            self.host = self.node if bind in ("", "0.0.0.0", "::") else bind
        self.port, self.timeout_s, self.backend = port, timeout_s, backend
        self.group: _Epoch | None = None
        self._forming: threading.Thread | None = None
        self._formed: _Epoch | None = None
        self._retry_at = 0.0
        self._num_failed = 0  # groups in a row that did not form

    def publish(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        group = self._current()
        epoch = group.number if group is not None else None
        if not self.directory.publish_tagged(version, named_tensors, epoch):
            log.info("weights: version %d not newer than the held one; not published", version)
            return
        if group is None:
            return
        try:
            group.sender.publish(version, named_tensors)
        except Exception as e:  # noqa: BLE001 - a member died: the host copy has the version
            log.warning(
                "weight group %d: broadcast of version %d failed (%s); engines take it from the "
                "host copy, a new group forms once the lost member's heartbeat lapses",
                group.number,
                version,
                e,
            )
            self.directory.call("untag", version)
            self.group = None
            self._retry_at = time.monotonic() + MEMBER_TIMEOUT_S + 2 * HEARTBEAT_S
            _close_in_background(group)

    def close(self) -> None:
        """Close the live group and the one being formed (waiting for it to form or fail)."""
        if self._forming is not None:
            self._forming.join()
            self._forming = None
        for group in (self.group, self._formed):
            if group is not None:
                _close(group)
        self.group = self._formed = None

    def _current(self) -> _Epoch | None:
        """The live group; starts forming a new one when the members changed."""
        if self._forming is not None:
            if self._forming.is_alive():
                return None
            self._forming = None
            self.group, self._formed = self._formed, None
        if time.monotonic() < self._retry_at:
            return self.group
        on = self.node if self.loopback else None  # loopback: only engines on this node can join
        members = tuple(self.directory.call("live_members", MEMBER_TIMEOUT_S, on))
        if members != (self.group.members if self.group is not None else ()):
            old, self.group = self.group, None
            self._forming = threading.Thread(
                target=self._form, args=(old, members), name="weight-group", daemon=True
            )
            self._forming.start()
        return self.group

    def _form(self, old: _Epoch | None, members: tuple[str, ...]) -> None:
        from streamrl.weights.collective import CollectiveWeightSender
        from streamrl.weights.store import StoreServer

        if old is not None:
            _close(old)
        if not members:
            self.directory.call("announce", None)
            return
        number = self.directory.call("new_epoch")
        port = self.port + number % PORTS_PER_RANGE if self.port else 0
        world_size = len(members) + 1
        store = None
        try:
            store = StoreServer(
                self.host, port, token=self.token, max_connections=self.max_connections
            )
            init_method = f"tcp://{self.host}:{store.address[1]}"
            ranks = {member: rank for rank, member in enumerate(members, start=1)}
            self.directory.call(
                "announce",
                {
                    "epoch": number,
                    "init_method": init_method,
                    "world_size": world_size,
                    "ranks": ranks,
                    "backend": self.backend,
                },
            )
            sender = CollectiveWeightSender(
                init_method,
                world_size,
                timeout_s=self.timeout_s,
                store=store,
                backend=self.backend,
            )
        except Exception as e:  # noqa: BLE001 - the host copy carries the weights meanwhile
            if store is not None:
                store.close()
            delay = min(RETRY_S * 2**self._num_failed, RETRY_MAX_S)
            self._num_failed += 1
            log.warning(
                "weight group %d with %d engines did not form (%s); weights go through the host "
                "copy, retrying in %.0fs",
                number,
                len(members),
                e,
                delay,
            )
            self.directory.call("announce", None)
            self._retry_at = time.monotonic() + delay
            return
        log.info("weight group %d formed: the trainer and %d engines", number, len(members))
        self._num_failed = 0
        self._formed = _Epoch(number, members, sender)


def _close(group: _Epoch) -> None:
    """Tell its receivers the group is over (they leave when they see it, or when its store,
    served by this process, goes away with the sender)."""
    try:
        group.sender.close(wait_s=0.0)
    except Exception as e:  # noqa: BLE001 - its store or peers are gone: nothing left to close
        log.info("weight group %d closed with an error: %s", group.number, e)


def _close_in_background(group: _Epoch) -> None:
    threading.Thread(target=_close, args=(group,), name="weight-group-close", daemon=True).start()


# -- an engine's side ----------------------------------------------------------------------------


class CollectiveSubscriber:
    """An engine's handle: the newest version from its group, else from the host copy.

    It joins groups from its first `fetch_newer` on; a role that only follows versions (the
    feeder) never does, and waits inside the directory. A member's `wait_newer` polls the
    directory every POLL_S instead: a version held there may still be on its way over the group.
    """

    def __init__(
        self, directory: GroupDirectory, timeout_s: float = TIMEOUT_S, token: str | None = None
    ):
        self.directory, self.timeout_s, self.token = directory, timeout_s, token
        self._member: _Member | None = None

    def latest_version(self) -> int:
        return self.directory.latest_version()

    def fetch_newer(self, have_version: int) -> tuple[int, Mapping[str, Any]] | None:
        if self._member is None:
            self._member = _Member(self.directory, self.timeout_s, self.token)
        latest, epoch = self.directory.call("state")
        if latest <= have_version:
            return None
        got = self._member.newest
        if got is not None and got[0] >= latest:
            return got
        if self._on_its_way(latest, epoch):
            return None  # the newest comes over the group any moment: not an older one now
        return self.directory.fetch_newer(have_version)

    def wait_newer(self, have_version: int, timeout_s: float) -> int:
        if self._member is None:
            return self.directory.wait_newer(have_version, timeout_s)

        def newest() -> int:  # what `fetch_newer` would return now
            latest, epoch = self.directory.call("state")
            got = self._member.newest
            if got is not None and got[0] >= latest:
                return got[0]
            if self._on_its_way(latest, epoch):
                return min(latest, have_version)
            return latest

        return poll_newer(newest, have_version, timeout_s, POLL_S)

    def _on_its_way(self, latest: int, epoch: int | None) -> bool:
        """True while `latest`, tagged with `epoch`, is due over this member's group."""
        return (
            epoch is not None and epoch == self._member.epoch and not self._member.overdue(latest)
        )

    @property
    def epoch(self) -> int | None:
        """The group this engine receives over now (None: the host copy only)."""
        return self._member.epoch if self._member is not None else None

    def close(self) -> None:
        """Stop this engine's heartbeats and leave its group (the host copy still serves)."""
        if self._member is not None:
            self._member.close()
            self._member = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_member": None}


class _Member:
    """Heartbeats to the directory and receives over the group it is asked to join."""

    def __init__(self, directory: GroupDirectory, timeout_s: float, token: str | None) -> None:
        import ray

        self.directory = directory
        self.timeout_s = timeout_s
        self.token = token
        self.node = ray.util.get_node_ip_address()
        self.id = f"{self.node}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.epoch: int | None = None
        self.newest: tuple[int, Mapping[str, Any]] | None = None
        self._record: dict[str, Any] | None = None
        self._first_seen: dict[int, float] = {}
        self._stop = threading.Event()
        for target, name in ((self._heartbeats, "weight-heartbeat"), (self._receive, "weight-rx")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def overdue(self, version: int) -> bool:
        """True once `version` was announced for this member's group GRACE_S ago."""
        first = self._first_seen.setdefault(version, time.monotonic())
        return time.monotonic() - first > GRACE_S

    def _heartbeats(self) -> None:
        import ray

        while not self._stop.is_set():
            # Ray shut down in this process (the run, or a test, is over): a call now would
            # start a new local Ray instance from this thread, whose processes die with the
            # thread and leave this process to exit a minute later, unable to reach it.
            if not ray.is_initialized():
                return
            try:
                record = self.directory.call("heartbeat", self.id, self.node)
            except SystemExit:  # Ray shutting down this process under a pending call
                return
            except Exception as e:  # noqa: BLE001 - the directory is gone: the run is ending
                log.info("weight directory gone (%s): no more heartbeats", e)
                return
            self._record = record if record is not None and self.id in record["ranks"] else None
            self._stop.wait(HEARTBEAT_S)

    def _receive(self) -> None:
        from streamrl.weights.collective import CollectiveWeightReceiver

        receiver, joined, tried = None, None, set()
        while not self._stop.is_set():
            record = self._record
            wanted = record["epoch"] if record is not None else None
            if receiver is not None and wanted != joined:
                receiver.close()
                receiver, self.epoch = None, None
            if receiver is None:
                if wanted is None or wanted in tried:
                    time.sleep(0.05)
                    continue
                tried.add(wanted)  # one attempt per epoch: a failed one is not retried
                try:
                    receiver = CollectiveWeightReceiver(
                        record["init_method"],
                        record["world_size"],
                        record["ranks"][self.id],
                        timeout_s=self.timeout_s,
                        poll_s=0.01,
                        backend=record["backend"],
                        token=self.token,
                    )
                except Exception as e:  # noqa: BLE001 - the host copy serves this engine
                    log.warning("could not join weight group %d: %s", wanted, e)
                    continue
                joined, self.epoch = wanted, wanted
                log.info("joined weight group %d as rank %d", wanted, record["ranks"][self.id])
                continue
            try:
                got = receiver.receive(timeout_s=0.5)
            except TimeoutError:
                continue
            except Exception as e:  # noqa: BLE001 - the group broke: back to the host copy
                log.info("left weight group %d: %s", joined, e)
                receiver.close()
                receiver, self.epoch = None, None
                continue
            if got is None:
                log.info("weight group %d closed by the trainer", joined)
                receiver.close()
                receiver, self.epoch = None, None
                continue
            log.info("weights: version %d over weight group %d", got[0], joined)
            self.newest = got
        if receiver is not None:
            receiver.close()
