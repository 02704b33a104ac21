"""Placement-group bundles from the roles' config, and which replica holds which bundle (the
Ray side is checked on a two-node cluster in tests/integration/test_cluster.py)."""

from __future__ import annotations

import pytest

from streamrl.config import ConfigError, load_config
from streamrl.config.schema import RolePlacement
from streamrl.runtime.placement import MIN_BUNDLE_CPUS, BundleSlots, bundle


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
    cfg = load_config(["runtime.placement_group.strategy=SPREAD"])
    assert cfg.runtime.placement_group.strategy == "SPREAD"
    assert load_config([]).runtime.placement_group.strategy == "none"
    with pytest.raises(ConfigError, match="exclude each other"):
        load_config(["runtime.placement_group.strategy=PACK", "runtime.roles.reward.node=1.2.3.4"])
    with pytest.raises(ConfigError):
        load_config(["runtime.placement_group.strategy=SCATTER"])
