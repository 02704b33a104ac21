"""Changing a running job from outside: how many replicas of a role it runs, and stopping it.

`streamrl scale RUN_DIR rollout=3` (or `set_replicas(run_dir, "rollout", 3)` from Python) writes
the request to `control.json` in the run directory; the supervisor of the live run reads it on
its next check, starts new replicas (they pull the current weights and claim work at once) or
drains surplus ones (a replica finishes the rows it holds, then stops: nothing is lost).

`streamrl stop RUN_DIR` (`request_stop`) asks the run to end after the step it is training: the
trainer evaluates, writes a checkpoint and the summary as at a planned end, and
`streamrl train --resume RUN_DIR` later continues from there to `trainer.steps`. A run clears
the request when it starts, so a resumed run does not stop at once. Ctrl-C in the terminal of a
training run asks the same (`stop_on_interrupt`); a second Ctrl-C stops it at once.

`hold_run_dir` keeps a second job out of a live run's directory (an accidental `--resume` of
a run still training, say): both would write its checkpoints and logs.

Ray-free, so the commands start in a blink.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from streamrl.config.schema import SCALABLE_ROLES

log = logging.getLogger(__name__)

CONTROL_FILE = "control.json"


LOCK_FILE = ".lock"


class RunDirInUse(RuntimeError):
    """Another live job holds this run directory."""


def hold_run_dir(run_dir: Path) -> IO[str]:
    """Lock `run_dir` for this job until the returned file is closed or the process ends, however
    it ends (a POSIX record lock: the kernel drops it with the process, and forked children, such
    as a reward sandbox, do not inherit it). Raises `RunDirInUse` while another job holds it.
    A POSIX lock also ends when its process closes any descriptor of the file: `live_job` is
    for other processes (the CLI's `status` and `stop`), never the job itself."""
    lock = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held for the run's lifetime
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise RunDirInUse(
            f"{run_dir} is in use by a running job (pid {holder}); `streamrl stop {run_dir}` "
            "ends it after its current step"
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def live_job(run_dir: Path) -> int | None:
    """The pid of the job holding `run_dir`, or None when no live job does."""
    path = run_dir / LOCK_FILE
    if not path.is_file():
        return None
    with open(path, "a+") as probe:
        try:
            fcntl.lockf(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            probe.seek(0)
            holder = probe.read().strip()
            return int(holder) if holder.isdigit() else -1
        fcntl.lockf(probe, fcntl.LOCK_UN)
        return None


def set_replicas(run_dir: Path, role: str, replicas: int) -> None:
    if role not in SCALABLE_ROLES:
        raise ValueError(f"cannot scale {role!r}: only {', '.join(SCALABLE_ROLES)} have replicas")
    if replicas < 1:
        raise ValueError(
            f"replicas must be >= 1, got {replicas} (`streamrl stop RUN_DIR` stops the run)"
        )
    check_run_dir(run_dir)
    control = _read(run_dir)
    control.setdefault("replicas", {})[role] = replicas
    _write(run_dir, control)


def read_requests(run_dir: Path) -> dict[str, int]:
    """The replica counts requested so far ({} when nothing was asked)."""
    return {k: int(v) for k, v in _read(run_dir).get("replicas", {}).items()}


def request_stop(run_dir: Path) -> None:
    """Ask the run in `run_dir` to end, with a checkpoint, after the step it is training."""
    check_run_dir(run_dir)
    control = _read(run_dir)
    control["stop"] = True
    _write(run_dir, control)


def stop_requested(run_dir: Path) -> bool:
    """Checked by the trainer after every step (one `stat` while no control file exists)."""
    return (run_dir / CONTROL_FILE).exists() and bool(_read(run_dir).get("stop"))


def clear_stop(run_dir: Path) -> None:
    """A run starting (or resuming) forgets an earlier stop request."""
    control = _read(run_dir)
    if control.pop("stop", None) is not None:
        _write(run_dir, control)


@contextlib.contextmanager
def stop_on_interrupt(run_dir: Path) -> Iterator[None]:
    """While in this block, a first SIGINT (Ctrl-C) asks the run to stop after its current step,
    as `streamrl stop` does; a second raises KeyboardInterrupt as usual. Only in the main
    thread (where Python delivers signals); elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def first_interrupt(signum, frame) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the next one interrupts
        request_stop(run_dir)
        log.warning(
            "Ctrl-C: stopping after the current step, with a checkpoint (Ctrl-C again to stop "
            "at once; `streamrl train --resume %s` continues either way)",
            run_dir,
        )

    signal.signal(signal.SIGINT, first_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def check_run_dir(run_dir: Path) -> None:
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a streamrl run directory (no config.yaml)")


def _read(run_dir: Path) -> dict[str, Any]:
    path = run_dir / CONTROL_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _write(run_dir: Path, control: dict[str, Any]) -> None:
    tmp = run_dir / (CONTROL_FILE + ".tmp")
    tmp.write_text(json.dumps(control))
    os.replace(tmp, run_dir / CONTROL_FILE)  # readers see the old file or the new, never half
