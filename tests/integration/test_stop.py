"""`streamrl stop RUN_DIR` ends a live run after its current step, with a checkpoint, and
`streamrl train --resume RUN_DIR` continues it: every sample trained exactly once overall.
Ctrl-C (SIGINT to the run's whole process group, as a terminal sends it) does the same; a second
Ctrl-C stops the run at once.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from streamrl.control import stop_requested
from tests.integration.conftest import QUICK, run_cli
from tests.integration.test_faults import all_ids, finish, start, steps_done, trained_ids, wait_for

pytestmark = pytest.mark.integration


def _args(quick_cache, mode: str) -> list[str]:
    return [
        *QUICK,
        f"run.cache_dir={quick_cache}",
        "trainer.steps=500",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",  # the stop itself must write the checkpoint
        f"runtime.mode={mode}",
    ]


@pytest.mark.parametrize("mode", ["threads", "sync"])
def test_stop_then_resume_trains_each_sample_once(tmp_path, quick_cache, mode):
    run_dir = tmp_path / mode
    proc = start(_args(quick_cache, mode), run_dir)
    try:
        wait_for(proc, "step 3", lambda: steps_done(run_dir) >= 3)
        # A resume of the live run (another terminal, say) is refused: both would write here.
        twice = run_cli(["train", "--resume", str(run_dir)], check_ok=False)
        assert twice.returncode == 2 and "in use by a running job" in twice.stderr
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


def test_ctrl_c_stops_a_ray_run_after_its_step_and_loses_nothing(tmp_path, quick_cache):
    run_dir = tmp_path / "ctrl-c"
    proc = start(_args(quick_cache, "ray"), run_dir)
    try:
        wait_for(proc, "step 3", lambda: steps_done(run_dir) >= 3)
        os.killpg(proc.pid, signal.SIGINT)  # the driver, Ray and every role, as a terminal does
        out = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Ctrl-C: stopping after the current step" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] and summary["role_restarts"] == {}
    assert summary["num_samples_dropped"] == {}  # the reward worker was not killed mid-task
    assert (run_dir / "checkpoints" / f"step-{summary['num_steps']:06d}").is_dir()
    assert trained_ids(run_dir) == dict.fromkeys(all_ids(summary["num_steps"], 4, 4), 1)


def test_a_second_ctrl_c_stops_at_once(tmp_path, quick_cache):
    run_dir = tmp_path / "ctrl-c-twice"
    proc = start([*_args(quick_cache, "threads"), "trainer.checkpoint_every=2"], run_dir)
    try:
        wait_for(proc, "step 3", lambda: steps_done(run_dir) >= 3)
        os.killpg(proc.pid, signal.SIGINT)
        # Two signals in a row would reach the handler as one: wait for the first to be handled
        # (it asks for the stop), then press again while the step, its evaluation and checkpoint
        # are still under way.
        wait_for(proc, "the stop request", lambda: stop_requested(run_dir))
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-4000:]
    assert "Traceback" not in out
    assert f"`streamrl train --resume {run_dir}` continues" in out
