"""The files a Ray-mode run keeps about its roles: `roles.json` (where each role runs, its health
and restarts; rewritten by the supervisor) and `events.jsonl` (every failure and what was done).

`live_pid` and `kill_job_process` are what fault injection needs (the chaos test, the fault
tests, `benchmarks/soak.py`): find a role's or service's live process, and kill it only if it
still belongs to the job."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

STATUS_FILE = "roles.json"
EVENTS_FILE = "events.jsonl"


def read_status(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATUS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a Ray-mode run directory?")
    return json.loads(path.read_text())


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / EVENTS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def live_pid(run_dir: Path, name: str) -> int | None:
    """The pid of role `name`, or of service `name` (a bus shard `bus#<k>`, the weight store
    `weights`), while `roles.json` says it is healthy; None before it started, while it restarts,
    or before the run wrote the file (what a test or a soak waits on before it kills one)."""
    try:
        status = json.loads((run_dir / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    info = status.get("roles", {}).get(name) or status.get("services", {}).get(name)
    return info["pid"] if info and info.get("healthy") else None


def kill_job_process(job_pid: int, pid: int | None) -> int | None:
    """SIGKILL `pid` if it is a descendant of the job's process `job_pid`, through a pidfd (a
    stale pid that now names another process, or a thread id, is never signalled). Returns
    `pid` when it was signalled, else None."""
    import psutil

    if pid is None:
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None  # gone, or a thread id: not a process of the job
    try:
        if pid not in {child.pid for child in psutil.Process(job_pid).children(recursive=True)}:
            return None
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None
    finally:
        os.close(pidfd)
    return pid
