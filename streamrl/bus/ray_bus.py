"""RayBus: the bus for multi-process runs, a client over N shard actors.

Rows are spread over ``shards`` Ray actors (``BusShard``, each holding a ``ShardBus``) by group:
the rows of group ``g`` live on shard ``crc32(g) % N``, so a group is always whole on one shard
and group samplers need no cross-shard state. Field values never pass through a shard when
they are large (``streamrl.bus.payload``)::

    feeder ─ add_rows ──► shard 0 ── plan, check capacity, add ──► shards owning the groups
    writer ─ write ─────► shard of each row (small values inline)
      └─ large values ─► object store (one object per call; owned by the node's keeper)
    reader ─ claim ─────► every shard (fan out) ─► merge by the sampler ─► give back extras
      └─ one ray.get of the objects the kept rows point into

What each call touches (one shard: every call is one actor call, as with a single actor):

| call | shards | how |
| --- | --- | --- |
| ``register_consumer``, ``stats``, ``state_dict``, ``load_state_dict``, ``release_consumer``, ``can_add`` | all | fan out, merge |
| ``add_rows`` | shard 0 | shard 0 validates on the owning shards, checks the global capacity, then adds; adds are serialised there, so the capacity is exact |
| ``write``, ``drop`` | the rows' shards | routed; ids this client has not seen are located first |
| ``claim`` | all (one if ``where`` pins ``group_id``) | each shard leases its own pick, the sampler re-runs over the union, rows not kept go back |
| ``ack``, ``release``, ``renew`` | the lease's shards | the lease id names them: ``<uuid>@<shard>.<shard>`` |

A claim with ``wait_s`` on several shards claims from every shard not already being polled for
it; if nothing comes back it long-polls those shards with ``wait_ready`` (which leases nothing)
and, as soon as one poll fires, claims from the shards whose polls fired. Polls stay open across
claims of the same request, so a role claiming in a loop asks only the shards that have rows.
(A waiting claim may thus miss rows whose poll is in flight; a claim without ``wait_s`` always
asks every shard.) With one shard the shard itself long-polls.

Counters in ``stats`` are summed over shards, except ``leases_open`` which counts distinct
leases; ``expired_leases`` counts per shard (a lease spanning k shards counts k times).

``RayBus`` holds only the shard handles and options, so it pickles cheaply and can be passed to
other actors and tasks.

A ``restartable`` bus survives the loss of a shard's process: Ray restarts the shard under the
same handle and retries the calls in flight, which wait until the supervisor has restored the
shard (``restore_shard``) and re-added its rows that were not yet trained (``restore_rows``);
``runtime/recovery.py`` says which rows and why training stays exactly-once.
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from collections import OrderedDict, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayTaskError

from streamrl.api.bus import Lease, UnknownSampleError
from streamrl.bus import samplers
from streamrl.bus.payload import PAYLOAD_OWNERS, PayloadOwner, WireSlot, resolve, store
from streamrl.bus.ray_shard import BusOptions, BusShard, ClaimReply, RemoteBusShard, get_all
from streamrl.bus.validate import check_field_names

_LOCATED_KEPT = 200_000  # sample id -> shard entries a client remembers for routing


class RayBus:
    """Client implementing ``streamrl.api.bus.Bus`` over ``BusShard`` actors.

    Build one with ``RayBus.create(...)`` (starts the shards; this client then owns them and
    ``close()`` stops them) or ``RayBus.from_handle(handle)`` (attaches to a running bus through
    its shard 0; ``close()`` only detaches this client). Copies sent to other processes attach.
    """

    def __init__(
        self,
        shards: Sequence[ray.actor.ActorHandle],
        options: BusOptions,
        *,
        owns_actors: bool = False,
    ) -> None:
        self._shards = list(shards)
        self._options = options
        self._owns_actors = owns_actors
        self._closed = False
        self._keeper: ray.actor.ActorHandle | None = None
        # sample id -> shard, for routing writes, drops and partial acks by sample id.
        self._located: OrderedDict[str, int] = OrderedDict()
        self._located_lock = threading.Lock()
        self._polls = threading.local()  # open long polls of this thread's claim (_wait_any)

    @classmethod
    def create(
        cls,
        name: str | None = None,
        *,
        shards: int = 1,
        capacity_groups: int | None = None,
        closed_leases_kept: int = 10_000,
        inline_bytes: int = 256 * 1024,
        payload_owner: PayloadOwner = "keeper",
        max_concurrency: int = 64,
        restartable: bool = False,
    ) -> RayBus:
        """Start ``shards`` shard actors (no CPU reserved: they mostly wait).

        Args:
            name: makes shard 0 a named actor others can attach to (``ray.get_actor``).
            shards: number of shard actors; groups are spread over them by hash.
            capacity_groups: at most this many groups live across all shards (None: unbounded).
            closed_leases_kept: per shard, how many closed leases to remember for late acks.
            inline_bytes: field values smaller than this travel inline through a shard;
                larger ones go through the object store (``streamrl.bus.payload``).
            payload_owner: who owns object-store payloads: ``"keeper"`` (survives the writer)
                or ``"writer"`` (cheaper; lost if the writer dies).
            max_concurrency: threads of each shard actor. A claim that waits for rows
                (``wait_s``) holds one, so give it more than the calls clients keep in flight.
            restartable: Ray restarts a shard whose process died (empty, holding calls until
                ``restore_shard``) and retries the calls in flight; otherwise a lost shard is
                gone and calls to it fail.
        """
        if not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards must be an int >= 1, got {shards!r}")
        if capacity_groups is not None and capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1 or None, got {capacity_groups}")
        if payload_owner not in PAYLOAD_OWNERS:
            raise ValueError(
                f"payload_owner must be one of {PAYLOAD_OWNERS}, got {payload_owner!r}"
            )
        options = BusOptions(capacity_groups, inline_bytes, payload_owner)
        strategy = "SPREAD" if shards > 1 else "DEFAULT"
        restarts = {"max_restarts": -1, "max_task_retries": -1} if restartable else {}
        bus_id = uuid.uuid4().hex[:12] if restartable else ""
        handles = [
            RemoteBusShard.options(
                name=name if k == 0 else None,
                num_cpus=0,
                scheduling_strategy=strategy,
                max_concurrency=max_concurrency,
                **restarts,
            ).remote(k, shards, capacity_groups, closed_leases_kept, bus_id)
            for k in range(shards)
        ]
        get_all([handles[0].connect.remote(handles, options)])
        return cls(handles, options, owns_actors=True)

    @classmethod
    def from_handle(cls, handle: ray.actor.ActorHandle) -> RayBus:
        """Attach to a running bus through its shard 0, e.g. ``ray.get_actor(name)``."""
        shards, options = get_all([handle.topology.remote()])[0]
        return cls(shards, options)

    @property
    def handle(self) -> ray.actor.ActorHandle:
        """Shard 0, through which other clients can attach (``from_handle``)."""
        return self._shards[0]

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RayBus, (self._shards, self._options))

    # -- Bus protocol: rows ------------------------------------------------------------------

    def register_consumer(self, name: str) -> None:
        self._on_all("register_consumer", name)

    def add_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        self._add_rows(rows, check_capacity=True)

    def _add_rows(self, rows: Sequence[Mapping[str, Any]], *, check_capacity: bool) -> None:
        rows = [dict(row) for row in rows]
        stored = self._store({i: row.get("fields") or {} for i, row in enumerate(rows)})
        summaries: dict[str, dict[str, Any]] = {}
        for i, row in enumerate(rows):
            fields = row.get("fields") or {}
            if fields and "sample_id" in row:
                summaries[row["sample_id"]] = samplers.summarize(fields)
            row["fields"] = stored[i]
        if self.num_shards == 1 and check_capacity:  # the shard checks and adds by itself
            self._on({0: (rows, summaries)}, "add_rows")
            return
        rows_by_shard: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
        summaries_by_shard: dict[int, dict[str, Any]] = defaultdict(dict)
        for pos, row in enumerate(rows):
            k = self._shard_of(row.get("group_id"))
            rows_by_shard[k].append((pos, row))
            if row.get("sample_id") in summaries:
                summaries_by_shard[k][row["sample_id"]] = summaries[row["sample_id"]]
        calls = {0: (dict(rows_by_shard), dict(summaries_by_shard), check_capacity)}
        self._on(calls, "add_rows_sharded")
        self._remember((row["sample_id"], row["group_id"]) for row in rows)

    def can_add(self, num_groups: int, wait_s: float = 0.0) -> bool:
        if self.num_shards == 1:  # the shard waits for room itself
            return self._on({0: (num_groups, wait_s)}, "can_add")[0]
        # The capacity spans shards, so no one shard can wait for room: look every 50 ms.
        cap = self._options.capacity_groups
        deadline = time.monotonic() + wait_s
        while cap is not None and self.num_groups_live() + num_groups > cap:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(remaining, 0.05))
        return True

    def num_groups_live(self) -> int:
        return sum(self._on_all("num_groups_live").values())

    def write(self, updates: Mapping[str, Mapping[str, Any]]) -> None:
        self._on(self._write_calls(updates), "write")

    def _write_calls(
        self, updates: Mapping[str, Mapping[str, Any]]
    ) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
        """``write``'s arguments for each shard: (stored values, summaries) by sample id.
        Validates everything first, so that a write either reaches every shard or none."""
        updates = {sample_id: dict(values) for sample_id, values in updates.items()}
        if self.num_shards > 1:
            for values in updates.values():  # before any shard writes: all or nothing
                check_field_names(values)
        by_shard, unknown = self._locate(list(updates))
        if unknown:
            raise UnknownSampleError(unknown[0])
        stored = self._store(updates)
        summaries = {sid: s for sid, values in updates.items() if (s := samplers.summarize(values))}
        return {
            k: ({s: stored[s] for s in ids}, {s: summaries[s] for s in ids if s in summaries})
            for k, ids in by_shard.items()
        }

    def drop(self, sample_ids: Sequence[str], reason: str) -> None:
        by_shard, unknown = self._locate(list(sample_ids))
        if unknown:
            raise UnknownSampleError(unknown[0])
        self._on({k: (ids, reason) for k, ids in by_shard.items()}, "drop")

    # -- Bus protocol: leases ----------------------------------------------------------------

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
        self._check_open()
        request = {
            "consumer": consumer,
            "fields": fields if isinstance(fields, str) else list(fields),  # str: shard raises
            "max_rows": max_rows,
            "sampler": sampler,
            "where": dict(where) if where else None,
            "sampler_options": dict(sampler_options) if sampler_options else None,
        }
        targets = self._claim_targets(where)
        if len(targets) == 1 or wait_s <= 0:  # one shard long-polls by itself; or no wait
            return self._claim_round(targets, request, lease_s, wait_s)
        deadline = time.monotonic() + wait_s
        while True:
            ready = self._unpolled(targets, request)
            lease = self._claim_round(ready, request, lease_s, 0.0) if ready else None
            remaining = deadline - time.monotonic()
            if lease is not None or remaining <= 0:
                return lease
            self._wait_any(targets, request, remaining)

    def ack(
        self,
        lease_id: str,
        sample_ids: Sequence[str] | None = None,
        *,
        writes: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        lease_uuid, shards = self._split_lease_id(lease_id)
        if sample_ids is None or len(shards) == 1:
            ids_by_shard = {k: None if sample_ids is None else list(sample_ids) for k in shards}
        else:
            by_shard, unknown = self._locate(list(sample_ids))
            outside = unknown + [s for k, ids in by_shard.items() if k not in shards for s in ids]
            if outside:
                raise ValueError(
                    f"ack of lease {lease_id!r} names sample ids it does not hold: "
                    f"{sorted(outside)}"
                )
            ids_by_shard = {k: by_shard.get(k, []) for k in shards}
        writes_by_shard = self._write_calls(writes) if writes else {}
        if any(k not in shards for k in writes_by_shard):  # rows outside the lease: write first
            self._on(writes_by_shard, "write")
            writes_by_shard = {}
        calls = {
            k: (lease_uuid, ids, *writes_by_shard.get(k, (None, None)))
            for k, ids in ids_by_shard.items()
        }
        self._on(calls, "ack")

    def release(self, lease_id: str) -> None:
        lease_uuid, shards = self._split_lease_id(lease_id)
        self._on({k: (lease_uuid,) for k in shards}, "release")

    def renew(self, lease_id: str, lease_s: float | None = None) -> None:
        lease_uuid, shards = self._split_lease_id(lease_id)
        self._on({k: (lease_uuid, lease_s) for k in shards}, "renew")

    def release_consumer(self, consumer: str) -> int:
        released = self._on_all("release_consumer", consumer).values()
        return len({lease_id for ids in released for lease_id in ids})

    # -- Bus protocol: reporting, checkpoints, shutdown ----------------------------------------

    def stats(self) -> dict[str, Any]:
        parts = list(self._on_all("stats").values())
        merged = _sum_counters([stats for stats, _ in parts])
        merged["leases_open"] = len({lease_id for _, ids in parts for lease_id in ids})
        return merged

    def state_dict(self) -> dict[str, Any]:
        parts = list(self._on_all("state_dict").values())
        return {
            "version": parts[0]["version"],
            "consumers": parts[0]["consumers"],
            "counters": _sum_counters([part["counters"] for part in parts]),
            "freed": sorted({sample_id for part in parts for sample_id in part["freed"]}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.num_shards == 1:
            self._on({0: (state,)}, "load_state_dict")
            return
        num_live = self.stats()["rows_live"]
        if num_live:
            raise ValueError(
                f"load_state_dict() on a bus with {num_live} live rows; load the state before "
                "the feeder adds rows"
            )
        # Counters are loaded once (shard 0), the freed ids everywhere: a re-added id is
        # recognised by whichever shard its group maps to.
        self._on({0: (state,)}, "load_state_dict")
        counters = {
            k: {name: 0 for name in v} if isinstance(v, dict) else 0
            for k, v in state["counters"].items()
        }
        rest = {**state, "counters": counters}
        self._on({k: (rest,) for k in range(1, self.num_shards)}, "load_state_dict")

    # -- after a shard's process was lost (restartable buses) -----------------------------------

    def restore_shard(self, k: int, consumers: Sequence[str], freed: Sequence[str] = ()) -> None:
        """Ray restarted shard ``k`` empty: give it the topology, the consumers and ``freed``
        (ids consumed, from the latest checkpoint), with creation numbers after every live
        shard's, and let the calls it holds through. Its rows are re-added by the caller."""
        others = [j for j in range(self.num_shards) if j != k]
        next_seq = max(get_all([self._shards[j].next_seq.remote() for j in others]), default=0)
        topology = (self._shards, self._options)
        get_all([self._shards[k].restore.remote(*topology, list(consumers), list(freed), next_seq)])

    def restore_rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """``add_rows`` for rows that were live when their shard was lost: the capacity is not
        checked (they held their room before), ids live or consumed elsewhere are skipped."""
        if rows:
            self._add_rows(rows, check_capacity=False)

    def shard_of(self, group_id: Any) -> int:
        """The shard that holds (or would hold) the rows of group ``group_id``."""
        return self._shard_of(group_id)

    def ping_all(self) -> dict[int, ray.ObjectRef]:
        """Start a health check of every shard: shard -> a call that answers with its pid, or
        fails with ``RayActorError`` once the shard's process is gone (the supervisor's use)."""
        return {k: shard.ping.remote() for k, shard in enumerate(self._shards)}

    def dead_shards(self, timeout_s: float = 10.0) -> list[int]:
        """The shards whose process is gone (a shard slower than ``timeout_s`` counts as live)."""
        dead = []
        for k, ref in self.ping_all().items():
            try:
                ray.get(ref, timeout=timeout_s)
            except ray.exceptions.RayActorError:
                dead.append(k)
            except ray.exceptions.GetTimeoutError:
                pass
        return dead

    def close(self) -> None:
        """Owner: empty the bus and stop its actors (a shard already gone is skipped). Attached
        client: detach. Idempotent."""
        if self._closed:
            return
        if self._owns_actors:
            for shard in self._shards:
                try:
                    ray.get(shard.close.remote(), timeout=30)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass  # lost with its rows (the supervisor's case), or hung: killed below
                ray.kill(shard)
        self._closed = True

    # -- internals: claims -----------------------------------------------------------------

    def _claim_targets(self, where: Mapping[str, tuple[str, Any]] | None) -> list[int]:
        condition = (where or {}).get("group_id")
        if isinstance(condition, tuple | list) and len(condition) == 2 and condition[0] == "==":
            if isinstance(condition[1], str):
                return [self._shard_of(condition[1])]
        return list(range(self.num_shards))

    def _claim_round(
        self, targets: list[int], request: dict[str, Any], lease_s: float, wait_s: float
    ) -> Lease | None:
        """One claim over ``targets``: every shard leases its own pick under one lease id; with
        several answers the sampler re-runs over their union and the rest goes back."""
        lease_uuid = uuid.uuid4().hex
        merge = len(targets) > 1
        sent_at = time.monotonic()
        refs = [
            self._shards[k].claim.remote(
                lease_uuid, lease_s=lease_s, wait_s=wait_s, with_views=merge, **request
            )
            for k in targets
        ]
        replies = self._gather_claims(lease_uuid, targets, refs)
        if not replies:
            return None
        rows_by_id = {
            row["sample_id"]: (k, row) for k, reply in replies.items() for row in reply.rows
        }
        if len(replies) == 1:
            chosen = list(rows_by_id)
        else:
            views = sorted((v for r in replies.values() for v in r.views), key=lambda v: v.seq)
            chosen = samplers.select(
                request["sampler"], views, request["max_rows"], request["sampler_options"]
            )
        kept, give_back = self._give_back(lease_uuid, replies, set(chosen))
        # One list of refs for the whole lease: shift each shard's wire slots by an offset.
        refs_all: list[ray.ObjectRef] = []
        offsets = {}
        for k, reply in replies.items():
            offsets[k] = len(refs_all)
            refs_all.extend(reply.refs)
        rows = [_shift_slots(rows_by_id[s][1], offsets[rows_by_id[s][0]]) for s in chosen]
        resolve(rows, refs_all)
        get_all(give_back)
        self._remember((row["sample_id"], row["group_id"]) for row in rows)
        expires_at = min(sent_at + (replies[k].expires_at - replies[k].shard_now) for k in kept)
        lease_id = f"{lease_uuid}@{'.'.join(map(str, kept))}"
        return Lease(lease_id, request["consumer"], rows, expires_at)

    def _gather_claims(
        self, lease_uuid: str, targets: list[int], refs: list[ray.ObjectRef]
    ) -> dict[int, ClaimReply]:
        """The shards' non-empty answers; if any shard failed, undo the others and raise."""
        replies: dict[int, ClaimReply] = {}
        error: RayTaskError | None = None
        for k, ref in zip(targets, refs, strict=True):
            try:
                reply = ray.get(ref)
            except RayTaskError as err:
                error = error or err
                continue
            if reply is not None:
                replies[k] = reply
        if error is not None:
            get_all([self._shards[k].release.remote(lease_uuid) for k in replies])
            raise error.cause from error
        return replies

    def _give_back(
        self, lease_uuid: str, replies: dict[int, ClaimReply], chosen: set[str]
    ) -> tuple[list[int], list[ray.ObjectRef]]:
        """Start returning each shard's rows not in ``chosen``; returns the shards that keep
        rows and the calls to wait for."""
        kept, calls = [], []
        for k in sorted(replies):
            ids = [row["sample_id"] for row in replies[k].rows]
            keep = [s for s in ids if s in chosen]
            if keep:
                kept.append(k)
            if len(keep) < len(ids):
                calls.append(self._shards[k].keep_only.remote(lease_uuid, keep))
        return kept, calls

    def _polls_for(self, request: dict[str, Any]) -> dict[int, ray.ObjectRef]:
        """This thread's open long polls (shard -> ``wait_ready`` call) for ``request``. They
        outlive a claim: a role claims in a loop, and the next claim reuses them."""
        key = repr(sorted(request.items()))
        if getattr(self._polls, "key", None) != key:
            self._polls.key, self._polls.refs = key, {}
        return self._polls.refs

    def _unpolled(self, targets: list[int], request: dict[str, Any]) -> list[int]:
        """The targets a waiting claim should ask now: those whose poll has fired (or timed
        out) and those not being polled. A shard whose poll is still open has had nothing for
        this claim since the poll began."""
        polls = self._polls_for(request)
        if polls:
            done, _ = ray.wait(list(polls.values()), num_returns=len(polls), timeout=0)
            fired = [k for k, ref in polls.items() if ref in done]
            for k in fired:
                del polls[k]
            get_all(done)  # surface a shard's error (unknown consumer, bad sampler, ...)
        return [k for k in targets if k not in polls]

    def _wait_any(self, targets: list[int], request: dict[str, Any], timeout_s: float) -> None:
        """Long-poll every target shard (opening the polls not yet open) until one has rows
        for this claim or the time is up."""
        polls = self._polls_for(request)
        options = {name: request[name] for name in ("sampler", "where", "sampler_options")}
        for k in targets:
            if k not in polls:
                polls[k] = self._shards[k].wait_ready.remote(
                    request["consumer"],
                    request["fields"],
                    request["max_rows"],
                    timeout_s=timeout_s,
                    **options,
                )
        ray.wait(list(polls.values()), num_returns=1, timeout=timeout_s)

    # -- internals: routing and calls ---------------------------------------------------------

    def _shard_of(self, group_id: Any) -> int:
        if not isinstance(group_id, str) or self.num_shards == 1:
            return 0  # a bad group id is reported by the shard's validation
        return zlib.crc32(group_id.encode()) % self.num_shards

    def _remember(self, pairs: Any) -> None:
        """Record ``(sample_id, group_id)`` pairs seen in adds and claims, for routing."""
        if self.num_shards == 1:
            return
        with self._located_lock:
            for sample_id, group_id in pairs:
                self._located[sample_id] = self._shard_of(group_id)
            while len(self._located) > _LOCATED_KEPT:
                self._located.popitem(last=False)

    def _locate(self, sample_ids: list[str]) -> tuple[dict[int, list[str]], list[str]]:
        """Sample ids by shard, and those no shard has seen. Ids this client has not seen in
        an add or a claim are looked up on every shard (one fan-out)."""
        if self.num_shards == 1:
            return {0: sample_ids}, []
        by_shard: dict[int, list[str]] = defaultdict(list)
        missing = []
        with self._located_lock:
            for sample_id in sample_ids:
                k = self._located.get(sample_id)
                if k is None:
                    missing.append(sample_id)
                else:
                    by_shard[k].append(sample_id)
        unknown = []
        if missing:
            found = self._on_all("locate", missing)
            shard_of = {s: k for k, ids in found.items() for s in ids}
            for sample_id in missing:
                if sample_id in shard_of:
                    by_shard[shard_of[sample_id]].append(sample_id)
                else:
                    unknown.append(sample_id)
            with self._located_lock:
                self._located.update(shard_of)
        return dict(by_shard), unknown

    def _split_lease_id(self, lease_id: str) -> tuple[str, list[int]]:
        """``"<uuid>@<k>.<k>"`` -> (uuid, shard indices)."""
        self._check_open()
        lease_uuid, _, shard_part = lease_id.rpartition("@")
        parts = shard_part.split(".")
        if lease_uuid and all(p.isdigit() and int(p) < self.num_shards for p in parts):
            return lease_uuid, [int(p) for p in parts]
        raise ValueError(f"unknown lease id {lease_id!r}: never issued by this bus")

    def _store(self, values_by_key: Mapping[Any, Mapping[str, Any]]) -> dict[Any, dict[str, Any]]:
        adopt = self._keeper_adopt if self._options.payload_owner == "keeper" else None
        return store(values_by_key, inline_bytes=self._options.inline_bytes, adopt=adopt)

    def _keeper_adopt(self, ref: ray.ObjectRef) -> ray.ObjectRef:
        if self._keeper is None:
            node_id = ray.get_runtime_context().get_node_id()
            self._keeper = self._on({0: (node_id,)}, "keeper")[0]
        return get_all([self._keeper.adopt.remote([ref])])[0][0]

    def _on_all(self, method: str, *args: Any) -> dict[int, Any]:
        return self._on({k: args for k in range(self.num_shards)}, method)

    def _on(self, args_by_shard: Mapping[int, tuple], method: str) -> dict[int, Any]:
        """Call ``method`` on the given shards at once; results by shard. Raises the shards'
        own exception (ValueError, BusFullError, ...), after every call has finished."""
        self._check_open()
        refs = [getattr(self._shards[k], method).remote(*args) for k, args in args_by_shard.items()]
        return dict(zip(args_by_shard, get_all(refs), strict=True))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the bus is closed")


def _shift_slots(row: dict[str, Any], offset: int) -> dict[str, Any]:
    if not offset:
        return row
    return {
        name: WireSlot(v.ref_pos + offset, v.index) if isinstance(v, WireSlot) else v
        for name, v in row.items()
    }


def _sum_counters(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Add counters key by key; dict-valued counters (per consumer, per reason) entry by entry."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                into = out.setdefault(key, {})
                for name, count in value.items():
                    into[name] = into.get(name, 0) + count
            else:
                out[key] = out.get(key, 0) + value
    return out


__all__ = ["BusShard", "RayBus"]
