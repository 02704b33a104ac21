"""The advantage role's shaping and estimators on bus rows, and its whole-batch waiting."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.api import fields as F
from streamrl.bus.local import LocalBus
from streamrl.config.schema import AdvantageConfig, KLConfig, ShapingConfig
from streamrl.trainer.advantage import AdvantageRole, AdvantageSettings, advantage_fields
from streamrl.weights.dcs import InProcessWeights


def rows_for(
    groups: dict[str, list[float | None]], lengths=None, batch_index: int = 0
) -> list[dict]:
    out = []
    for g, rewards in groups.items():
        for k, reward in enumerate(rewards):
            n = lengths[len(out)] if lengths else 3
            out.append(
                {
                    "sample_id": f"{g}-s{k}",
                    "group_id": g,
                    "batch_index": batch_index,
                    F.REWARD: reward,
                    F.RESPONSE_IDS: np.arange(n),
                    F.ROLLOUT_LOGPROBS: np.full(n, -1.0, dtype=np.float32),
                    F.REF_LOGPROBS: np.full(n, -1.5, dtype=np.float32),
                    F.VALUES: np.zeros(n, dtype=np.float32),
                }
            )
    return out


def adv(updates, sample_id):
    return updates[sample_id][F.ADVANTAGES]


def test_unscored_samples_get_zero_and_stay_out_of_the_baseline() -> None:
    out = advantage_fields(
        rows_for({"g": [1.0, None, 0.0]}),
        AdvantageSettings(advantage=AdvantageConfig(estimator="rloo")),
    )
    assert adv(out, "g-s1") == 0.0
    assert adv(out, "g-s0") == pytest.approx(1.0) and adv(out, "g-s2") == pytest.approx(-1.0)


def test_dynamic_sampling_drops_groups_without_signal() -> None:
    settings = AdvantageSettings(dynamic_sampling=True)
    out = advantage_fields(rows_for({"a": [1.0, 1.0], "b": [1.0, 0.0]}), settings)
    assert adv(out, "a-s0") is None and adv(out, "a-s1") is None
    assert adv(out, "b-s0") > 0 > adv(out, "b-s1")


def test_overlong_penalty_breaks_a_tie() -> None:
    settings = AdvantageSettings(
        advantage=AdvantageConfig(scale="none"),
        shaping=ShapingConfig(overlong_cache=4),
        max_new_tokens=8,
    )
    out = advantage_fields(rows_for({"g": [1.0, 1.0]}, lengths=[2, 8]), settings)
    assert adv(out, "g-s0") == pytest.approx(0.5) and adv(out, "g-s1") == pytest.approx(-0.5)


def test_kl_in_the_reward_is_summed_over_tokens() -> None:
    # k1 per token = -1 - (-1.5) = 0.5; lengths 2 and 4 -> penalties 0.1 * 1.0 and 0.1 * 2.0
    settings = AdvantageSettings(
        advantage=AdvantageConfig(estimator="rloo"),
        kl=KLConfig(coef=0.1, estimator="k1", in_reward=True),
    )
    out = advantage_fields(rows_for({"g": [1.0, 1.0]}, lengths=[2, 4]), settings)
    assert adv(out, "g-s0") == pytest.approx(0.1) and adv(out, "g-s1") == pytest.approx(-0.1)


def test_token_level_estimators_write_one_advantage_per_token() -> None:
    rows = rows_for({"g": [1.0, 0.0]}, lengths=[2, 3])
    out = advantage_fields(
        rows, AdvantageSettings(advantage=AdvantageConfig(estimator="reinforce_pp"))
    )
    assert [len(adv(out, r["sample_id"])) for r in rows] == [2, 3]
    out = advantage_fields(
        rows, AdvantageSettings(advantage=AdvantageConfig(estimator="gae", lam=1.0))
    )
    assert [len(out[r["sample_id"]][F.RETURNS]) for r in rows] == [2, 3]
    np.testing.assert_allclose(out["g-s0"][F.RETURNS], [1.0, 1.0])  # values 0, gamma 1
    np.testing.assert_allclose(out["g-s1"][F.RETURNS], [0.0, 0.0, 0.0])


def test_gae_writes_returns_for_every_row_so_the_critic_can_ack_them() -> None:
    rows = rows_for({"g": [1.0, None, 0.0]})
    out = advantage_fields(rows, AdvantageSettings(advantage=AdvantageConfig(estimator="gae")))
    assert all(F.RETURNS in out[r["sample_id"]] for r in rows)
    assert out["g-s1"][F.RETURNS] is None


def make_bus() -> LocalBus:
    bus = LocalBus(capacity_groups=16)
    bus.register_consumer("advantage")
    bus.register_consumer("check")  # reads the advantages back
    return bus


def add_scored(bus: LocalBus, groups: dict, batch_index: int) -> None:
    rows = rows_for(groups, batch_index=batch_index)
    bus.add_rows(
        [
            {
                "sample_id": r["sample_id"],
                "group_id": r["group_id"],
                "group_size": len(groups[r["group_id"]]),
                "batch_index": batch_index,
                "fields": {},
            }
            for r in rows
        ]
    )
    bus.write(
        {
            r["sample_id"]: {
                k: v for k, v in r.items() if k not in ("sample_id", "group_id", "batch_index")
            }
            for r in rows
        }
    )


def make_role(bus: LocalBus, settings: AdvantageSettings) -> AdvantageRole:
    return AdvantageRole(
        bus,
        InProcessWeights(),
        settings,
        groups_per_batch=2,
        max_staleness=1,
        max_rows=64,
        lease_s=60,
    )


def test_batch_statistics_wait_for_the_whole_batch() -> None:
    """Batch 1 completes before batch 0, in a lease that also holds part of batch 0."""
    bus = make_bus()
    role = make_role(bus, AdvantageSettings(advantage=AdvantageConfig(scale="batch")))
    add_scored(bus, {"b0-p0": [1.0, 0.0]}, batch_index=0)
    add_scored(bus, {"b1-p0": [0.0, 1.0], "b1-p1": [1.0, 1.0]}, batch_index=1)
    assert role.step()
    done = bus.claim("check", [F.ADVANTAGES], 64)
    assert sorted({r["batch_index"] for r in done.rows}) == [1]  # batch 0 is not complete yet
    values = {r["sample_id"]: r[F.ADVANTAGES] for r in done.rows}
    # batch 1 rewards [0, 1, 1, 1]: unbiased std 0.5
    assert values["b1-p0-s1"] == pytest.approx(0.5 / (0.5 + 1e-4))
    assert values["b1-p1-s0"] == 0.0

    add_scored(bus, {"b0-p1": [1.0, 1.0]}, batch_index=0)
    while role.step():
        pass
    done = bus.claim("check", [F.ADVANTAGES], 64)
    values = {r["sample_id"]: r[F.ADVANTAGES] for r in done.rows}
    assert sorted(values) == ["b0-p0-s0", "b0-p0-s1", "b0-p1-s0", "b0-p1-s1"]
    assert values["b0-p0-s0"] == pytest.approx(0.5 / (0.5 + 1e-4))
    assert bus.stats()["acked"]["advantage"] == 8


def test_group_statistics_do_not_wait() -> None:
    bus = make_bus()
    role = make_role(bus, AdvantageSettings())
    add_scored(bus, {"b0-p0": [1.0, 0.0]}, batch_index=0)
    assert role.step()
    assert bus.claim("check", [F.ADVANTAGES], 64) is not None


def test_critic_state_round_trips(tmp_path) -> None:
    from streamrl.critic.service import Critic, load_value_model
    from streamrl.models.tiny import build_tiny_model_dir

    model_dir = build_tiny_model_dir(
        tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, seed=0
    )
    rows = [
        {
            "sample_id": f"s{i}",
            F.PROMPT_IDS: [5, 6, 7],
            F.RESPONSE_IDS: [8, 9][: i + 1],
            F.VALUES: np.zeros(i + 1, dtype=np.float32),
            F.RETURNS: np.ones(i + 1, dtype=np.float32),
        }
        for i in range(2)
    ]

    def make() -> Critic:
        return Critic(
            load_value_model(model_dir), pad_token_id=0, lr=1e-2, value_clip=None, grad_clip=None
        )

    critic = make()
    assert all(float(np.abs(v[F.VALUES]).max()) == 0.0 for v in critic.values(rows).values())
    critic.accumulate(rows)
    loss = critic.step()["critic/value_loss"]
    assert loss == pytest.approx(0.5)  # values start at 0, returns are 1: 0.5 * 1^2 per token
    critic.save(tmp_path / "critic.pt", next_batch=1, ahead=[3])
    restored = make()
    assert restored.load(tmp_path / "critic.pt") == {"next_batch": 1, "ahead": [3]}
    assert restored.steps == 1
    for key, value in critic.values(rows).items():
        np.testing.assert_array_equal(restored.values(rows)[key][F.VALUES], value[F.VALUES])
