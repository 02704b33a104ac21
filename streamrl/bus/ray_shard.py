"""BusShard: the Ray actor holding one shard of a ``RayBus`` (see ``streamrl.bus.ray_bus``).

Each shard is a ``ShardBus`` behind one actor. Shard 0 has two extra jobs: it coordinates adds
that span shards (validate everywhere, check the global capacity, then add, one add at a time)
and it starts and owns the per-node ``PayloadKeeper``s, so they live exactly as long as the bus.
Field values arrive inline or as ``Slot``s (``streamrl.bus.payload``); claims send ``Slot``s out
as ``WireSlot``s plus one list of unique refs.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from streamrl.api.bus import BusFullError
from streamrl.bus import samplers
from streamrl.bus.payload import PayloadKeeper, PayloadOwner, to_wire
from streamrl.bus.shard import ShardBus


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
    ) -> None:
        self._index = index
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

    # -- topology (shard 0) ------------------------------------------------------------------

    def connect(self, shards: list[ray.actor.ActorHandle], options: BusOptions) -> None:
        self._shards = shards
        self._options = options

    def topology(self) -> tuple[list[ray.actor.ActorHandle], BusOptions]:
        return self._shards, self._options

    def keeper(self, node_id: str) -> ray.actor.ActorHandle:
        """The ``PayloadKeeper`` of node ``node_id``, started on first use. This actor owns it,
        so it lives exactly as long as the bus."""
        with self._keepers_lock:
            if node_id not in self._keepers:
                strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
                self._keepers[node_id] = _RemoteKeeper.options(
                    num_cpus=0, scheduling_strategy=strategy
                ).remote()
            return self._keepers[node_id]

    # -- rows --------------------------------------------------------------------------------

    def register_consumer(self, name: str) -> None:
        self._bus.register_consumer(name)

    def add_rows(self, rows: list[dict[str, Any]], summaries: dict[str, Any]) -> None:
        self._bus.add_rows(rows, summaries=summaries)

    def plan_add(self, rows: list[dict[str, Any]], other_ids: list[str]) -> tuple:
        return self._bus.plan_add(rows, other_ids)

    def add_rows_at(
        self,
        rows: list[dict[str, Any]],
        seqs: dict[str, int],
        summaries: dict[str, Any],
        num_skipped: int,
    ) -> None:
        self._bus.add_rows_at(rows, seqs, summaries, num_skipped)

    def add_rows_sharded(
        self,
        rows_by_shard: dict[int, list[tuple[int, dict[str, Any]]]],
        summaries_by_shard: dict[int, dict[str, Any]],
    ) -> None:
        """Shard 0: add rows that belong to several shards, all or nothing. ``rows_by_shard``
        holds (position in the caller's list, row) pairs; the position orders creation."""
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
            if cap is not None and num_live + num_new > cap:
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

    def can_add(self, num_groups: int, wait_s: float = 0.0) -> bool:
        return self._bus.can_add(num_groups, wait_s)

    def num_groups_live(self) -> int:
        return self._bus.num_groups_live()

    def write(self, updates: dict[str, dict[str, Any]], summaries: dict[str, Any]) -> None:
        self._bus.write(updates, summaries=summaries)

    def drop(self, sample_ids: list[str], reason: str) -> None:
        self._bus.drop(sample_ids, reason)

    def locate(self, sample_ids: list[str]) -> list[str]:
        return self._bus.locate(sample_ids)

    # -- leases ------------------------------------------------------------------------------

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

    def keep_only(self, lease_id: str, sample_ids: list[str]) -> None:
        self._bus.keep_only(lease_id, sample_ids)

    def wait_ready(self, consumer: str, fields: list[str], max_rows: int, **kwargs: Any) -> bool:
        return self._bus.wait_ready(consumer, fields, max_rows, **kwargs)

    def ack(
        self,
        lease_id: str,
        sample_ids: list[str] | None,
        writes: dict[str, dict[str, Any]] | None = None,
        summaries: dict[str, Any] | None = None,
    ) -> None:
        self._bus.ack(lease_id, sample_ids, writes=writes, summaries=summaries)

    def release(self, lease_id: str) -> None:
        self._bus.release(lease_id)

    def renew(self, lease_id: str, lease_s: float | None) -> None:
        self._bus.renew(lease_id, lease_s)

    def release_consumer(self, consumer: str) -> list[str]:
        return self._bus.release_consumer_ids(consumer)

    # -- reporting, checkpoints, shutdown ------------------------------------------------------

    def ping(self) -> int:
        """This shard's pid (the supervisor's health check)."""
        return os.getpid()

    def stats(self) -> tuple[dict[str, Any], list[str]]:
        return self._bus.stats(), self._bus.lease_ids()

    def state_dict(self) -> dict[str, Any]:
        return self._bus.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bus.load_state_dict(state)

    def close(self) -> None:
        self._bus.close()
        with self._keepers_lock:
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
