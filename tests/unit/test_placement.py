"""Placement-group bundles from the roles' config, and which replica holds which bundle (the
Ray side is checked on a two-node cluster in tests/integration/test_cluster.py)."""

from __future__ import annotations

import os

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.config.schema import RolePlacement
from streamrl.runtime.placement import (
    MIN_BUNDLE_CPUS,
    BundleSlots,
    bundle,
    local_cores,
    role_threads,
)


def test_a_bundle_is_the_replicas_resources():
    placement = RolePlacement(num_cpus=2, num_gpus=0.5, resources={"worker": 0.01})
    assert bundle(placement) == {"CPU": 2, "GPU": 0.5, "worker": 0.01}


def test_a_role_that_reserves_nothing_still_gets_a_slot():
    assert bundle(RolePlacement()) == {"CPU": MIN_BUNDLE_CPUS}


def test_restarted_replica_keeps_its_bundle_and_drained_ones_are_reused():
    slots = BundleSlots(["trainer", "rollout", "rollout#1", "reward"])
    assert slots.assign("rollout#1") == 2
    assert slots.assign("rollout#1") == 2  # restarted: the same bundle
    assert slots.assign("rollout#2") is None  # beyond the group: placed outside it
    slots.release("rollout#1")  # drained
    assert slots.assign("reward#1") is None  # a free bundle goes to its own role only
    assert slots.assign("rollout#2") == 2
    assert slots.assign("trainer") == 0


def test_placement_group_and_node_affinity_exclude_each_other():
    cfg = load_config(["runtime.ray.placement_group.strategy=SPREAD"])
    assert cfg.runtime.ray.placement_group.strategy == "SPREAD"
    assert load_config([]).runtime.ray.placement_group.strategy == "none"
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(
            ["runtime.ray.placement_group.strategy=PACK", "runtime.ray.roles.reward.node=1.2.3.4"]
        )
    with pytest.raises(ConfigError):
        load_config(["runtime.ray.placement_group.strategy=SCATTER"])


@pytest.mark.parametrize(
    ("cores", "trainer", "rollout"), [(1, 1, 1), (2, 1, 1), (3, 2, 1), (8, 4, 4), (16, 8, 8)]
)
def test_trainer_and_rollout_share_the_local_cores_by_default(cores, trainer, rollout):
    cfg = load_config([])
    assert role_threads(cfg, "trainer", cores) == (trainer, f"auto, {cores} cores")
    assert role_threads(cfg, "rollout", cores) == (rollout, f"auto, {cores} cores")
    assert role_threads(cfg, "reward", cores) == (1, "light role")


def test_ranks_and_replicas_split_their_roles_share():
    cfg = load_config(["trainer.world_size=2", "runtime.ray.roles.rollout.replicas=3"])
    assert role_threads(cfg, "trainer", 16)[0] == 4
    assert role_threads(cfg, "rollout", 16)[0] == 2
    assert role_threads(cfg, "rollout", 4)[0] == 1  # never fewer than one


def test_set_threads_then_reserved_cpus_then_one_on_an_existing_cluster():
    cfg = load_config(["trainer.threads=3", "runtime.ray.roles.rollout.num_cpus=6"])
    assert role_threads(cfg, "trainer", 16) == (3, "trainer.threads")
    assert role_threads(cfg, "rollout", 16) == (6, "runtime.ray.roles.rollout.num_cpus")
    cluster = load_config(["runtime.ray.address=10.0.0.1:6379"])
    assert role_threads(cluster, "trainer", 16) == (1, "existing cluster")


def test_the_local_instance_has_the_configured_cores_or_the_usable_ones():
    assert local_cores(load_config(["runtime.ray.num_cpus=5"])) == 5
    assert 1 <= local_cores(load_config([])) <= (os.cpu_count() or 1)
