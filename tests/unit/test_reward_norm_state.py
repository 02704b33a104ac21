"""The online reward normaliser's state survives a resume and a restart of the advantage role."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streamrl.api import fields as F
from streamrl.bus.local import LocalBus
from streamrl.config.schema import ShapingConfig
from streamrl.trainer.advantage import AdvantageRole, AdvantageSettings, NormaliserLog
from streamrl.trainer.algos.shaping import RewardNormaliser
from streamrl.weights.dcs import InProcessWeights

REWARDS = {  # batch -> group -> rewards; every batch has two groups
    0: {"p0": [1.0, 0.0], "p1": [1.0, 1.0]},
    1: {"p0": [3.0, 0.0], "p1": [2.0, 2.5]},
    2: {"p0": [0.0, 0.0], "p1": [5.0, 1.0]},
}


def make_bus() -> LocalBus:
    bus = LocalBus()
    bus.register_consumer("advantage")
    bus.register_consumer("check")
    return bus


def add_batch(bus: LocalBus, b: int) -> None:
    rows, fields = [], {}
    for p, rewards in REWARDS[b].items():
        for k, reward in enumerate(rewards):
            sid = f"b{b}-{p}-s{k}"
            rows.append(
                {"sample_id": sid, "group_id": f"b{b}-{p}", "group_size": 2, "batch_index": b}
            )
            fields[sid] = {
                F.REWARD: reward,
                F.RESPONSE_IDS: np.arange(3),
                F.ROLLOUT_LOGPROBS: np.full(3, -1.0, dtype=np.float32),
            }
    bus.add_rows(rows)
    bus.write(fields)


def make_role(bus: LocalBus, path, resume_step: int | None = None) -> AdvantageRole:
    return AdvantageRole(
        bus,
        InProcessWeights(),
        AdvantageSettings(shaping=ShapingConfig(reward_norm=True, reward_norm_momentum=0.5)),
        groups_per_batch=2,
        max_staleness=5,
        max_rows=64,
        lease_s=60,
        normaliser_path=path,
        resume_step=resume_step,
    )


def run(role: AdvantageRole, bus: LocalBus, batches) -> dict[str, float]:
    """Normalise `batches` in order; return the advantages written."""
    for b in batches:
        add_batch(bus, b)
        assert role.step()
    lease = bus.claim("check", [F.ADVANTAGES], 64)
    return {r["sample_id"]: r[F.ADVANTAGES] for r in lease.rows}


def after(batches) -> dict[str, float]:
    norm = RewardNormaliser(0.5)
    for b in batches:
        norm(torch.tensor([r for g in REWARDS[b].values() for r in g], dtype=torch.float64))
    return norm.state_dict()


def test_a_resumed_role_restores_the_state_before_the_checkpoints_batch(tmp_path) -> None:
    path = tmp_path / "reward_norm.json"
    bus = make_bus()
    role = make_role(bus, path)
    uninterrupted = run(role, bus, [0, 1, 2])
    assert role.normaliser.state_dict() == pytest.approx(after([0, 1, 2]))

    # Resume from the checkpoint after step 1: batches 1 and 2 are normalised again.
    bus = make_bus()
    resumed = make_role(bus, path, resume_step=1)
    assert resumed.normaliser.state_dict() == pytest.approx(after([0]))
    again = run(resumed, bus, [1, 2])
    assert resumed.normaliser.state_dict() == pytest.approx(after([0, 1, 2]))
    for sample_id, value in again.items():
        assert value == pytest.approx(uninterrupted[sample_id])


def test_a_restarted_role_carries_on_from_the_latest_state(tmp_path) -> None:
    path = tmp_path / "reward_norm.json"
    bus = make_bus()
    run(make_role(bus, path), bus, [0, 1])
    restarted = make_role(bus, path, resume_step=0)  # same bus: it has acked rows already
    assert restarted.normaliser.state_dict() == pytest.approx(after([0, 1]))


def test_a_fresh_run_ignores_an_old_state_file(tmp_path) -> None:
    path = tmp_path / "reward_norm.json"
    bus = make_bus()
    run(make_role(bus, path), bus, [0])
    fresh = make_role(make_bus(), path)
    assert fresh.normaliser.state_dict()["count"] == 0


def test_resuming_past_every_saved_batch_restores_the_latest(tmp_path) -> None:
    norm = RewardNormaliser(0.5)
    log = NormaliserLog(norm, tmp_path / "n.json", keep_batches=1)
    for b in range(4):
        log.start_batch(b)
        norm(torch.tensor([b, 2.0 * b + 1], dtype=torch.float64))
        log.save()
    assert [b for b, _ in log.before] == [2, 3]  # older snapshots are pruned
    restored = RewardNormaliser(0.5)
    NormaliserLog(restored, tmp_path / "n.json", keep_batches=1).restore(9)
    assert restored.state_dict() == norm.state_dict()


def test_a_nan_reward_leaves_the_normaliser_state_finite() -> None:
    """One NaN reward (from a broken reward function) must not poison the moving statistics,
    which are checkpointed: every later step would be skipped."""
    norm = RewardNormaliser(momentum=0.5)
    norm(torch.tensor([0.0, 1.0], dtype=torch.float64))
    out = norm(torch.tensor([1.0, float("nan"), float("inf"), 0.0], dtype=torch.float64))
    assert all(math.isfinite(v) for v in norm.state_dict().values())
    assert math.isfinite(float(out[0])) and math.isfinite(float(out[3]))
    norm(torch.tensor([float("nan")], dtype=torch.float64))  # nothing finite: no update
    assert all(math.isfinite(v) for v in norm.state_dict().values())
