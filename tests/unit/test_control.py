"""`control.json`: replica requests and the stop request, written from outside a running job;
and the lock that keeps a second job out of a live run's directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from streamrl.control import (
    LOCK_FILE,
    RunDirInUse,
    clear_stop,
    hold_run_dir,
    read_requests,
    request_stop,
    set_replicas,
    stop_requested,
)


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "config.yaml").write_text("{}\n")
    return tmp_path


def test_stop_and_replica_requests_live_side_by_side(run_dir) -> None:
    assert not stop_requested(run_dir) and read_requests(run_dir) == {}
    set_replicas(run_dir, "rollout", 2)
    request_stop(run_dir)
    set_replicas(run_dir, "reward", 3)
    assert stop_requested(run_dir)
    assert read_requests(run_dir) == {"rollout": 2, "reward": 3}
    clear_stop(run_dir)
    assert not stop_requested(run_dir)
    assert read_requests(run_dir) == {"rollout": 2, "reward": 3}


def test_requests_need_a_run_directory_and_sensible_values(tmp_path, run_dir) -> None:
    with pytest.raises(FileNotFoundError, match="not a streamrl run directory"):
        request_stop(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="streamrl stop"):
        set_replicas(run_dir, "rollout", 0)
    with pytest.raises(ValueError, match="only .* have replicas"):
        set_replicas(run_dir, "trainer", 2)
    clear_stop(tmp_path / "nowhere")  # nothing asked, nothing to clear


HOLDER = """
import os, sys, time
from pathlib import Path
from streamrl.control import hold_run_dir
lock = hold_run_dir(Path(sys.argv[1]))
if os.fork() == 0:  # a forked child (a reward sandbox, say) outlives its parent
    time.sleep(60)
    os._exit(0)
print("held", flush=True)
time.sleep(60)
"""


def test_a_live_run_directory_is_held_until_its_job_ends_however_it_ends(run_dir) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirInUse, match=f"in use by a running job \\(pid {holder.pid}\\)"):
            hold_run_dir(run_dir)
        os.kill(holder.pid, signal.SIGKILL)  # the job dies; its forked child lives on
        holder.wait(timeout=10)
        deadline = time.monotonic() + 10
        while True:
            try:
                lock = hold_run_dir(run_dir)
                break
            except RunDirInUse:
                assert time.monotonic() < deadline, "the lock outlived its job"
                time.sleep(0.05)
        assert (run_dir / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        lock.close()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
