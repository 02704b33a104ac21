"""Process-tree memory sampling sees children's memory and survives vanishing children."""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import psutil
import pytest

from streamrl.metrics import PeakMemorySampler, process_tree_rss

ALLOC_BYTES = 100 * 2**20
# A child that really touches ~100 MB (b"x" * n fills the pages), says so, then waits.
CHILD_CODE = (
    f"import sys, time; b = b'x' * {ALLOC_BYTES}; print('ready', flush=True); time.sleep(60)"
)


@pytest.fixture
def big_child() -> Iterator[subprocess.Popen]:
    child = subprocess.Popen([sys.executable, "-c", CHILD_CODE], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        yield child
    finally:
        child.kill()
        child.wait()


def test_process_tree_rss_includes_children(big_child: subprocess.Popen) -> None:
    own_rss = psutil.Process().memory_info().rss
    tree_rss = process_tree_rss(os.getpid())
    assert tree_rss - own_rss >= 0.9 * ALLOC_BYTES
    assert process_tree_rss(big_child.pid) >= 0.9 * ALLOC_BYTES


def test_sampler_keeps_peak_after_child_exits() -> None:
    with PeakMemorySampler(interval_s=0.05) as sampler:
        baseline = sampler.peak_bytes
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD_CODE], stdout=subprocess.PIPE, text=True
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # several sampling intervals while the child holds its memory
        child.kill()
        child.wait()
        time.sleep(0.2)
    assert sampler.peak_bytes - baseline >= 0.9 * ALLOC_BYTES
    assert sampler.last_bytes < sampler.peak_bytes - 0.5 * ALLOC_BYTES


def test_sample_once_updates_peak_and_last() -> None:
    sampler = PeakMemorySampler()
    value = sampler.sample_once()
    assert value > 0
    assert sampler.last_bytes == value == sampler.peak_bytes


class _FakeProcess:
    """Stands in for psutil.Process: a fixed RSS, or an error when read."""

    def __init__(self, rss: int = 0, error: Exception | None = None, children: list | None = None):
        self._rss, self._error, self._children = rss, error, children or []

    def memory_info(self) -> SimpleNamespace:
        if self._error is not None:
            raise self._error
        return SimpleNamespace(rss=self._rss)

    def children(self, recursive: bool = False) -> list:
        assert recursive, "descendants of descendants must be included"
        return self._children


def test_vanished_or_unreadable_descendants_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    root = _FakeProcess(
        rss=1000,
        children=[
            _FakeProcess(error=psutil.NoSuchProcess(pid=11)),
            _FakeProcess(rss=200),
            _FakeProcess(error=psutil.ZombieProcess(pid=12)),
            _FakeProcess(error=psutil.AccessDenied(pid=13)),
            _FakeProcess(rss=34),
        ],
    )
    monkeypatch.setattr(psutil, "Process", lambda pid: root)
    assert process_tree_rss(1) == 1234


def test_sampler_thread_ends_when_root_process_ends() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    sampler = PeakMemorySampler(interval_s=0.05, pid=child.pid)
    sampler.start()
    child.wait()
    deadline = time.monotonic() + 5
    while sampler._thread is not None and sampler._thread.is_alive():
        assert time.monotonic() < deadline, "sampler thread did not notice the root exit"
        time.sleep(0.05)
    sampler.stop()
    assert sampler.peak_bytes > 0


def test_process_tree_rss_of_missing_pid_raises() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(psutil.NoSuchProcess):
        process_tree_rss(child.pid)


def test_process_peak_bytes_keeps_the_high_water_mark() -> None:
    from streamrl.metrics.memory import process_peak_bytes, rank_memory_metrics

    before = process_peak_bytes()
    block = b"x" * (before + ALLOC_BYTES)  # touched pages: above any earlier peak
    during = process_peak_bytes()
    del block
    assert during >= before + ALLOC_BYTES
    assert process_peak_bytes() >= before + ALLOC_BYTES  # freeing does not lower the peak
    assert rank_memory_metrics([2**30, 2**29]) == {
        "memory/trainer_rank0_peak_gib": 1.0,
        "memory/trainer_rank1_peak_gib": 0.5,
    }
