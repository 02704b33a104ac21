"""Running reward functions in a separate worker process with a timeout and resource limits.

A reward function is user code and sees untrusted model output: it may raise, hang or eat memory.
The scorer starts `python -m streamrl.reward.worker` (its own interpreter: nothing of the
caller's main module runs there), sends each task as a JSON line over its stdin and waits for
the result at most `timeout_s`. A worker that overruns is killed and restarted and its sample
marked `timeout`. An exception inside the function comes back as
`infra_error`. JSON, not pickle, crosses the pipe.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from streamrl.api.reward import RewardResult

# How long a new worker may take to import the reward's module.
_STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ScoreTask:
    response: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)


class SandboxedScorer:
    """Scores batches in a child process; one instance per reward role."""

    def __init__(self, fn_path: str, *, timeout_s: float, memory_limit_gb: float = 4.0):
        from streamrl.reward.scoring import resolve_callable

        resolve_callable(fn_path)  # fail fast, in the caller, on a bad path
        self.fn_path = fn_path
        self.timeout_s = timeout_s
        self.memory_limit_bytes = int(memory_limit_gb * 2**30)
        self.num_restarts = 0
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def _start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "streamrl.reward.worker",
            self.fn_path,
            str(self.memory_limit_bytes),
        ]
        # A session of its own: a Ctrl-C in the terminal (a graceful stop of the run) must not
        # kill the worker mid-task. It exits when its stdin closes, whatever ends the caller.
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
            start_new_session=True,
        )
        self._buffer = b""
        # The worker says "ready" once it has imported the reward function; only then do
        # per-task timeouts start, so a slow import is never mistaken for a hanging reward.
        ready = self._read_line(_STARTUP_TIMEOUT_S)
        if ready != b"ready":
            self._kill()
            raise RuntimeError(
                f"reward worker for {self.fn_path!r} did not start within {_STARTUP_TIMEOUT_S}s"
            )

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._proc = None
        self.num_restarts += 1

    def _read_line(self, timeout_s: float) -> bytes | None:
        """One line from the worker, or None on timeout or if the worker died."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def score(self, tasks: Sequence[ScoreTask]) -> list[RewardResult]:
        """Score `tasks` in order. One task is in the pipe at a time, so neither pipe can fill
        up, and each task gets exactly `timeout_s`."""
        results: list[RewardResult] = []
        for task in tasks:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            try:
                self._proc.stdin.write(json.dumps(asdict(task)).encode() + b"\n")
                line = self._read_line(self.timeout_s)
            except BrokenPipeError:
                line = None
            if line is None:
                died = self._proc.poll() is not None
                reason = "reward worker died" if died else f"reward took over {self.timeout_s}s"
                results.append(RewardResult(None, "infra_error" if died else "timeout", reason))
                self._kill()
                continue
            value, status, reason, components = json.loads(line)
            results.append(RewardResult(value, status, reason, components))
        return results

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.close()  # the worker exits at end of input
                self._proc.wait(timeout=2)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
        self._proc = None
