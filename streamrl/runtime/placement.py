"""Where role actors run: Ray actor options from `runtime.ray.roles.<role>`, optionally inside one
placement group (`runtime.ray.placement_group.strategy`).

Without a placement group each replica is an ordinary actor with its role's resources (CPUs,
GPUs, custom resources) and, with `node`, hard node affinity. With one, the driver reserves a
bundle per replica that exists at the start, all at once, with Ray's strategy (PACK, SPREAD,
STRICT_PACK, STRICT_SPREAD), and schedules each replica into its own bundle:

- a bundle is its replica's resources (`num_cpus`, `num_gpus`, `resources`); a role that reserves
  nothing gets 0.01 CPU, since Ray refuses empty bundles;
- a restarted replica goes back into its bundle (same resources, and the node the group chose);
- a replica added later by `streamrl scale` takes a bundle a drained replica of its role left
  free, else runs outside the group with its role's ordinary options (a placement group cannot
  grow); `roles.json` shows which (`placement_group` is None outside);
- node affinity and a placement group exclude each other (the config refuses both); custom
  resources in a bundle are how to steer a bundle to a node.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

log = logging.getLogger(__name__)

MIN_BUNDLE_CPUS = 0.01
# torch threads of a role process other than the trainer's and the rollout's: their work is small.
LIGHT_ROLE_THREADS = 1


def role_placement(roles_config, role: str):
    """`runtime.ray.roles.<role>`; a role a plugin added, which has no section there, is placed as
    a role that reserves nothing (one replica)."""
    from streamrl.config.schema import RolePlacement

    return getattr(roles_config, role, None) or RolePlacement()


def local_cores(cfg) -> int:
    """Cores of the local Ray instance this run starts: `runtime.ray.num_cpus`, else the cores this
    process may run on."""
    if cfg.runtime.ray.num_cpus:
        return cfg.runtime.ray.num_cpus
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def role_threads(cfg, role: str, cores: int) -> tuple[int, str]:
    """torch threads of one process of `role` in ray mode, and where the number came from.

    `trainer.threads` / `rollout.threads` when set; else the CPUs the role reserves
    (`runtime.ray.roles.<role>.num_cpus`, whole ones); else, on a local instance of `cores` cores,
    the trainer half of them (rounded up) and the rollout the rest, split over the trainer's
    ranks and the rollout's replicas; on an existing cluster, whose nodes' cores this process
    cannot see, one. The light roles always get one."""
    explicit = {"trainer": cfg.trainer.threads, "rollout": cfg.rollout.threads}
    if role not in explicit:
        return LIGHT_ROLE_THREADS, "light role"
    if explicit[role] is not None:
        return explicit[role], f"{role}.threads"
    placement = role_placement(cfg.runtime.ray.roles, role)
    if placement.num_cpus >= 1:
        return int(placement.num_cpus), f"runtime.ray.roles.{role}.num_cpus"
    if cfg.runtime.ray.address is not None:
        return 1, "existing cluster"
    trainer_share = (cores + 1) // 2
    if role == "trainer":
        share, processes = trainer_share, cfg.trainer.world_size
    else:
        share, processes = max(cores - trainer_share, 1), placement.replicas
    return max(share // processes, 1), f"auto, {cores} cores"


def placement_options(placement) -> dict[str, Any]:
    """Ray actor options for a role's `runtime.ray.roles.<role>` entry, outside a placement group."""
    options: dict[str, Any] = {
        "num_cpus": placement.num_cpus,
        "num_gpus": placement.num_gpus,
        "resources": dict(placement.resources),
    }
    if placement.node:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            node_id=node_id(placement.node), soft=False
        )
    return options


def node_id(node: str) -> str:
    """The id of the live Ray node with this id or IP address."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    for n in alive:
        if node in (n["NodeID"], n["NodeManagerAddress"]):
            return n["NodeID"]
    known = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in alive)
    raise ValueError(f"runtime.ray.roles: no live Ray node {node!r}; nodes: {known}")


def bundle(placement) -> dict[str, float]:
    """A replica's bundle: its resources, at least `MIN_BUNDLE_CPUS` CPU."""
    out = {"CPU": max(placement.num_cpus, MIN_BUNDLE_CPUS)}
    if placement.num_gpus:
        out["GPU"] = placement.num_gpus
    out.update(placement.resources)
    return out


class BundleSlots:
    """Which replica holds which bundle; a freed bundle goes to the next replica of its role."""

    def __init__(self, names: list[str]) -> None:
        self.holder: dict[int, str | None] = dict(enumerate(names))
        self.role_of = {i: _base_role(name) for i, name in enumerate(names)}

    def assign(self, name: str) -> int | None:
        """The bundle of `name`: its own, else a free one of its role, else None."""
        for index, holder in self.holder.items():
            if holder == name:
                return index
        for index, holder in self.holder.items():
            if holder is None and self.role_of[index] == _base_role(name):
                self.holder[index] = name
                return index
        return None

    def release(self, name: str) -> None:
        for index, holder in self.holder.items():
            if holder == name:
                self.holder[index] = None


class RolePlacementGroup:
    """One placement group for the replicas a run starts with (see the module docstring)."""

    def __init__(self, names: list[str], roles_config, strategy: str, timeout_s: float) -> None:
        from ray.util.placement_group import placement_group

        self.roles_config = roles_config
        self.slots = BundleSlots(names)
        bundles = [bundle(role_placement(roles_config, _base_role(n))) for n in names]
        self.group = placement_group(bundles, strategy=strategy, name="streamrl-roles")
        try:
            ray.get(self.group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.group)
            asked = ", ".join(f"{n}: {b}" for n, b in zip(names, bundles, strict=True))
            raise RuntimeError(
                f"the cluster could not reserve a {strategy} placement group within "
                f"{timeout_s:g}s (runtime.ray.placement_group.timeout_s). Bundles: {asked}. Cluster "
                f"resources: {ray.cluster_resources()}. Lower the roles' resources, add nodes, "
                "or pick a looser strategy (PACK or SPREAD)."
            ) from None
        log.info("placement group %s ready: %s", strategy, dict(zip(names, bundles, strict=True)))

    def options(self, name: str) -> dict[str, Any]:
        """Actor options for `name`: its bundle's resources, in its bundle, or (a replica beyond
        the group) its role's ordinary options."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        placement = role_placement(self.roles_config, _base_role(name))
        index = self.slots.assign(name)
        if index is None:
            log.info("%s: no free bundle in the placement group; placed outside it", name)
            return placement_options(placement)
        return {
            "num_cpus": max(placement.num_cpus, MIN_BUNDLE_CPUS),
            "num_gpus": placement.num_gpus,
            "resources": dict(placement.resources),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=index
            ),
        }

    def release(self, name: str) -> None:
        """`name` was removed (drained): its bundle is free for its role's next replica."""
        self.slots.release(name)

    def remove(self) -> None:
        ray.util.remove_placement_group(self.group)


def _base_role(name: str) -> str:
    return name.split("#", 1)[0]
