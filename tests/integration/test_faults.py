"""Fault injection on a live Ray-mode run: roles are SIGKILLed and the supervisor recovers.

- The rollout engine and the reward service are each killed 3 times during the default job:
  the run completes, every sample id is trained exactly once (or dropped with a reason, never
  both and never lost), and the foundation's accuracy bar is met.
- The trainer is killed: it alone restarts, from its latest checkpoint, while the other roles
  keep running (runtime/recovery.py), and no sample is trained twice. Every role's log, both
  trainer processes included, is in RUN_DIR/logs.

Role processes are found through `roles.json`, which the supervisor keeps in the run directory.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from streamrl.runtime.status import kill_job_process, live_pid
from tests.integration.conftest import QUICK, REPO, cli_env, read_jsonl

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def start(args: list[str], run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "train", *args, f"run.run_dir={run_dir}"],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def steps_done(run_dir: Path) -> int:
    path = run_dir / "trained_samples.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for(proc: subprocess.Popen, what: str, check, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the run ended while waiting for {what}:\n{proc.stdout.read()[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def kill_role(
    proc: subprocess.Popen, run_dir: Path, role: str, at_step: int, step_s: float = 300
) -> None:
    """SIGKILL `role`'s process (or a service's: `bus#0`, `weights`) once `at_step` steps are
    done (waiting at most `step_s` for them); wait for its replacement."""
    wait_for(proc, f"step {at_step}", lambda: steps_done(run_dir) >= at_step, step_s)
    pid = wait_for(proc, f"a live {role}", lambda: kill_if_ours(proc, live_pid(run_dir, role)))
    wait_for(proc, f"{role} restarted", lambda: live_pid(run_dir, role) not in (None, pid))


def kill_if_ours(proc: subprocess.Popen, pid: int | None) -> int | None:
    """SIGKILL `pid` if it is a process of the run `proc` started (`kill_job_process`)."""
    return kill_job_process(proc.pid, pid)


def run_with_kills(
    args: list[str], run_dir: Path, kills: list[tuple[str, int]], first_step_s: float = 300
) -> str:
    """`streamrl train args`, SIGKILLing each (process, step) of `kills` in turn (each waits for
    its predecessor's successor); returns the run's output once it finished on its own.
    `first_step_s` bounds the wait for the first kill's step (set-up included)."""
    proc = start(args, run_dir)
    try:
        for i, (name, step) in enumerate(kills):
            kill_role(proc, run_dir, name, step, first_step_s if i == 0 else 300)
        return finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, out[-4000:]
    return out


def critic_saves(log: str) -> list[tuple[int, int, list[int]]]:
    """(boundary k, critic steps, batches trained past k) of each "critic: saved" log line."""
    found = re.findall(
        r"critic: saved before batch (\d+) \((\d+) steps, ahead: \[([\d, ]*)\]\)", log
    )
    return [
        (int(k), int(steps), [int(b) for b in ahead.split(",") if b.strip()])
        for k, steps, ahead in found
    ]


def trained_ids(run_dir: Path) -> Counter:
    ids: Counter = Counter()
    for line in read_jsonl(run_dir / "trained_samples.jsonl"):
        ids.update(line["ids"])
    return ids


def all_ids(steps: int, prompts: int, group: int) -> set[str]:
    return {f"b{b}-p{p}-s{s}" for b in range(steps) for p in range(prompts) for s in range(group)}


def assert_each_sample_once(run_dir: Path, summary: dict, prompts: int, group: int) -> None:
    """Every sample id of the run's steps was trained once or dropped with a reason: none
    trained twice, none lost."""
    trained = trained_ids(run_dir)
    assert max(trained.values()) == 1, "a sample was trained twice"
    dropped = sum(summary["num_samples_dropped"].values())
    expected = all_ids(summary["num_steps"], prompts, group)
    assert set(trained) <= expected
    assert len(trained) + dropped == len(expected), "samples were lost"


def test_rollout_and_reward_killed_three_times_each(tmp_path):
    run_dir = tmp_path / "faults"
    kills = [("rollout", 8), ("reward", 16), ("rollout", 30),
             ("reward", 42), ("rollout", 56), ("reward", 70)]  # fmt: skip
    run_with_kills(["run.progress=false", "run.tensorboard=false"], run_dir, kills)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["role_restarts"] == {"rollout": 3, "reward": 3}
    assert summary["initial_eval_accuracy"] <= 0.4
    assert summary["final_eval_accuracy"] >= 0.8

    assert_each_sample_once(run_dir, summary, 32, 8)
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["role"] for e in events] == ["rollout", "reward"] * 3
    assert all("restart" in e["action"] for e in events)


def test_trainer_killed_resumes_from_its_checkpoint(tmp_path, quick_cache):
    run_dir = tmp_path / "trainer"
    steps = 40
    args = [
        *QUICK,
        f"run.cache_dir={quick_cache}",
        f"trainer.steps={steps}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=5",
    ]
    proc = start(args, run_dir)
    try:
        rollout_pid = wait_for(proc, "a live rollout", lambda: live_pid(run_dir, "rollout"))
        kill_role(proc, run_dir, "trainer", at_step=12)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    assert "resuming from" in out and "in place" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_restarts"] == 1
    assert summary["role_restarts"] == {"trainer": 1}  # nobody else restarted
    assert live_pid(run_dir, "rollout") == rollout_pid  # the same engine served the whole run
    trained = trained_ids(run_dir)
    assert max(trained.values()) == 1, "a sample was trained twice"
    assert set(trained) == all_ids(steps, 4, 4)
    steps_logged = [line["step"] for line in read_jsonl(run_dir / "trained_samples.jsonl")]
    assert steps_logged == list(range(1, steps + 1))
    metric_steps = [line["step"] for line in read_jsonl(run_dir / "metrics.jsonl")]
    assert metric_steps == sorted(set(metric_steps)), "metrics of replayed steps kept twice"
    assert any(
        "throughput/rollout_tokens_per_s" in line for line in read_jsonl(run_dir / "metrics.jsonl")
    )

    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.count("trainer: starting") == 2  # both processes, in one file
    assert "SUPERVISOR process died" in trainer_log
    for role in ("rollout", "reward", "advantage", "feeder"):
        assert (run_dir / "logs" / f"{role}.log").read_text().count(f"{role}: starting") == 1
    assert "resuming from" in (run_dir / "logs" / "controller.log").read_text()


def test_critic_killed_between_saves_loses_no_training(tmp_path, quick_cache):
    """PPO's critic acks a batch only once a state file holds it: killed between two saves, it
    restarts from its newest file and trains those batches again, so every save that follows
    holds exactly one critic step per batch."""
    run_dir = tmp_path / "critic"
    args = [
        *QUICK,
        f"run.cache_dir={quick_cache}",
        "algorithm.preset=ppo",
        "trainer.steps=24",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=4",
    ]
    run_with_kills(args, run_dir, [("critic", 10)])

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["role_restarts"] == {"critic": 1}
    log = (run_dir / "logs" / "critic.log").read_text()
    assert log.count("critic: starting") == 2
    saved = critic_saves(log)
    assert saved and saved[-1][0] >= 16
    assert all(steps == boundary + len(ahead) for boundary, steps, ahead in saved), saved
