"""BusShard: the Ray actor holding one shard of a ``RayBus`` (see ``streamrl.bus.ray_bus``).

Each shard is a ``ShardBus`` behind one actor. Shard 0 has two extra jobs: it coordinates adds
that span shards (validate everywhere, check the global capacity, then add, one add at a time)
and it starts and owns the per-node ``PayloadKeeper``s, so they live exactly as long as the bus.
Field values arrive inline or as ``Slot``s (``streamrl.bus.payload``); claims send ``Slot``s out
as ``WireSlot``s plus one list of unique refs.

A bus created ``restartable`` has shards Ray restarts under the same handle when their process
dies, retrying the calls that were in flight. The new process is empty: it answers ``ping`` at
once (so the supervisor sees the new pid) and holds every other call until ``restore`` gives it
back the bus's consumers, topology and freed ids (``runtime/recovery.py`` rebuilds its rows).
Its keepers are then named, detached actors, so the payloads they own outlive shard 0's process.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from streamrl.api.bus import BusFullError
from streamrl.bus import samplers
from streamrl.bus.payload import PayloadKeeper, PayloadOwner, to_wire
from streamrl.bus.shard import ShardBus

RESTORE_WAIT_S = 300.0  # how long a restarted shard holds calls for its `restore`


def _after_restore(method: Callable) -> Callable:
    """A call to a restarted shard waits until it is restored (its rows are being rebuilt)."""

    @functools.wraps(method)
    def wrapper(self: BusShard, *args: Any, **kwargs: Any) -> Any:
        if not self._restored.is_set() and not self._restored.wait(RESTORE_WAIT_S):
            raise RuntimeError(
                f"bus shard {self._index} restarted after its process was lost and was not "
                f"restored within {RESTORE_WAIT_S:.0f}s: its rows are gone"
            )
        return method(self, *args, **kwargs)

    return wrapper


@dataclass(frozen=True, slots=True)
class BusOptions:
    """What every client of a bus needs besides the shard handles (shard 0 keeps a copy for
    clients that attach with ``RayBus.from_handle``)."""

    capacity_groups: int | None
    inline_bytes: int
    payload_owner: PayloadOwner


@dataclass(slots=True)
class ClaimReply:
    """One shard's part of a claim: leased rows (values inline or ``WireSlot``s into ``refs``),
    the sampler's view of each row (only when merging) and the shard's clock."""

    rows: list[dict[str, Any]]
    refs: list[ray.ObjectRef]
    views: list[samplers.RowView] | None
    expires_at: float
    shard_now: float


class BusShard:
    """Ray actor holding one shard; each method is one call from a ``RayBus`` client, or, for
    ``plan_add`` and ``add_rows_at``, from shard 0. Shard 0 also coordinates sharded adds and
    owns the per-node ``PayloadKeeper``s."""

    def __init__(
        self,
        index: int,
        num_shards: int,
        capacity_groups: int | None,
        closed_leases_kept: int,
        bus_id: str = "",
    ) -> None:
        self._index = index
        self._bus_id = bus_id  # set for a restartable bus: names its keepers
        self._num_shards = num_shards
        self._capacity_groups = capacity_groups
        # One shard enforces the capacity itself; with several, shard 0 checks it across all.
        own_capacity = capacity_groups if num_shards == 1 else None
        self._bus = ShardBus(capacity_groups=own_capacity, closed_leases_kept=closed_leases_kept)
        self._shards: list[ray.actor.ActorHandle] = []
        self._options: BusOptions | None = None
        self._admission = threading.Lock()
        self._next_seq = 0
        self._keepers: dict[str, ray.actor.ActorHandle] = {}
        self._keepers_lock = threading.Lock()
        self._restored = threading.Event()  # a restarted shard holds calls until `restore`
        if not ray.get_runtime_context().was_current_actor_reconstructed:
            self._restored.set()

    # -- after a restart -----------------------------------------------------------------------

    def restore(
        self,
        shards: list[ray.actor.ActorHandle],
        options: BusOptions,
        consumers: Sequence[str],
        freed: Sequence[str],
        next_seq: int,
    ) -> None:
        """Come back after the process was lost: the topology, the consumers, the ids a
        checkpoint says were consumed, and creation numbers from ``next_seq`` on (also shard
        0's, for the adds it coordinates). Then the held calls go through."""
        self.connect(shards, options)
        self._bus.restore(consumers, freed, next_seq)
        self._next_seq = max(self._next_seq, next_seq)
        self._restored.set()

    def next_seq(self) -> int:
        """The creation number this shard would give next (shard 0 also counts its adds)."""
        return max(self._bus.next_seq(), self._next_seq)

    # -- topology (shard 0) ------------------------------------------------------------------

    def connect(self, shards: list[ray.actor.ActorHandle], options: BusOptions) -> None:
        self._shards = shards
        self._options = options

    @_after_restore
    def topology(self) -> tuple[list[ray.actor.ActorHandle], BusOptions]:
        return self._shards, self._options

    @_after_restore
    def keeper(self, node_id: str) -> ray.actor.ActorHandle:
        """The ``PayloadKeeper`` of node ``node_id``, started on first use and stopped by
        ``close``, so it lives exactly as long as the bus. This actor owns it, unless the bus
        is restartable: then it is a named, detached actor a restarted shard 0 finds again."""
        with self._keepers_lock:
            if node_id not in self._keepers:
                strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
                named = {}
                if self._bus_id:
                    name = self._keeper_name(node_id)
                    named = {"name": name, "get_if_exists": True, "lifetime": "detached"}
                self._keepers[node_id] = _RemoteKeeper.options(
                    num_cpus=0, scheduling_strategy=strategy, **named
                ).remote()
            return self._keepers[node_id]

    def _keeper_name(self, node_id: str) -> str:
        return f"streamrl-keeper-{self._bus_id}-{node_id}"

    # -- rows --------------------------------------------------------------------------------

    @_after_restore
    def register_consumer(self, name: str) -> None:
        self._bus.register_consumer(name)

    @_after_restore
    def add_rows(self, rows: list[dict[str, Any]], summaries: dict[str, Any]) -> None:
        self._bus.add_rows(rows, summaries=summaries)

    @_after_restore
    def plan_add(self, rows: list[dict[str, Any]], other_ids: list[str]) -> tuple:
        return self._bus.plan_add(rows, other_ids)

    @_after_restore
    def add_rows_at(
        self,
        rows: list[dict[str, Any]],
        seqs: dict[str, int],
        summaries: dict[str, Any],
        num_skipped: int,
    ) -> None:
        self._bus.add_rows_at(rows, seqs, summaries, num_skipped)

    @_after_restore
    def add_rows_sharded(
        self,
        rows_by_shard: dict[int, list[tuple[int, dict[str, Any]]]],
        summaries_by_shard: dict[int, dict[str, Any]],
        check_capacity: bool = True,
    ) -> None:
        """Shard 0: add rows that belong to several shards, all or nothing. ``rows_by_shard``
        holds (position in the caller's list, row) pairs; the position orders creation.
        ``check_capacity=False``: rows that were live before their shard was lost."""
        all_ids = [row.get("sample_id") for rows in rows_by_shard.values() for _, row in rows]
        metas = {
            k: ([_meta(row) for _, row in rows_by_shard.get(k, [])], all_ids)
            for k in range(self._num_shards)
        }
        with self._admission:  # one add at a time, so the capacity check below stays true
            plans = self._on_shards("plan_add", metas)  # validates; changes nothing
            skipped = _added_elsewhere(rows_by_shard, plans)
            num_new = sum(num for num, _, _ in plans.values())
            num_live = sum(live for _, live, _ in plans.values())
            cap = self._capacity_groups
            if check_capacity and cap is not None and num_live + num_new > cap:
                raise BusFullError(
                    f"adding {num_new} groups would exceed capacity_groups={cap} "
                    f"({num_live} live); wait for rows to be consumed (can_add) and retry"
                )
            base = self._next_seq
            self._next_seq += len(all_ids)
            adds = {}
            for k, rows in rows_by_shard.items():
                kept = [(pos, row) for pos, row in rows if row["sample_id"] not in skipped]
                seqs = {row["sample_id"]: base + pos for pos, row in kept}
                summaries = summaries_by_shard.get(k, {})
                adds[k] = ([row for _, row in kept], seqs, summaries, len(rows) - len(kept))
            self._on_shards("add_rows_at", adds)

    @_after_restore
    def can_add(self, num_groups: int, wait_s: float = 0.0) -> bool:
        return self._bus.can_add(num_groups, wait_s)

    @_after_restore
    def num_groups_live(self) -> int:
        return self._bus.num_groups_live()

    @_after_restore
    def write(self, updates: dict[str, dict[str, Any]], summaries: dict[str, Any]) -> None:
        self._bus.write(updates, summaries=summaries)

    @_after_restore
    def drop(self, sample_ids: list[str], reason: str) -> None:
        self._bus.drop(sample_ids, reason)

    @_after_restore
    def locate(self, sample_ids: list[str]) -> list[str]:
        return self._bus.locate(sample_ids)

    # -- leases ------------------------------------------------------------------------------

    @_after_restore
    def claim(
        self,
        lease_id: str,
        consumer: str,
        fields: list[str],
        max_rows: int,
        *,
        with_views: bool,
        **claim_kwargs: Any,
    ) -> ClaimReply | None:
        found = self._bus.claim_as(lease_id, consumer, fields, max_rows, **claim_kwargs)
        if found is None:
            return None
        lease, views = found
        refs = to_wire(lease.rows)
        return ClaimReply(
            lease.rows, refs, views if with_views else None, lease.expires_at, time.monotonic()
        )

    @_after_restore
    def keep_only(self, lease_id: str, sample_ids: list[str]) -> None:
        self._bus.keep_only(lease_id, sample_ids)

    @_after_restore
    def wait_ready(self, consumer: str, fields: list[str], max_rows: int, **kwargs: Any) -> bool:
        return self._bus.wait_ready(consumer, fields, max_rows, **kwargs)

    @_after_restore
    def ack(
        self,
        lease_id: str,
        sample_ids: list[str] | None,
        writes: dict[str, dict[str, Any]] | None = None,
        summaries: dict[str, Any] | None = None,
    ) -> None:
        self._bus.ack(lease_id, sample_ids, writes=writes, summaries=summaries)

    @_after_restore
    def release(self, lease_id: str) -> None:
        self._bus.release(lease_id)

    @_after_restore
    def renew(self, lease_id: str, lease_s: float | None) -> None:
        self._bus.renew(lease_id, lease_s)

    @_after_restore
    def release_consumer(self, consumer: str) -> list[str]:
        return self._bus.release_consumer_ids(consumer)

    # -- reporting, checkpoints, shutdown ------------------------------------------------------

    def ping(self) -> int:
        """This shard's pid (the supervisor's health check)."""
        return os.getpid()

    @_after_restore
    def stats(self) -> tuple[dict[str, Any], list[str]]:
        return self._bus.stats(), self._bus.lease_ids()

    @_after_restore
    def state_dict(self) -> dict[str, Any]:
        return self._bus.state_dict()

    @_after_restore
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bus.load_state_dict(state)

    def close(self) -> None:
        self._bus.close()
        with self._keepers_lock:
            if self._bus_id:  # also those a lost predecessor started
                for node in ray.nodes():
                    try:
                        self._keepers[node["NodeID"]] = ray.get_actor(
                            self._keeper_name(node["NodeID"])
                        )
                    except ValueError:
                        pass
            for keeper in self._keepers.values():
                ray.kill(keeper)
            self._keepers.clear()

    def _on_shards(self, method: str, args_by_shard: Mapping[int, tuple]) -> dict[int, Any]:
        """Call ``method`` on several shards at once (this one directly); results by shard."""
        remote = {
            k: getattr(self._shards[k], method).remote(*args)
            for k, args in args_by_shard.items()
            if k != self._index
        }
        out = {}
        if self._index in args_by_shard:
            out[self._index] = getattr(self, method)(*args_by_shard[self._index])
        out.update(zip(remote, get_all(list(remote.values())), strict=True))
        return out


# Threaded: a claim waiting for rows (wait_s) must not block the writes that would satisfy it.
RemoteBusShard = ray.remote(max_concurrency=64)(BusShard)
_RemoteKeeper = ray.remote(max_concurrency=16)(PayloadKeeper)


def _added_elsewhere(
    rows_by_shard: dict[int, list[tuple[int, dict[str, Any]]]],
    plans: dict[int, tuple[int, int, dict[str, tuple[str, int] | None]]],
) -> set[str]:
    """Sample ids of an add that another shard already has. A freed one is a retried add
    (skipped, as on one shard); a live one means the row was re-added with another group."""
    skipped = set()
    for k, rows in rows_by_shard.items():
        for _, row in rows:
            for other, (_, _, seen) in plans.items():
                if other == k or row["sample_id"] not in seen:
                    continue
                old = seen[row["sample_id"]]
                new = (row["group_id"], row.get("batch_index", 0))
                if old is None:
                    skipped.add(row["sample_id"])
                elif old != new:
                    raise ValueError(
                        f"sample {row['sample_id']!r} re-added with (group_id, batch_index)="
                        f"{new}, but it exists with {old}"
                    )
    return skipped


def _meta(row: dict[str, Any]) -> dict[str, Any]:
    """A row without its field values (what validation needs)."""
    return {key: value for key, value in row.items() if key != "fields"}


def get_all(refs: list[ray.ObjectRef]) -> list[Any]:
    """``ray.get`` each ref; once all are done, raise the first failure as the exception the
    actor raised (not Ray's wrapper)."""
    results, error = [], None
    for ref in refs:
        try:
            results.append(ray.get(ref))
        except RayTaskError as err:
            error = error or err
            results.append(None)
    if error is not None:
        raise error.cause from error
    return results
