"""Peak host memory of a run, measured over the whole process tree.

A run is several processes (the driver, rollout workers, a reward service, Ray helpers),
so the memory that matters is the sum over the driver and all its descendants, and the
number to report is its peak. `PeakMemorySampler` polls that sum on a daemon thread:

    with PeakMemorySampler() as sampler:
        run()
    summary["peak_memory_bytes"] = sampler.peak_bytes

The sum is of resident set sizes, so pages shared between processes (e.g. after a fork)
count once per process: an upper bound, which is the safe side for capacity planning.
Peaks shorter than `interval_s` can be missed.

`process_peak_bytes` is one process's own high-water mark, kept by the OS (or by torch on a
GPU), so it misses nothing: the trainer's ranks report theirs (`memory/trainer_rank<i>_peak_gib`).
"""

from __future__ import annotations

import os
import resource
import sys
import threading
from types import TracebackType

import psutil


def process_tree_rss(pid: int) -> int:
    """Summed RSS in bytes of process `pid` and all its descendants.

    Descendants that exit (or become unreadable) while being measured are skipped:
    workers come and go during a run. If `pid` itself does not exist,
    `psutil.NoSuchProcess` propagates.
    """
    root = psutil.Process(pid)
    total = root.memory_info().rss
    for child in root.children(recursive=True):
        try:
            total += child.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # exited between listing and reading, or owned by someone else
    return total


def process_peak_bytes(device: str = "cpu") -> int:
    """This process's peak memory since it started. On CPU the high-water mark of its resident
    set (everything the process touched, interpreter and libraries included); on a GPU
    (`device="cuda"`) the most memory torch has allocated on the current device (what the
    model, optimizer and activations needed, not the caching allocator's reserve).

    On Linux the mark is /proc's `VmHWM`, not `getrusage`'s `ru_maxrss`: the latter keeps the
    peak of the image before `exec`, so a worker spawned (fork, then exec) by a large process
    would report its parent's size."""
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass  # no /proc (macOS): getrusage, whose peak is this process's own there
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def rank_memory_metrics(peak_bytes: list[int]) -> dict[str, float]:
    """The per-step metrics of the trainer ranks' peaks (`Learner.peak_memory_bytes`), in GiB."""
    return {f"memory/trainer_rank{i}_peak_gib": b / 2**30 for i, b in enumerate(peak_bytes)}


class PeakMemorySampler:
    """Samples `process_tree_rss(pid)` every `interval_s` seconds on a daemon thread.

    `peak_bytes` is the largest sample seen, `last_bytes` the most recent one. The
    thread ends on `stop()`, or by itself once the root process is gone.
    """

    def __init__(self, interval_s: float = 0.25, pid: int | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.pid = os.getpid() if pid is None else pid
        self.peak_bytes = 0
        self.last_bytes = 0
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> int:
        """Take one sample now, update `peak_bytes`/`last_bytes`, and return it."""
        rss = process_tree_rss(self.pid)
        with self._lock:
            self.last_bytes = rss
            self.peak_bytes = max(self.peak_bytes, rss)
        return rss

    def start(self) -> None:
        """Take a first sample and start the background thread."""
        if self._thread is not None:
            raise RuntimeError("PeakMemorySampler already started; create a new one to restart")
        self.sample_once()
        self._stop_event.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"peak-memory-{self.pid}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and take a last sample if the root process is still alive."""
        if self._thread is None:
            return
        self._stop_event.set()
        self._thread.join()
        self._thread = None
        try:
            self.sample_once()
        except psutil.NoSuchProcess:
            pass  # the root process already ended; the peak so far stands

    def _run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            try:
                self.sample_once()
            except psutil.NoSuchProcess:
                return  # the root process ended; keep the peak measured so far

    def __enter__(self) -> PeakMemorySampler:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
