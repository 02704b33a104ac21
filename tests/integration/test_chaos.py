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
import os
import random
import signal
from collections import Counter

import pytest

from tests.integration.conftest import SHORT, read_jsonl
from tests.integration.test_faults import (
    all_ids,
    finish,
    kill_role,
    start,
    trained_ids,
)

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
    # Checkpoints every 5 steps bound what a lost bus shard costs (every role restarts there).
    args = [*SHORT, f"trainer.steps={steps}", "trainer.checkpoint_every=5"]
    plan = kill_plan(seed, steps)
    proc = start(args, run_dir)
    try:
        for name, step in plan:
            kill_role(proc, run_dir, name, step)  # roles and services alike
        finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

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
    recovered = [e for e in events if e["role"] == "bus#0" and e["failure"] == "recovered"]
    assert len(recovered) == kills["bus#0"]
    assert any("published version" in e["action"] for e in events if e["role"] == "weights")
