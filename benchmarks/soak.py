"""Soak: the default job while every process of it (but the driver) is SIGKILLed, each several
times, at random steps; it must finish on its own and train every sample exactly once.

The processes: the roles (feeder, rollout, reward, advantage, trainer), the bus shard and the
weight store, found through the run directory's `roles.json` (`roles` and `services`). Rounds
of kills, each round every process once in a seeded random order, are spread over the run at
random steps; a kill waits until its victim is live and the next until the successor is up.
The feeder, whose loop ends once it has added the last batch, is killed only in the first half.
After the run:

- kills survived: kills after which the victim came back, the run finishing without a hand;
- samples lost: sample ids of the run's batches neither trained nor dropped with a reason;
- samples duplicated: extra trainings of a sample id (an uninterrupted run trains each once);
- held-out accuracy before and after, restarts per process, what each bus shard's loss cost (a
  rebuild in place, with its time) and how many times every role was restarted (0 expected).

    python benchmarks/soak.py [--rounds 3] [--seed 0] [--run-dir DIR] [override ...]

Overrides go to `streamrl train` (e.g. `trainer.steps=60`); the default job needs no override.
The restart budget is raised to `--rounds` + 2 (`runtime.ray.max_restarts`), as a run that
expects this many failures would set it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, train_command  # noqa: E402

from streamrl.runtime.status import kill_job_process, live_pid  # noqa: E402

ROLES = ("feeder", "rollout", "reward", "advantage", "trainer")
SERVICES = ("bus#0", "weights")


def steps_done(run_dir: Path) -> int:
    path = run_dir / "trained_samples.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for(proc: subprocess.Popen, what: str, check, timeout_s: float = 900.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")
        time.sleep(0.1)
    return value


def plan(seed: int, rounds: int, steps: int) -> list[tuple[str, int]]:
    """(victim, step) in kill order: `rounds` rounds of every process, at random steps."""
    rng = random.Random(seed)
    victims: list[str] = []
    for _ in range(rounds):
        victims += rng.sample([*ROLES, *SERVICES], len(ROLES) + len(SERVICES))
    # The feeder early: its kills move to the first half of the schedule.
    feeder = [v for v in victims if v == "feeder"]
    others = [v for v in victims if v != "feeder"]
    half = len(victims) // 2
    slots = sorted(rng.sample(range(half), len(feeder)))
    for slot in slots:
        others.insert(slot, "feeder")
    at = sorted(rng.sample(range(2, int(steps * 0.85)), len(others)))
    return list(zip(others, at, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="soak-")) / "run"
    overrides = [f"runtime.ray.max_restarts={args.rounds + 2}", *args.overrides]
    steps = next(
        (int(o.split("=", 1)[1]) for o in overrides if o.startswith("trainer.steps=")), 100
    )
    schedule = plan(args.seed, args.rounds, steps)
    cmd, env = train_command(run_dir, overrides)
    print(f"run {run_dir}: {len(schedule)} kills: {schedule}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    survived = 0
    try:
        for name, step in schedule:
            wait_for(proc, f"step {step}", lambda s=step: steps_done(run_dir) >= s)
            pid = wait_for(
                proc,
                f"a live {name}",
                lambda n=name: kill_job_process(proc.pid, live_pid(run_dir, n)),
            )
            killed = time.monotonic()
            wait_for(
                proc, f"{name} back", lambda n=name, p=pid: live_pid(run_dir, n) not in (None, p)
            )
            survived += 1
            print(f"  {name:9s} killed at step {step:3d}, back in {time.monotonic() - killed:5.1f}s", flush=True)  # fmt: skip
        out, _ = proc.communicate(timeout=3600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        print(out[-4000:])
        raise SystemExit(f"the run failed (exit {proc.returncode}) after {survived} kills")

    summary = json.loads((run_dir / "summary.json").read_text())
    trained: Counter = Counter()
    for line in (run_dir / "trained_samples.jsonl").read_text().splitlines():
        trained.update(json.loads(line)["ids"])
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    batch, group = config["rollout"]["batch_prompts"], config["rollout"]["group_size"]
    expected = {f"b{b}-p{p}-s{s}" for b in range(steps) for p in range(batch) for s in range(group)}
    dropped = sum(summary["num_samples_dropped"].values())
    lost = len(expected - set(trained)) - dropped
    duplicated = sum(count - 1 for count in trained.values())
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    shard_events = [e["action"] for e in events if e["role"].startswith("bus#")]
    restarts_of_all = [e["action"] for e in events if e["failure"] == "recovered"]
    print(f"kills survived: {survived} of {len(schedule)} ({Counter(n for n, _ in schedule)})")
    print(f"samples trained: {sum(trained.values())}, dropped with a reason: {dropped}")
    print(f"samples lost: {lost}")
    print(f"samples duplicated: {duplicated}")
    print(f"outside the run's batches: {len(set(trained) - expected)}")
    print(
        f"held-out accuracy: {summary['initial_eval_accuracy']:.3f} -> "
        f"{summary['final_eval_accuracy']:.3f}"
    )
    print(f"restarts: {summary['role_restarts']}")
    print(f"bus shard losses: {shard_events}")
    print(f"restarts of every role: {len(restarts_of_all)} {restarts_of_all}")
    print(
        f"wall time: {time.monotonic() - started:.0f}s (RL phase {summary['rl_wall_time_s']:.0f}s)"
    )


if __name__ == "__main__":
    main()
