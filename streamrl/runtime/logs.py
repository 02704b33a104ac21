"""One place for the logs of every role: `RUN_DIR/logs/<role>.log`, plus `controller.log`.

```
 role actor (any node)                          driver's node
 logging ─► RoleLogHandler ─(batches, every 0.2 s)─► log sink actor ─► RUN_DIR/logs/rollout-1.log
 controller (driver process) ─► FileHandler ────────────────────────► RUN_DIR/logs/controller.log
```

A role's records travel to the driver's node through Ray (a role on another node cannot write
into the run directory, which lives on the driver's disk), to an actor pinned there that appends
them to the role's file. Replicas get their own file (`rollout#1` -> `rollout-1.log`); a restarted
role appends to its predecessor's file, after a `started` line naming its process, so one file
tells a role's whole story. A process that is SIGKILLed loses at most its last 0.2 s of records
(the rest of its stderr stays in Ray's own worker logs).

The handler keeps warnings on stderr as well, so they still reach the driver's console through
Ray. `streamrl logs RUN_DIR [ROLE] [-n N]` prints the tail of one file or of all of them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from pathlib import Path

LOGS_DIR = "logs"
CONTROLLER = "controller"
FORMAT = "%(asctime)s %(levelname)s [pid %(process)d] %(name)s: %(message)s"
FLUSH_S = 0.2


def log_path(run_dir: Path, name: str) -> Path:
    """`rollout#1` -> RUN_DIR/logs/rollout-1.log (no `#` in file names, which shells dislike)."""
    return Path(run_dir) / LOGS_DIR / f"{name.replace('#', '-')}.log"


def list_logs(run_dir: Path) -> list[Path]:
    folder = Path(run_dir) / LOGS_DIR
    return sorted(folder.glob("*.log")) if folder.is_dir() else []


def tail(path: Path, num_lines: int) -> list[str]:
    """The last `num_lines` lines of `path` (read in one pass; log files stay small)."""
    with path.open(encoding="utf-8", errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=num_lines)]


# -- the driver's side -------------------------------------------------------------------------


def attach_controller_log(run_dir: Path) -> logging.Handler:
    """Copy this process's log records (streamrl's from INFO, others' from WARNING) into
    RUN_DIR/logs/controller.log; returns the handler for `detach`."""
    path = log_path(run_dir, CONTROLLER)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.setLevel(logging.INFO)
    _record_streamrl_info()
    logging.getLogger().addHandler(handler)
    return handler


def log_failure(
    handler: logging.Handler, message: str, logger: str = "streamrl.runtime.controller"
) -> None:
    """Write `message` and the exception being handled to `handler` alone, not the console
    (which gets a one-line reason, or the traceback when it reaches the top)."""
    record = logging.LogRecord(logger, logging.ERROR, __file__, 0, message, None, sys.exc_info())
    handler.handle(record)


def detach(handler: logging.Handler) -> None:
    logging.getLogger().removeHandler(handler)
    handler.close()


def _record_streamrl_info() -> None:
    """Let streamrl's INFO records through when nobody chose a level for them."""
    logger = logging.getLogger("streamrl")
    if logger.level == logging.NOTSET and logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


class _LogSinkActor:
    """Ray actor body on the driver's node: appends lines to the roles' files."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)

    def write(self, name: str, lines: list[str]) -> None:
        with log_path(self.run_dir, name).open("a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))


def start_log_sink(run_dir: Path):
    """The sink actor, pinned to this (the driver's) node, where the run directory is."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(num_cpus=0, scheduling_strategy=here)(_LogSinkActor)
    return actor.remote(str(Path(run_dir).resolve()))


# -- a role's side -------------------------------------------------------------------------------


class RoleLogHandler(logging.Handler):
    """Buffers a role process's formatted records and ships them to the sink in batches."""

    def __init__(self, sink, name: str, flush_s: float = FLUSH_S) -> None:
        super().__init__(level=logging.INFO)
        self.setFormatter(logging.Formatter(FORMAT))
        self.sink = sink
        self.role_name = name
        self.flush_s = flush_s
        self._lines: list[str] = []
        self._buffer_lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="role-log", daemon=True)
        self._thread.start()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - logging must never break the role
            self.handleError(record)
            return
        with self._buffer_lock:
            self._lines.append(line)

    def _loop(self) -> None:
        while not self._closed.wait(self.flush_s):
            self.flush()

    def flush(self, wait_s: float = 0.0) -> None:
        """Send what is buffered; `wait_s` > 0 waits that long for the sink to write it."""
        with self._buffer_lock:
            lines, self._lines = self._lines, []
        if not lines:
            return
        ref = self.sink.write.remote(self.role_name, lines)
        if wait_s > 0:
            import ray

            try:
                ray.get(ref, timeout=wait_s)
            except Exception as e:  # noqa: BLE001 - the sink is gone at shutdown: nothing to do
                print(f"role log sink unavailable: {e}", file=sys.stderr)

    def close(self) -> None:
        self._closed.set()
        self.flush(wait_s=5.0)
        super().close()


def attach_role_log(sink, name: str) -> RoleLogHandler:
    """In a role's process: its records go to RUN_DIR/logs/<name>.log, warnings also to
    stderr (Ray forwards them to the driver's console)."""
    root = logging.getLogger()
    handler = RoleLogHandler(sink, name)
    root.addHandler(handler)
    if not any(type(h) is logging.StreamHandler for h in root.handlers):
        # Adding a handler turns off logging's last-resort stderr output: keep it explicitly.
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(logging.WARNING)
        console.setFormatter(logging.Formatter(f"%(levelname)s {name} %(name)s: %(message)s"))
        root.addHandler(console)
    _record_streamrl_info()
    return handler


def supervisor_line(failure: str, action: str) -> str:
    """An event of the supervisor, as written into the role's own file."""
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"{when} SUPERVISOR {failure} -> {action}"
