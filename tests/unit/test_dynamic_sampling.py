"""Dynamic sampling with refill: the step's group selection, the feeder's refill batches, the
trainer role adding refill rounds over a real bus, and whole-batch collection per round."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamrl.api import fields as F
from streamrl.bus.batches import BatchCollector
from streamrl.bus.local import LocalBus
from streamrl.data.dataset import PromptRow
from streamrl.data.feeder import PromptFeeder, group_id, group_round
from streamrl.models.tokenizer import build_tokenizer
from streamrl.trainer.dynamic_sampling import DROP, SURPLUS, TRAIN, StepGroups
from streamrl.trainer.service import BatchTrainer, TrainerRole
from streamrl.weights.dcs import InProcessWeights

# -- the selection ------------------------------------------------------------------------------


def canonical(informative: list[bool], target: int) -> dict[str, str]:
    """What a step trains: the first `target` informative groups in rank order."""
    out, taken = {}, 0
    for i, inf in enumerate(informative):
        if not inf:
            out[f"g{i}"] = DROP
        elif taken < target:
            out[f"g{i}"], taken = TRAIN, taken + 1
        else:
            out[f"g{i}"] = SURPLUS
    return out


def test_groups_train_once_their_rank_is_certain() -> None:
    plan = StepGroups(target=2, max_rounds=1)
    plan.add_round(["g0", "g1", "g2"])
    plan.record("g2", True)
    assert plan.decide() == {}  # g0 and g1 could both have signal: g2 may be surplus
    plan.record("g0", False)
    assert plan.decide() == {"g0": DROP, "g2": TRAIN}  # at most g1 ranks before it
    assert not plan.complete
    plan.record("g1", True)
    assert plan.decide() == {"g1": TRAIN}
    assert plan.complete and not plan.wants_round


def test_surplus_groups_are_not_trained() -> None:
    plan = StepGroups(target=1, max_rounds=3)
    plan.add_round(["g0", "g1"])
    plan.record("g1", True)
    plan.record("g0", True)
    assert plan.decide() == {"g0": TRAIN, "g1": SURPLUS}
    assert plan.complete
    assert plan.metrics(1)["dynamic_sampling/groups_surplus"] == 1


def test_a_round_is_added_as_soon_as_it_is_certainly_needed() -> None:
    plan = StepGroups(target=2, max_rounds=4)
    plan.add_round(["g0", "g1"])
    assert not plan.wants_round  # both could have signal
    plan.record("g1", False)
    assert plan.wants_round  # at most one can: refill before g0 is even in
    plan.add_round(["r1-g0", "r1-g1"])
    plan.record("g0", True)
    plan.record("r1-g0", True)
    plan.record("r1-g1", True)
    assert plan.decide() == {"g1": DROP, "g0": TRAIN, "r1-g0": TRAIN, "r1-g1": SURPLUS}
    assert plan.complete
    m = plan.metrics(1)
    assert m["dynamic_sampling/batches_per_step"] == 2
    assert m["dynamic_sampling/groups_trained"] == 2
    assert m["dynamic_sampling/groups_dropped"] == 1
    assert m["dynamic_sampling/cap_hit"] == 0.0


def test_at_the_cap_the_step_trains_what_it_has(caplog) -> None:
    plan = StepGroups(target=2, max_rounds=2)
    for r in range(2):
        plan.add_round([f"r{r}-g0", f"r{r}-g1"])
        plan.record(f"r{r}-g0", r == 1)
        plan.record(f"r{r}-g1", False)
    assert plan.complete and not plan.wants_round
    assert plan.decide()["r1-g0"] == TRAIN
    m = plan.metrics(7)
    assert m["dynamic_sampling/cap_hit"] == 1.0 and m["dynamic_sampling/groups_trained"] == 1
    assert "step 7: only 1 of 2 groups had signal" in caplog.text


@given(
    informative=st.lists(st.booleans(), min_size=1, max_size=12),
    target=st.integers(1, 6),
    order=st.randoms(use_true_random=False),
)
def test_verdicts_do_not_depend_on_arrival_order(informative, target, order) -> None:
    """Whatever order groups arrive in, every verdict is final when given and the step trains
    exactly the first `target` informative groups."""
    gids = [f"g{i}" for i in range(len(informative))]
    plan = StepGroups(target=target, max_rounds=1)
    plan.add_round(gids)
    arrival = list(range(len(gids)))
    order.shuffle(arrival)
    expected = canonical(informative, target)
    for i in arrival:
        plan.record(gids[i], informative[i])
        for gid, verdict in plan.decide().items():
            assert verdict == expected[gid]
    assert plan.complete and plan.verdicts == expected


# -- the feeder's refill batches ------------------------------------------------------------------


@pytest.fixture(scope="module")
def feeder() -> PromptFeeder:
    rows = [PromptRow(f"{i}+{i}=", str(2 * i), {}) for i in range(10)]
    return PromptFeeder(
        rows, build_tokenizer(), batch_prompts=2, group_size=2, seed=0, max_rounds=3
    )


def test_refill_rounds_have_their_own_ids_and_prompts(feeder: PromptFeeder) -> None:
    first = feeder.batch(3)
    refill = feeder.batch(3, round_index=2)
    assert [r["group_id"] for r in refill[::2]] == ["b3-r2-p0", "b3-r2-p1"]
    assert feeder.group_ids(3, 2) == ["b3-r2-p0", "b3-r2-p1"]
    assert all(r["batch_index"] == 3 for r in refill)
    assert [r["sample_id"] for r in first[:2]] == ["b3-p0-s0", "b3-p0-s1"]  # round 0 unchanged
    assert [group_round(r["group_id"]) for r in first + refill] == [0] * 4 + [2] * 4
    assert group_id(3, 1, 2) == "b3-r2-p1" and group_id(3, 1) == "b3-p1"


def test_refill_rounds_are_a_function_of_batch_and_round(feeder: PromptFeeder) -> None:
    def answers(b: int, r: int) -> list[str]:
        return [row["fields"][F.ANSWER] for row in feeder.batch(b, round_index=r)[::2]]

    before = answers(5, 1)
    answers(40, 2)  # later epochs of both orders in between
    assert answers(5, 1) == before
    # each (batch, round) takes its own slot of the refill order: 5 batches x 2 rounds x 2
    # prompts are two epochs of the 10 prompts
    seen = [a for b in range(5) for r in (1, 2) for a in answers(b, r)]
    assert sorted(seen) == sorted(str(2 * i) for i in range(10) for _ in range(2))
    with pytest.raises(ValueError, match="max_rounds"):
        feeder.batch(0, round_index=3)


# -- the trainer role over a bus ---------------------------------------------------------------------


class FakeLearner:
    """Counts what it is given; `step` bumps the version."""

    class settings:  # noqa: N801 - mirrors Learner.settings
        @staticmethod
        def normaliser_share(num_tokens: int) -> float:
            return float(num_tokens)

    def __init__(self) -> None:
        self.version = 0
        self.trained: list[str] = []

    def accumulate(self, rows, num_skipped_tokens: float = 0.0) -> None:
        self.trained.extend(r["sample_id"] for r in rows)

    def step(self) -> dict[str, float]:
        self.version += 1
        return {"loss": 0.0}

    def peak_memory_bytes(self) -> list[int]:
        return [0]

    def named_weights(self) -> dict[str, Any]:
        return {}


class IdFeeder:
    """A feeder without prompts: only what the trainer uses (ids, rows, batch size)."""

    batch_prompts, group_size = 2, 2

    def group_ids(self, b: int, round_index: int = 0) -> list[str]:
        return [group_id(b, j, round_index) for j in range(self.batch_prompts)]

    def batch(self, b: int, round_index: int = 0) -> list[dict[str, Any]]:
        return [
            {
                "sample_id": f"{gid}-s{k}",
                "group_id": gid,
                "group_size": self.group_size,
                "batch_index": b,
                "fields": {F.PROMPT_IDS: np.arange(3)},
            }
            for gid in self.group_ids(b, round_index)
            for k in range(self.group_size)
        ]


def score(bus: LocalBus, gid: str, rewards: list[float]) -> None:
    """Write every field the trainer reads, as the pipeline would (advantage None: no signal)."""
    signal = len(set(rewards)) > 1
    bus.write(
        {
            f"{gid}-s{k}": {
                F.RESPONSE_IDS: np.arange(2),
                F.ROLLOUT_LOGPROBS: np.full(2, -1.0, dtype=np.float32),
                F.VERSIONS: np.zeros(2, dtype=np.int64),
                F.FINISH_REASON: "stop",
                F.REWARD: reward,
                F.REWARD_STATUS: "ok",
                F.REWARD_COMPONENTS: {},
                F.ADVANTAGES: (reward - 0.5) if signal else None,
            }
            for k, reward in enumerate(rewards)
        }
    )


def make_trainer(bus: LocalBus, learner: FakeLearner, lease_s: float = 60) -> TrainerRole:
    return TrainerRole(
        bus,
        InProcessWeights(),
        BatchTrainer(learner, skip_zero_advantage=False, max_staleness=0),
        batch_prompts=2,
        micro_batch_rows=4,
        lease_s=lease_s,
        refill=IdFeeder(),
        max_rounds=2,
    )


def test_trainer_refills_until_the_step_has_enough_groups_with_signal() -> None:
    feeder = IdFeeder()
    bus = LocalBus(capacity_groups=4)  # one batch in flight plus one refill round
    bus.register_consumer("trainer")
    learner = FakeLearner()
    role = make_trainer(bus, learner)
    bus.add_rows(feeder.batch(0))  # the feeder role's job
    score(bus, "b0-p0", [1.0, 0.0])
    score(bus, "b0-p1", [1.0, 1.0])  # no signal
    assert role.step() is None
    assert bus.num_groups_live() == 4  # the refill round is on the bus
    assert role.step() is None  # waits for it
    score(bus, "b0-r1-p1", [0.0, 1.0])
    score(bus, "b0-r1-p0", [1.0, 0.0])
    record = None
    while record is None:
        record = role.step()
    m = record["metrics"]
    assert sorted(record["trained_ids"]) == sorted(
        f"{g}-s{k}" for g in ("b0-p0", "b0-r1-p0") for k in range(2)
    )
    assert m["dynamic_sampling/groups_trained"] == 2
    assert m["dynamic_sampling/groups_dropped"] == 1
    assert m["dynamic_sampling/groups_surplus"] == 1
    assert m["samples/dropped_surplus"] == 2 and m["samples/dropped_zero_variance"] == 2
    assert m["dynamic_sampling/batches_per_step"] == 2
    assert bus.num_groups_live() == 0  # every row of the step was acked
    assert role.current == 1 and learner.version == 1


def test_trainer_keeps_its_rows_leased_while_it_waits_for_a_refill() -> None:
    bus = LocalBus(capacity_groups=4)
    bus.register_consumer("trainer")
    learner = FakeLearner()
    role = make_trainer(bus, learner, lease_s=1.0)
    bus.add_rows(IdFeeder().batch(0))
    score(bus, "b0-p0", [1.0, 0.0])
    score(bus, "b0-p1", [1.0, 1.0])
    assert role.step() is None  # claims round 0, adds the refill
    for _ in range(3):  # 1.5 s in all: past the lease unless renewed
        time.sleep(0.5)
        assert role.step() is None
    score(bus, "b0-r1-p0", [1.0, 0.0])
    score(bus, "b0-r1-p1", [1.0, 1.0])
    record = None
    while record is None:
        record = role.step()
    assert len(record["trained_ids"]) == 4
    assert bus.stats()["expired_leases"] == 0


def test_a_recovered_trainer_finds_its_refill_round_on_a_full_bus() -> None:
    """After an in-place trainer recovery the refill rows the lost trainer added are still on
    the bus, which may be full: adding them again must not wait for room."""
    bus = LocalBus(capacity_groups=4)
    bus.register_consumer("trainer")
    bus.add_rows(IdFeeder().batch(0) + IdFeeder().batch(0, round_index=1))
    assert not bus.can_add(2)
    for gid, rewards in [("b0-p0", [1.0, 0.0]), ("b0-p1", [1.0, 1.0])]:
        score(bus, gid, rewards)
    for gid in ("b0-r1-p0", "b0-r1-p1"):
        score(bus, gid, [0.0, 1.0])
    role = make_trainer(bus, FakeLearner())
    record = None
    for _ in range(5):
        record = record or role.step()
    assert record is not None and record["metrics"]["dynamic_sampling/batches_per_step"] == 2


# -- whole-batch collection ------------------------------------------------------------------------


def test_batch_collector_returns_each_round_on_its_own() -> None:
    bus = LocalBus()
    bus.register_consumer("advantage")
    feeder = IdFeeder()
    collector = BatchCollector(
        bus,
        InProcessWeights(),
        consumer="advantage",
        fields=[F.REWARD],
        groups_per_batch=2,
        max_staleness=0,
        max_rows=64,
        lease_s=60,
    )
    bus.add_rows(feeder.batch(0) + feeder.batch(0, round_index=1))
    bus.write({f"b0-p0-s{k}": {F.REWARD: 1.0} for k in range(2)})
    bus.write({f"b0-r1-p{j}-s{k}": {F.REWARD: 1.0} for j in range(2) for k in range(2)})
    key, rows = collector.poll()  # two groups of batch 0 are in, but of different rounds
    assert key == (0, 1) and {r["group_id"] for r in rows} == {"b0-r1-p0", "b0-r1-p1"}
    collector.ack_batch(key)
    assert collector.poll() is None
    bus.write({f"b0-p1-s{k}": {F.REWARD: 1.0} for k in range(2)})
    key, rows = collector.poll()
    assert key == (0, 0) and len(rows) == 4
