"""Chaos: SIGKILL processes of a live Ray-mode run chosen at random, and it trains exactly once.

Victims are drawn (seeded) among every process of the job but the driver: the roles (feeder,
rollout, reward, advantage, trainer), the bus shard and the weight store; each kill waits for a
random step and for the victim to be live, and the next waits until its successor is up. The run
must finish on its own, train every sample id of its batches exactly once (or drop it with a
reason), as an uninterrupted run does, and raise held-out accuracy as the presets' tests demand.

Processes are found through `roles.json` (`roles` and `services`), which the supervisor keeps in
the run directory; `benchmarks/soak.py` is the long version (every process three times or more).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from tests.integration.conftest import SHORT, read_jsonl
from tests.integration.test_faults import all_ids, run_with_kills, trained_ids

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROLES = ("feeder", "rollout", "reward", "advantage", "trainer")


def kill_plan(seed: int, steps: int) -> list[tuple[str, int]]:
    """(victim, step to kill it at) in kill order: the bus shard, the weight store and three
    roles drawn at random, at random steps. The feeder, whose loop ends once it added the last
    batch, is killed in the first third."""
    rng = random.Random(seed)
    victims = ["bus#0", "weights", *rng.sample(ROLES, 3)]
    rng.shuffle(victims)
    at = sorted(rng.sample(range(2, steps - 8), len(victims)))
    if "feeder" in victims:  # swap it to the earliest slot
        i = victims.index("feeder")
        victims[0], victims[i] = victims[i], victims[0]
    return list(zip(victims, at, strict=True))


@pytest.mark.parametrize("seed", [25])
def test_random_kills_of_every_kind_of_process_train_each_sample_once(tmp_path, seed):
    run_dir = tmp_path / "chaos"
    steps = 30
    # Checkpoints every 5 steps bound what a lost bus shard costs (the trainer resumes there).
    args = [*SHORT, f"trainer.steps={steps}", "trainer.checkpoint_every=5"]
    plan = kill_plan(seed, steps)
    run_with_kills(args, run_dir, plan)  # roles and services alike

    summary = json.loads((run_dir / "summary.json").read_text())
    kills = Counter(name for name, _ in plan)
    restarts = summary["role_restarts"]
    assert all(restarts.get(name, 0) >= count for name, count in kills.items()), (plan, restarts)
    before, after = summary["initial_eval_accuracy"], summary["final_eval_accuracy"]
    assert before <= 0.4 and after >= before + 0.2, f"held-out accuracy {before} -> {after}"

    trained = trained_ids(run_dir)
    assert max(trained.values()) == 1, "a sample was trained twice"
    dropped = sum(summary["num_samples_dropped"].values())
    expected = all_ids(steps, 32, 8)
    assert set(trained) <= expected
    assert len(trained) + dropped == len(expected), "samples were lost"
    steps_logged = [line["step"] for line in read_jsonl(run_dir / "trained_samples.jsonl")]
    assert steps_logged == list(range(1, steps + 1))

    events = read_jsonl(run_dir / "events.jsonl")
    assert {e["role"] for e in events} >= set(kills)
    # A lost shard is rebuilt in place: the other roles keep running (no restart of every role).
    rebuilt = [e for e in events if e["role"] == "bus#0" and "rebuilt in place" in e["action"]]
    assert len(rebuilt) == kills["bus#0"], [e for e in events if e["role"] == "bus#0"]
    assert not any(e["failure"] == "recovered" for e in events), "every role was restarted"
    assert any("published version" in e["action"] for e in events if e["role"] == "weights")


def test_each_of_two_bus_shards_lost_is_rebuilt_in_place_and_keeps_the_other_shards_rows(
    tmp_path,
):
    """Two shards, each SIGKILLed once: each is rebuilt from the data while the other keeps its
    rows (fewer rows are re-added than the rebuilt batches hold), no role but the trainer and
    the feeder restarts, and every sample is trained exactly once."""
    run_dir = tmp_path / "shards"
    steps = 16
    args = [*SHORT, f"trainer.steps={steps}", "trainer.checkpoint_every=4"]
    run_with_kills([*args, "runtime.ray.bus_shards=2"], run_dir, [("bus#1", 5), ("bus#0", 10)])

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["role_restarts"] == {"bus#1": 1, "bus#0": 1}
    trained = trained_ids(run_dir)
    assert max(trained.values()) == 1, "a sample was trained twice"
    dropped = sum(summary["num_samples_dropped"].values())
    assert len(trained) + dropped == len(all_ids(steps, 32, 8)), "samples were lost"

    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["role"] for e in events] == ["bus#1", "bus#0"], events
    for event in events:
        found = re.search(r"(\d+) rows of batches (\d+)\.\.(\d+) re-added", event["action"])
        assert found, event
        rows, first, last = map(int, found.groups())
        assert 0 < rows < (last - first + 1) * 32 * 8, event  # the other shard kept its rows
