"""Elastic rollout: replicas added and removed while a run trains, nothing lost or repeated.

`streamrl scale RUN_DIR rollout=2` starts a second engine that takes a share of the work; going
back to 1 drains one replica (it finishes the rows it holds, then stops); `streamrl stop` then
ends the run. Every sample id is trained exactly once.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.integration.conftest import QUICK, read_jsonl, run_cli
from tests.integration.test_faults import all_ids, finish, start, steps_done, trained_ids, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_scale_rollout_up_and_down_while_training(tmp_path, quick_cache):
    run_dir = tmp_path / "elastic"
    steps = 600  # a ceiling: the test stops the run once the replica has drained
    args = [
        *QUICK,
        f"run.cache_dir={quick_cache}",
        f"trainer.steps={steps}",
        "trainer.eval_every=0",
    ]
    proc = start(args, run_dir)
    try:
        wait_for(proc, "step 10", lambda: steps_done(run_dir) >= 10)
        run_cli(["scale", str(run_dir), "rollout=2"])
        wait_for(proc, "a second rollout replica", lambda: "rollout#1" in _live(run_dir))
        busy_from = steps_done(run_dir)
        wait_for(proc, "the new replica to work", lambda: _replica_busy(run_dir, busy_from) > 0)
        run_cli(["scale", str(run_dir), "rollout=1"])
        wait_for(proc, "the replica drained", lambda: "rollout#1" not in _live(run_dir))
        run_cli(["stop", str(run_dir)])
        finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    stopped_at = json.loads((run_dir / "summary.json").read_text())["num_steps"]
    assert stopped_at < steps, "the run ended before scaling down was tested"
    assert trained_ids(run_dir) == dict.fromkeys(all_ids(stopped_at, 4, 4), 1)
    actions = [e["action"] for e in read_jsonl(run_dir / "events.jsonl")]
    assert any("starting ['rollout#1']" in a for a in actions)
    assert any("draining ['rollout#1']" in a for a in actions)
    assert "removed" in actions


def _live(run_dir) -> set[str]:
    try:
        roles = json.loads((run_dir / "roles.json").read_text())["roles"]
    except (FileNotFoundError, json.JSONDecodeError):
        return set()
    return {name for name, info in roles.items() if info["healthy"]}


def _replica_busy(run_dir, from_step: int) -> float:
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    return sum(m.get("time/rollout#1_busy_s", 0.0) for m in metrics if m["step"] > from_step)
