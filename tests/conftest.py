"""Suite-wide: the longest test files first, no deadline on hypothesis' examples, and the pytest
process ended with pytest's own exit status, skipping the interpreter's teardown of native
libraries.

The pytest process hosts Ray sessions itself (the bus contract and weight-store tests) and
vLLM's CPU engine. After `ray.shutdown()`, threads of Ray's GCS client and core worker and of
gRPC stay alive (`gcs_client_io_s`, `worker.io`, `grpc_global_tim`, `event_engine`, listed from
`/proc/self/task` at the end of a run), and the C++ static destructors that run when the
process exits can race them. CI saw this once: "645 passed", then abseil's
`mutex.cc: RAW: thread should hold at least a read lock on Mutex` and SIGABRT, exit 134, with
every test passed. By the time `pytest_unconfigure` runs, the result is decided and reported, so
the process exits there with that result. The CLI that users run is not affected by this hook:
the integration tests run it in subprocesses and check its exit status.
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

# No Ray call in this process starts Ray by itself. The pytest workers host Ray sessions (the bus,
# weight-channel and weight-store tests); a thread a test left running that calls Ray after
# `ray.shutdown()` would otherwise start a new local instance from that thread, whose processes
# die with the thread, and a minute later Ray ends the worker with exit status 1 ("node down:
# Not properly terminated", in whatever test runs then). Ray reads this when it is imported.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")

# OpenMP threads sleep instead of spinning while they wait, in this process and in every process
# it starts (the CLI runs, Ray's workers, vLLM's engine cores): set before anything loads torch's
# OpenMP runtime, which reads it once. The two xdist workers each run two-thread torch processes
# on two cores; with OpenMP's default spin-waiting each waiting thread burns the core the other
# needs. Measured on the 2-core CI machine: two 200-step warm starts side by side took 365 s each
# spinning, 47 s each with PASSIVE (one alone: 32 s spinning, 39 s PASSIVE); CI once timed out a
# 20-minute job that takes 84 s on a quiet machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if "torch" in sys.modules:  # too late for this process: its OpenMP runtime already read it
    print("tests/conftest.py: torch was imported before OMP_WAIT_POLICY was set", file=sys.stderr)

_exit_status: int | None = None

# No time limit on a property test's examples: the project's tests assert no timings (benchmarks
# measure those), and on a shared 2-core machine a first example that loads a chat template took
# 663 ms against hypothesis' 200 ms default deadline, failing a test that is correct.
settings.register_profile("streamrl", deadline=None)
settings.load_profile("streamrl")

# The longest test files, longest first (CI's `--durations` on a slow 2-core machine: each of
# these holds a test of 100-750 s, most of them whole training jobs). They run before everything
# else: with two xdist workers the suite ends when its last long test ends, and a worker that
# runs out of work steals from the end of the other's queue, so the short tests fill in at the
# end instead of one long test running alone there. A new learning test of minutes belongs here.
LONGEST_FIRST = (
    "integration/test_judge_demo.py",
    "integration/test_agent_calculator.py",
    "integration/test_video_task.py",
    "integration/test_moe_demo.py",
    "integration/test_audio_task.py",
    "integration/test_vision_demo.py",
    "integration/test_vllm_engine.py",
    "integration/test_cluster.py",
    "integration/test_demo_learns.py",
    "integration/test_faults.py",
    "integration/test_collective_channel.py",
    "integration/test_kill_resume.py",
    "integration/test_presets.py",
    "integration/test_bf16_learns.py",
    "integration/test_fsdp_trainer.py",
    "integration/test_weight_channel.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next(
            (i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST)
        )

    items.sort(key=rank)  # stable: each file's tests, and the rest, keep their order


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _exit_status is None or hasattr(config, "workerinput"):  # no session, or an xdist worker
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
