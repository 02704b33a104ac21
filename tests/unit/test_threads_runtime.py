"""Threads mode's pieces: the thread-safe in-process weight store, a role's loop in a thread,
and the driver ending the run when a role's thread fails."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from streamrl.api.role import RoleBase
from streamrl.runtime.driver import drive
from streamrl.runtime.roles import loop_role
from streamrl.runtime.threads import RoleThread, ThreadsDeployment
from streamrl.weights.dcs import InProcessWeights


def test_wait_newer_wakes_on_a_publish_from_another_thread():
    weights = InProcessWeights()
    seen = []
    waiter = threading.Thread(target=lambda: seen.append(weights.wait_newer(-1, 30.0)))
    waiter.start()
    time.sleep(0.05)
    started = time.monotonic()
    weights.publish(0, {"w": torch.ones(2)})
    waiter.join(10.0)
    assert seen == [0]
    assert time.monotonic() - started < 5.0  # woken by the publish, not by the 30 s timeout


def test_wait_newer_times_out_with_the_version_held():
    weights = InProcessWeights()
    weights.publish(3, {"w": torch.ones(2)})
    assert weights.wait_newer(3, 0.01) == 3
    assert weights.wait_newer(2, 0.0) == 3


def test_fetch_never_sees_a_version_without_its_tensors():
    """A publish swaps version and tensors together: a fetch racing it sees one or the other."""
    weights = InProcessWeights()
    stop = threading.Event()
    mismatches = []

    def fetch() -> None:
        while not stop.is_set():
            got = weights.fetch_newer(-1)
            if got is not None and float(got[1]["w"][0]) != got[0]:
                mismatches.append(got[0])

    reader = threading.Thread(target=fetch)
    reader.start()
    for version in range(300):
        weights.publish(version, {"w": torch.full((256,), float(version))})
    stop.set()
    reader.join(10.0)
    assert mismatches == []


class _Counter(RoleBase):
    """A role that works `work` times, then finds nothing to do."""

    def __init__(self, work: int):
        self.work = work
        self.steps = 0

    def step(self) -> bool:
        self.steps += 1
        if self.work > 0:
            self.work -= 1
            return True
        return False


def test_loop_role_stops_when_told():
    role, stop = _Counter(work=5), threading.Event()
    thread = threading.Thread(target=loop_role, args=(role, stop, 0.001))
    thread.start()
    time.sleep(0.2)
    stop.set()
    thread.join(5.0)
    assert not thread.is_alive()
    assert role.work == 0 and role.steps > 5  # worked, then kept looking while idle


class _Broken(RoleBase):
    def step(self) -> bool:
        raise ValueError("reward model exploded")


class _WaitingTrainer(RoleBase):
    """A trainer that never gets work (its inputs come from the broken role)."""

    def step(self) -> bool:
        return False


def test_a_failing_role_thread_ends_the_run_with_its_error():
    stop = threading.Event()
    broken = RoleThread("reward", _Broken(), stop, poll_s=0.001)
    broken.thread.start()
    broken.thread.join(5.0)
    assert isinstance(broken.error, ValueError) and stop.is_set()

    ctx = SimpleNamespace(
        cfg=SimpleNamespace(runtime=SimpleNamespace(stall_timeout_s=60, poll_s=0.001))
    )
    bus = SimpleNamespace(stats=lambda: {})
    deployment = ThreadsDeployment(_WaitingTrainer(), {"reward": broken}, bus, poll_s=0.001)
    with pytest.raises(RuntimeError, match="role reward failed.*reward model exploded"):
        drive(ctx, deployment, lambda r: None)


def test_the_run_stalls_out_with_a_diagnosis():
    cfg = SimpleNamespace(runtime=SimpleNamespace(stall_timeout_s=0.1, poll_s=0.001))
    ctx = SimpleNamespace(cfg=cfg)
    bus = SimpleNamespace(stats=lambda: {"live_rows": 0})
    deployment = ThreadsDeployment(_WaitingTrainer(), {}, bus, poll_s=0.001)
    with pytest.raises(RuntimeError, match="no training step finished"):
        drive(ctx, deployment, lambda r: None)
