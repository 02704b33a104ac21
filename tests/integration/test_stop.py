"""`streamrl stop RUN_DIR` ends a live run after its current step, with a checkpoint, and
`streamrl train --resume RUN_DIR` continues it: every sample trained exactly once overall.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.integration.conftest import QUICK, run_cli
from tests.integration.test_faults import all_ids, finish, start, steps_done, trained_ids, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["threads", "sync"])
def test_stop_then_resume_trains_each_sample_once(tmp_path, quick_cache, mode):
    run_dir = tmp_path / mode
    args = [
        *QUICK,
        f"run.cache_dir={quick_cache}",
        "trainer.steps=500",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",  # the stop itself must write the checkpoint
        f"runtime.mode={mode}",
    ]
    proc = start(args, run_dir)
    try:
        wait_for(proc, "step 3", lambda: steps_done(run_dir) >= 3)
        run_cli(["stop", str(run_dir)])
        finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["num_steps"]
    assert 3 <= stopped_at < 500 and summary["stopped_early"]
    assert summary["final_eval_accuracy"] is not None  # the last step is evaluated
    assert (run_dir / "checkpoints" / f"step-{stopped_at:06d}").is_dir()
    assert trained_ids(run_dir) == dict.fromkeys(all_ids(stopped_at, 4, 4), 1)

    end = stopped_at + 3
    run_cli(["train", "--resume", str(run_dir), f"trainer.steps={end}"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped_at and summary["num_steps"] == end
    assert not summary["stopped_early"]
    assert trained_ids(run_dir) == dict.fromkeys(all_ids(end, 4, 4), 1)
