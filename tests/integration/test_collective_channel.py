"""The collective weight channel in a real run, with an engine killed on the way.

With max_staleness=0 every sample depends on exactly the weights of the step before, so a run
over `runtime.weights.channel=collective` must draw the same samples as one over the object
store, even though its rollout engine is SIGKILLed mid-run: the versions published while the
group is down reach the restarted engine through the host copy, and a new group (epoch 2) forms
with the new process. Any lost, late or corrupted update would change the
samples. The role logs (RUN_DIR/logs) show the groups forming and versions arriving over them.

The collective run is stopped (`streamrl stop`) once a version has arrived over epoch 2, and the
object-store run then trains as many steps: a constant learning rate makes the steps taken
independent of how many were planned. (Both ran a fixed 100 steps before, sized so that epoch 2
would form in time on a fast machine: about 2.5 minutes of CI on a slow one.)
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.integration.conftest import QUICK, read_jsonl, run_cli
from tests.integration.test_faults import finish, kill_role, start, trained_ids, wait_for

pytestmark = pytest.mark.integration

CEILING = 1000  # steps; the test stops the collective run long before


def digests(run_dir) -> list[str]:
    return [line["digest"] for line in read_jsonl(run_dir / "trained_samples.jsonl")]


def test_collective_channel_survives_an_engine_restart_with_the_same_samples(tmp_path, quick_cache):
    common = [
        *QUICK,
        f"run.cache_dir={quick_cache}",
        "trainer.eval_every=0",
        "rollout.max_staleness=0",
        "algorithm.lr_schedule=constant",
    ]
    run_dir = tmp_path / "collective"
    args = [*common, f"trainer.steps={CEILING}", "runtime.weights.channel=collective"]
    proc = start(args, run_dir)
    try:
        kill_role(proc, run_dir, "rollout", at_step=8)
        # The trainer notices the dead member by a failed broadcast or by its lapsed heartbeat,
        # depending on timing; either way epoch 2 holds the restarted engine.
        wait_for(
            proc,
            "a version over weight group 2",
            lambda: "over weight group 2" in _log(run_dir, "rollout"),
        )
        run_cli(["stop", str(run_dir)])
        finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped_at = json.loads((run_dir / "summary.json").read_text())["num_steps"]
    assert 8 < stopped_at < CEILING

    reference = tmp_path / "object_store"
    run_cli(["train", *common, f"trainer.steps={stopped_at}", f"run.run_dir={reference}"])

    assert len(digests(run_dir)) == stopped_at
    assert digests(run_dir) == digests(reference)
    assert max(trained_ids(run_dir).values()) == 1

    rollout_log = _log(run_dir, "rollout")
    assert "weight group 1 formed" in _log(run_dir, "trainer")
    assert "weight group 2 formed" in _log(run_dir, "trainer")
    assert "over weight group 1" in rollout_log
    assert rollout_log.count("rollout: starting") == 2  # both processes, in one file
    assert "SUPERVISOR process died" in rollout_log


def _log(run_dir, role: str) -> str:
    path = run_dir / "logs" / f"{role}.log"
    return path.read_text() if path.exists() else ""
