"""SIGKILL a multi-process run mid-training, resume it, and nothing is trained twice or skipped.

The run is killed like a crashed machine: its whole process group (driver, Ray, every role) at
once. `streamrl train --resume` continues from the latest checkpoint; the multiset of sample ids
trained (from `trained_samples.jsonl`, which a resume truncates back to the checkpoint along with
everything trained after it) must equal that of an uninterrupted run with the same config.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from tests.integration.conftest import QUICK, REPO, cli_env, read_jsonl, run_cli

pytestmark = pytest.mark.integration

ARGS = [
    *QUICK,
    "trainer.steps=16",
    "trainer.checkpoint_every=4",
    "trainer.eval_every=0",
    "runtime.mode=ray",
]


def _trained(run_dir) -> Counter:
    ids = Counter()
    for line in read_jsonl(run_dir / "trained_samples.jsonl"):
        ids.update(line["ids"])
    return ids


def test_sigkill_then_resume_trains_each_sample_once(tmp_path, quick_cache):
    cache = f"run.cache_dir={quick_cache}"
    reference = tmp_path / "uninterrupted"
    run_cli(["train", *ARGS, cache, f"run.run_dir={reference}"])

    crashed = tmp_path / "crashed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "train", *ARGS, cache, f"run.run_dir={crashed}"],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (crashed / "checkpoints" / "step-000008").is_dir():
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline, "no checkpoint at step 8 within 300 s"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    steps_logged = [line["step"] for line in read_jsonl(crashed / "trained_samples.jsonl")]
    assert max(steps_logged) < 16, "the run finished before the kill; nothing was tested"

    run_cli(["train", "--resume", str(crashed)])
    summary = (crashed / "summary.json").read_text()
    assert '"resumed_from_step": ' in summary and '"resumed_from_step": 0' not in summary

    expected = _trained(reference)
    assert sum(expected.values()) == 16 * 4 * 4
    assert _trained(crashed) == expected
