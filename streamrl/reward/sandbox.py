"""Scoring with a reward function that runs in sandboxed worker processes, under a deadline.

A reward function is user code and sees untrusted model output: it may raise, hang, print, eat
memory or try to reach what it should not. `SandboxedScorer` keeps `num_workers` persistent
worker processes (`python -m streamrl.reward.worker`), each in a sandbox of
`streamrl.reward.isolation` started once, and scores a batch across them, one frame of tasks per
worker at a time:

    score(tasks) ──{id, tasks}──► worker 0 ──{id, results: [{value, status, ...}]}──► check ──► results
                 ──{id, tasks}──► worker 1 ──{id, results}─────────────────────────► check
                 (one socket per worker; the reward's stdout/stderr ──► this process's log)

The reward functions (`streamrl.reward.forms`: streamrl's, TRL's or veRL's form, sync or async,
one or several with weights) are recognised here, in the caller, before any worker starts. A
frame holds one task when every function is called once a sample and is sync (a hang then costs
only its own sample), else up to `batch_size` tasks, split evenly over the workers: a TRL-style
function is called once for the frame, an async one awaited concurrently over it.

- Results travel on a private channel (a socket passed to the worker), tagged with their task's
  id: what the reward prints never reaches them. A result frame larger than `MAX_RESULT_BYTES`
  (and `RESULT_BYTES_PER_TASK` a task past the first) is refused (`infra_error`) unread.
- Each call has one deadline, `timeout_s`: a frame's deadline, from sending it to its whole
  result, is `timeout_s` for each call of a function it makes; past it the worker's process
  group (under `namespaces`, its PID namespace) is killed, the frame's samples marked `timeout`,
  and a fresh worker started when there is work for it.
- Every result is checked here, whatever the worker sent: one a task, a known status, a finite
  number when the status is `ok`, finite components, a reason cut to size; anything else is
  `infra_error` with the reason.
- The reward's output is logged (logger `streamrl.reward.worker`, INFO), each line cut to
  `MAX_LOG_LINE` bytes and at most `MAX_LOGGED_BYTES` per worker.

JSON, not pickle, crosses the channel.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.api.reward import RewardResult
from streamrl.reward.isolation import IsolationUnavailable, Level, Limits, Sandbox
from streamrl.reward.worker import HEADER, MAX_COMPONENTS, MAX_NAME_CHARS, MAX_REASON_CHARS, encode

if TYPE_CHECKING:
    from streamrl.config.schema import RewardConfig

STATUSES = ("ok", "invalid_output", "timeout", "infra_error")
MAX_RESULT_BYTES = 1 << 20
RESULT_BYTES_PER_TASK = 1 << 16
MAX_LOG_LINE = 2000
MAX_LOGGED_BYTES = 1 << 20
# How long a new worker may take to start its sandbox and import the reward's module.
_STARTUP_TIMEOUT_S = 60.0

log = logging.getLogger(__name__)
output_log = logging.getLogger("streamrl.reward.worker")


@dataclass(frozen=True)
class ScoreTask:
    response: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)
    prompt: str | list[dict[str, Any]] | None = None
    """The prompt (TRL-style rewards get it as `prompts`); None where the caller has none."""
    completion_ids: list[int] | None = None
    """The response's token ids (TRL-style rewards' `completion_ids`)."""


def checked(message: Any) -> RewardResult:
    """The worker's result as a RewardResult, or an `infra_error` saying what was wrong with it."""
    if not isinstance(message, dict):
        return RewardResult(None, "infra_error", f"the reward worker sent {type(message).__name__}")
    status, value = message.get("status"), message.get("value")
    reason = message.get("reason", "")
    reason = reason[:MAX_REASON_CHARS] if isinstance(reason, str) else ""
    if status not in STATUSES:
        return RewardResult(None, "infra_error", f"reward returned the unknown status {status!r}")
    parts = message.get("components", {})
    components = {
        str(name)[:MAX_NAME_CHARS]: float(v)
        for name, v in list(parts.items() if isinstance(parts, dict) else ())[:MAX_COMPONENTS]
        if _is_number(v) and math.isfinite(v)
    }
    if status != "ok":
        return RewardResult(None, status, reason, components)
    if not _is_number(value) or not math.isfinite(value):
        shown = value if _is_number(value) or value is None else str(value)[:40]
        return RewardResult(None, "infra_error", f"reward returned {shown} with status ok")
    return RewardResult(float(value), "ok", reason, components)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def import_roots(fn_path: str | Sequence[str]) -> list[str]:
    """The directories a worker imports from: those holding the rewards' top-level packages,
    the one holding streamrl, then the caller's PYTHONPATH."""
    paths = [fn_path] if isinstance(fn_path, str) else list(fn_path)
    modules = [p.partition(":")[0] if ":" in p else p.rpartition(".")[0] for p in paths]
    roots: list[str] = []
    for top in dict.fromkeys([*(m.split(".")[0] for m in modules), "streamrl"]):
        spec = importlib.util.find_spec(top)
        if spec is None:
            continue
        if spec.submodule_search_locations:
            roots += [str(Path(p).parent) for p in spec.submodule_search_locations]
        elif spec.origin and os.path.isabs(spec.origin):
            roots.append(str(Path(spec.origin).parent))
    return roots + os.environ.get("PYTHONPATH", "").split(os.pathsep)


class _OutputLog(threading.Thread):
    """Reads a worker's stdout and stderr (the reward's prints, the sandbox's own errors) and
    logs each line, within budget; keeps the last lines for start-up errors."""

    def __init__(self, pipe, name: str):
        super().__init__(name=f"{name}-output", daemon=True)
        self.pipe, self.label = pipe, name
        self.tail: deque[str] = deque(maxlen=20)
        self._line = bytearray()
        self._cut = 0
        self._logged = 0

    def run(self) -> None:
        with self.pipe:
            while chunk := os.read(self.pipe.fileno(), 1 << 16):
                start = 0
                while (end := chunk.find(b"\n", start)) >= 0:
                    self._add(chunk[start:end])
                    self._emit()
                    start = end + 1
                self._add(chunk[start:])
        if self._line or self._cut:
            self._emit()

    def _add(self, piece: bytes) -> None:
        room = MAX_LOG_LINE - len(self._line)
        self._line += piece[:room]
        self._cut += max(0, len(piece) - room)

    def _emit(self) -> None:
        line = self._line.decode(errors="replace")
        if self._cut:
            line += f"... ({self._cut} bytes more)"
        self._line, self._cut = bytearray(), 0
        self.tail.append(line)
        if self._logged < MAX_LOGGED_BYTES:
            self._logged += len(line)
            output_log.info("%s: %s", self.label, line)
            if self._logged >= MAX_LOGGED_BYTES:
                output_log.warning(
                    "%s: over %d bytes of output; the rest is not logged",
                    self.label,
                    MAX_LOGGED_BYTES,
                )


@dataclass(eq=False)
class _Worker:
    """One worker process and where it stands: starting (not ready), idle, or busy with the
    tasks at `positions` until `deadline`."""

    proc: subprocess.Popen
    channel: socket.socket
    output: _OutputLog
    deadline: float
    ready: bool = False
    positions: list[int] | None = None
    task_id: int = -1
    buffer: bytearray = field(default_factory=bytearray)

    @property
    def active(self) -> bool:
        return not self.ready or self.positions is not None


class SandboxedScorer:
    """Scores batches in sandboxed worker processes; one instance per reward role (or
    evaluator). Workers start at the first call and are restarted after a timeout or death."""

    def __init__(
        self,
        fn_path: str | Sequence[str],
        *,
        timeout_s: float,
        sandbox: Level = "namespaces",
        require_sandbox: bool = True,
        num_workers: int = 1,
        limits: Limits | None = None,
        cpu_limit_s: float | None = None,
        weights: Sequence[float] | None = None,
        style: str = "auto",
        conversational: bool = False,
        batch_size: int = 256,
    ):
        from streamrl.reward.forms import RewardFunction, check_reward_signature, names_of
        from streamrl.reward.scoring import resolve_callable

        paths = [fn_path] if isinstance(fn_path, str) else list(fn_path)
        if not paths:
            raise ValueError("no reward function given")
        if weights is not None and len(weights) != len(paths):
            raise ValueError(f"{len(weights)} weight(s) for {len(paths)} reward function(s)")
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        weights = [1.0] * len(paths) if weights is None else [float(w) for w in weights]
        # Fail fast, in the caller, on a bad path or a function called in no known form.
        self.functions = [
            RewardFunction(fn, check_reward_signature(fn, path, style), name, weight)
            for path, name, weight in zip(paths, names_of(paths), weights, strict=True)
            for fn in (resolve_callable(path),)
        ]
        self.spec = {
            "functions": [
                {"path": p, "style": f.style, "weight": f.weight, "name": f.name}
                for p, f in zip(paths, self.functions, strict=True)
            ],
            "conversational": conversational,
        }
        self.batched = any(f.batched for f in self.functions)
        self.batch_size = batch_size
        self.fn_path = paths[0] if len(paths) == 1 else ", ".join(paths)
        self.timeout_s = timeout_s
        self.cpu_limit_s = cpu_limit_s or timeout_s
        self.num_restarts = 0
        try:
            self.sandbox = Sandbox(
                sandbox, limits=limits, pythonpath=import_roots(paths), require=require_sandbox
            )
        except IsolationUnavailable as e:
            raise IsolationUnavailable(
                f"reward.sandbox={sandbox}: {e}. To run with less isolation, set "
                "reward.sandbox=process (or none), or reward.require_sandbox=false to fall back "
                "to the strongest level available"
            ) from None
        self.isolation = self.sandbox.isolation
        log.info(
            "reward %s (%s): %s; per call: %g s wall, %g CPU-s; %d worker(s)",
            self.fn_path,
            ", ".join(
                f.style + (" async" if f.batched and f.style != "trl" else "")
                for f in self.functions
            ),
            self.isolation.describe(),
            timeout_s,
            self.cpu_limit_s,
            num_workers,
        )
        self._workers: list[_Worker | None] = [None] * num_workers
        self._next_id = 0

    @classmethod
    def from_config(cls, cfg: RewardConfig) -> SandboxedScorer:
        """The scorer of the `reward` config section."""
        limits = Limits(
            memory_bytes=int(cfg.memory_limit_gb * 2**30),
            max_processes=cfg.max_processes,
            max_file_bytes=int(cfg.max_file_size_mb * 2**20),
            max_open_files=cfg.max_open_files,
        )
        return cls(
            cfg.functions,
            weights=cfg.weights,
            style=cfg.style,
            conversational=cfg.conversational,
            batch_size=cfg.batch_size,
            timeout_s=cfg.timeout_s,
            sandbox=cfg.sandbox,
            require_sandbox=cfg.require_sandbox,
            num_workers=cfg.num_workers,
            limits=limits,
            cpu_limit_s=cfg.cpu_limit_s,
        )

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def score(self, tasks: Sequence[ScoreTask]) -> list[RewardResult]:
        """Score `tasks` across the workers; the results in the tasks' order. Raises
        RuntimeError when a worker cannot start (the reward's module fails to import, say)."""
        results: list[RewardResult | None] = [None] * len(tasks)
        todo = deque(self._frames(len(tasks)))
        try:
            while todo or any(w is not None and w.positions is not None for w in self._workers):
                self._dispatch(todo, tasks, results)
                self._wait(results)
        except BaseException:
            # A worker that could not start (or an interrupt): no task stays in flight into the
            # next call.
            for slot, worker in enumerate(self._workers):
                if worker is not None and worker.active:
                    self._kill(slot, worker, restart=False)
            raise
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _frames(self, n: int) -> list[list[int]]:
        """The tasks' positions in frames: one a frame, or for batched functions up to
        `batch_size` a frame, spread evenly over the workers."""
        size = 1
        if self.batched:
            size = max(1, min(self.batch_size, math.ceil(n / self.num_workers)))
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]

    def _calls(self, num_tasks: int) -> int:
        """Calls of a function a frame of `num_tasks` tasks makes (each has `timeout_s`)."""
        return sum(1 if f.batched else num_tasks for f in self.functions)

    def _dispatch(self, todo: deque[list[int]], tasks, results) -> None:
        """Hand the next tasks to idle workers; start workers for tasks no worker will take."""
        starting = sum(1 for w in self._workers if w is not None and not w.ready)
        for slot, worker in enumerate(self._workers):
            idle = worker is not None and worker.ready and worker.positions is None
            if idle and worker.proc.poll() is not None:
                self._kill(slot, worker, restart=True)  # died while idle
                worker = None
            if worker is None and len(todo) > starting:
                self._workers[slot] = self._start(slot)
                starting += 1
            elif worker is not None and worker.ready and worker.positions is None and todo:
                self._send(slot, worker, todo.popleft(), tasks, results)

    def close(self) -> None:
        """Stop the workers: each exits at the end of its channel, or is killed after 2 s."""
        for slot, worker in enumerate(self._workers):
            if worker is None:
                continue
            worker.channel.close()
            try:
                worker.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                Sandbox.kill(worker.proc)
            self._workers[slot] = None
        self.sandbox.close()

    # -- workers ----------------------------------------------------------------------------

    def _start(self, slot: int) -> _Worker:
        ours, theirs = socket.socketpair()
        spec = json.dumps(self.spec)
        argv = [sys.executable, "-P", "-m", "streamrl.reward.worker", spec]
        argv += ["--channel", str(theirs.fileno()), "--cpu-per-call", str(self.cpu_limit_s)]
        if self.isolation.on("pid namespace"):
            argv += ["--end-leftovers", os.readlink("/proc/self/ns/pid")]
        with theirs:
            proc = self.sandbox.popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=[theirs.fileno()],
            )
        output = _OutputLog(proc.stdout, f"reward worker {slot}")
        output.start()
        ours.setblocking(False)
        return _Worker(proc, ours, output, deadline=time.monotonic() + _STARTUP_TIMEOUT_S)

    def _send(self, slot, worker, positions, tasks, results) -> None:
        self._next_id += 1
        worker.task_id, worker.positions = self._next_id, positions
        worker.deadline = time.monotonic() + self.timeout_s * self._calls(len(positions))
        batch = [asdict(tasks[p]) for p in positions]
        frame = encode({"id": worker.task_id, "tasks": batch})
        try:
            worker.channel.settimeout(self.timeout_s)
            worker.channel.sendall(frame)  # the worker reads it at once: it is idle
        except TimeoutError:
            self._fail(slot, worker, results, "timeout", self._took_over(worker))
        except OSError:
            self._fail(slot, worker, results, "infra_error", self._death(worker))
        else:
            worker.channel.setblocking(False)

    def _took_over(self, worker: _Worker) -> str:
        n = len(worker.positions or [0])
        calls = self._calls(n)
        if n == 1 and calls == 1:
            return f"reward took over {self.timeout_s}s"
        return (
            f"reward took over {self.timeout_s * calls:g}s for a batch of {n} sample(s) "
            f"({calls} call(s) of {self.timeout_s:g}s)"
        )

    def _wait(self, results: list[RewardResult | None]) -> None:
        """Wait for the first frame or deadline among the active workers and handle what came."""
        active = [(slot, w) for slot, w in enumerate(self._workers) if w is not None and w.active]
        if not active:
            return
        wait_s = max(0.0, min(w.deadline for _, w in active) - time.monotonic())
        readable, _, _ = select.select([w.channel for _, w in active], [], [], wait_s)
        for slot, worker in active:
            if worker.channel in readable:
                self._read(slot, worker, results)
            if self._workers[slot] is worker and worker.active:
                if time.monotonic() >= worker.deadline:
                    self._overrun(slot, worker, results)

    def _read(self, slot: int, worker: _Worker, results: list[RewardResult | None]) -> None:
        try:
            chunk = worker.channel.recv(1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self._fail(slot, worker, results, "infra_error", self._death(worker))
            return
        worker.buffer += chunk
        while len(worker.buffer) >= HEADER.size and self._workers[slot] is worker:
            (size,) = HEADER.unpack_from(worker.buffer)
            cap = MAX_RESULT_BYTES + RESULT_BYTES_PER_TASK * (len(worker.positions or [0]) - 1)
            if size > cap:
                reason = f"the reward worker sent a result of {size} bytes (the cap is {cap})"
                self._fail(slot, worker, results, "infra_error", reason)
                return
            if len(worker.buffer) < HEADER.size + size:
                return
            body = bytes(worker.buffer[HEADER.size : HEADER.size + size])
            del worker.buffer[: HEADER.size + size]
            try:
                message = json.loads(body)
            except ValueError:
                self._fail(slot, worker, results, "infra_error", "the reward worker sent bad JSON")
                return
            self._handle(slot, worker, message, results)

    def _handle(self, slot, worker, message, results) -> None:
        if not worker.ready:
            if isinstance(message, dict) and "ready" in message:
                worker.ready = True
                return
            self._kill(slot, worker, restart=False)
            error = message.get("error") if isinstance(message, dict) else None
            raise RuntimeError(self._startup_error(worker, error or f"it sent {message!r:.200}"))
        if not isinstance(message, dict) or message.get("id") != worker.task_id:
            reason = "the reward worker sent a result for another task"
            self._fail(slot, worker, results, "infra_error", reason)
            return
        positions, sent = worker.positions, message.get("results")
        if not isinstance(sent, list) or len(sent) != len(positions):
            shown = f"{len(sent)} results" if isinstance(sent, list) else type(sent).__name__
            reason = f"the reward worker sent {shown} for {len(positions)} task(s)"
            self._fail(slot, worker, results, "infra_error", reason)
            return
        for position, result in zip(positions, sent, strict=True):
            results[position] = checked(result)
        worker.positions = None

    def _overrun(self, slot, worker, results) -> None:
        if not worker.ready:
            self._kill(slot, worker, restart=False)
            raise RuntimeError(
                self._startup_error(worker, f"it did not start within {_STARTUP_TIMEOUT_S}s")
            )
        self._fail(slot, worker, results, "timeout", self._took_over(worker))

    def _fail(self, slot, worker, results, status: str, reason: str) -> None:
        """The tasks in flight get `status`; the worker is killed (restarted when needed)."""
        if not worker.ready:
            self._kill(slot, worker, restart=False)
            raise RuntimeError(self._startup_error(worker, reason))
        for position in worker.positions or ():
            results[position] = RewardResult(None, status, reason)  # type: ignore[arg-type]
        self._kill(slot, worker, restart=True)

    def _kill(self, slot: int, worker: _Worker, *, restart: bool) -> None:
        Sandbox.kill(worker.proc)
        worker.channel.close()
        self._workers[slot] = None
        self.num_restarts += restart

    def _death(self, worker: _Worker) -> str:
        try:
            code = worker.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            return "reward worker died (its result channel closed)"
        return f"reward worker died (exit status {code})"

    def _startup_error(self, worker: _Worker, what: str) -> str:
        worker.output.join(timeout=1)
        output = " | ".join(worker.output.tail)
        hint = ""
        as_nobody = self.isolation.mechanisms.get("unprivileged user", "").startswith("on (uid")
        if as_nobody and any(s in what for s in ("Permission denied", "No module named")):
            hint = (
                " (the sandbox runs it as nobody: its module's files and directories must be "
                "readable by others, chmod o+rX)"
            )
        return f"reward worker for {self.fn_path!r} could not start: {what}{hint}" + (
            f"; its output: {output[-2000:]}" if output else ""
        )
