"""The `python` tool: runs model-written Python in the reward sandbox, one fresh process a call.

    python_tool(...) ──► Tool "python"(code) ──► PythonRunner ──► Sandbox(level).popen(
        python -I -u -B -   (the code on stdin; stdout, stderr to unlinked files out here)
    ) ──► "exit status N\\nstdout:\\n...\\nstderr:\\n..."  (cut to `max_output_chars`)

The isolation is `streamrl.reward.isolation`'s, level for level: under `namespaces` (the
default) the code has no network, a read-only filesystem with homes hidden, a private /tmp as its
working directory, its own PID namespace, the user nobody when the caller is root, the seccomp
filter, and resource limits (memory, processes, file size, CPU seconds); `process` keeps the
limits and a scrubbed environment in a private temporary directory; `none` is for debugging.
`PythonRunner.isolation_level()` is the same line the reward sandbox logs at start-up, and it is
logged when the tool is made. A level the machine cannot give is refused (IsolationUnavailable)
unless `require_sandbox=False`, which falls back to the strongest one that works.

Nothing is kept between calls: each starts a new interpreter in a new temporary directory, and
when the call ends (its process exited, ran past `timeout_s`, or the call was cancelled) its
process group is killed, which under `namespaces` takes its PID namespace, and every process
the code started, down with it. A call past `timeout_s` is an error result (reason "timeout")
that says so and shows what the code printed before it was killed.

RLIMIT_NPROC counts the processes of a user machine-wide: under `namespaces` started by root,
every concurrent call runs as nobody and shares one `max_processes`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import shutil
import signal
import sys
import tempfile
import time
from typing import IO

from streamrl.agents.tools import Tool, ToolInfraError, ToolTimeout
from streamrl.reward.isolation import IsolationUnavailable, Level, Limits, Sandbox

DESCRIPTION = (
    "Run a Python program in a fresh sandbox and get its exit status, stdout and stderr. "
    "Print what you want to see. Nothing is kept between calls; there is no network."
)
READ_LIMIT_BYTES = 1 << 20  # of each stream: a head and a tail this long are read, at most
# How long past `timeout_s` the tool's own deadline is: the runner kills the process at
# `timeout_s` and reports it; the session's deadline is the backstop.
STARTUP_GRACE_S = 5.0

log = logging.getLogger(__name__)


def python_tool(
    *,
    sandbox: Level = "namespaces",
    require_sandbox: bool = True,
    timeout_s: float = 5.0,
    memory_limit_gb: float = 1.0,
    max_processes: int = 256,
    max_file_size_mb: float = 16.0,
    max_open_files: int = 256,
    max_output_chars: int = 2000,
    name: str = "python",
    description: str = DESCRIPTION,
) -> Tool:
    """The tool that runs model-written Python (see the module docstring); its `fn` is the
    `PythonRunner`. Raises IsolationUnavailable when `sandbox` cannot run here and
    `require_sandbox` is set."""
    limits = Limits(
        memory_bytes=int(memory_limit_gb * 2**30),
        cpu_s=math.ceil(timeout_s) + 1,  # the wall deadline comes first for one busy thread
        max_processes=max_processes,
        max_file_bytes=int(max_file_size_mb * 2**20),
        max_open_files=max_open_files,
    )
    runner = PythonRunner(
        sandbox,
        limits=limits,
        timeout_s=timeout_s,
        max_output_chars=max_output_chars,
        require_sandbox=require_sandbox,
    )
    parameters = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "A complete Python program."},
        },
        "required": ["code"],
    }
    return Tool(name, description, parameters, runner, timeout_s=timeout_s + STARTUP_GRACE_S)


class PythonRunner:
    """Runs one program per call in a fresh sandboxed interpreter; awaitable as `runner(code)`."""

    def __init__(
        self,
        sandbox: Level,
        *,
        limits: Limits,
        timeout_s: float,
        max_output_chars: int,
        require_sandbox: bool = True,
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_output_chars < 100:
            raise ValueError(f"max_output_chars must be at least 100, got {max_output_chars}")
        try:
            checked = Sandbox(sandbox, limits=limits, require=require_sandbox)
        except IsolationUnavailable as e:
            raise IsolationUnavailable(
                f"python tool, sandbox={sandbox}: {e}. To run with less isolation pass "
                "sandbox='process' (or 'none'), or require_sandbox=False to fall back to the "
                "strongest level available"
            ) from None
        self.level: Level = checked.level
        self.isolation = checked.isolation
        self.limits = limits
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        log.info("python tool: %s; per call %g s", self.isolation_level(), timeout_s)

    def isolation_level(self) -> str:
        """What the sandbox enforces, mechanism by mechanism (the reward sandbox's report)."""
        return self.isolation.describe()

    async def __call__(self, code: str) -> str:
        """The program's exit status and output. Raises ToolTimeout past `timeout_s` (the
        process killed), ToolInfraError when the sandbox could not start a process."""
        # A Sandbox per call: at the `process` level each one has its own temporary directory.
        sandbox = Sandbox(self.level, limits=self.limits)
        workdir = tempfile.mkdtemp(prefix="streamrl-python-") if self.level == "none" else None
        argv = [sys.executable, "-I", "-u", "-B", "-"]  # isolated, unbuffered, no .pyc files
        with (
            tempfile.TemporaryFile() as stdin,
            tempfile.TemporaryFile() as stdout,
            tempfile.TemporaryFile() as stderr,
        ):
            stdin.write(code.encode(errors="replace"))
            stdin.seek(0)
            try:
                kwargs = {"cwd": workdir} if workdir else {}
                proc = sandbox.popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, **kwargs)
            except OSError as e:  # fork or exec failed: this machine's trouble, not the code's
                _clean_up(sandbox, workdir)
                raise ToolInfraError(f"could not start the sandbox: {e}") from e
            try:
                finished = await _wait(proc, self.timeout_s)
            finally:
                Sandbox.kill(proc)  # whatever the code left running, or all of it
                _clean_up(sandbox, workdir)
            report = format_run(
                proc.returncode,
                _read(stdout),
                _read(stderr),
                self.max_output_chars,
                via_bwrap=self.level == "namespaces",
            )
        if not finished:
            raise ToolTimeout(
                f"the program ran longer than {self.timeout_s:g} s and was killed\n{report}"
            )
        return report


async def _wait(proc, timeout_s: float) -> bool:
    """Whether `proc` exited within `timeout_s` (polled: the event loop stays free)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while proc.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 2, 0.05)
    return True


def _clean_up(sandbox: Sandbox, workdir: str | None) -> None:
    sandbox.close()
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)


def _read(file: IO[bytes]) -> str:
    """A stream's text: whole, or, past `READ_LIMIT_BYTES`, its head and tail around a marker
    with the number of bytes left unread."""
    size = file.seek(0, 2)
    file.seek(0)
    if size <= 2 * READ_LIMIT_BYTES:
        return file.read().decode(errors="replace")
    head = file.read(READ_LIMIT_BYTES)
    file.seek(size - READ_LIMIT_BYTES)
    tail = file.read()
    skipped = size - 2 * READ_LIMIT_BYTES
    return f"{head.decode(errors='replace')}[... {skipped} bytes]{tail.decode(errors='replace')}"


def format_run(
    returncode: int | None, stdout: str, stderr: str, max_chars: int, *, via_bwrap: bool = False
) -> str:
    """`exit status N\\nstdout:\\n...\\nstderr:\\n...` in at most `max_chars` characters: when
    the output does not fit, the streams share the room (one shorter than half leaves the rest to
    the other), each cut in the middle so that its start and its end (a traceback's last line)
    stay."""
    head = f"{exit_line(returncode, via_bwrap)}\nstdout:\n"
    sep = "\nstderr:\n"
    stdout, stderr = stdout.rstrip("\n"), stderr.rstrip("\n")
    room = max(0, max_chars - len(head) - len(sep))
    if len(stdout) + len(stderr) > room:
        half = room // 2
        out_room = len(stdout) if len(stdout) < half else max(half, room - len(stderr))
        stdout, stderr = cut_middle(stdout, out_room), cut_middle(stderr, room - out_room)
    return f"{head}{stdout}{sep}{stderr}"[:max_chars]


def exit_line(returncode: int | None, via_bwrap: bool) -> str:
    """`exit status N`, naming the signal that killed the process (bwrap reports 128 + it)."""
    signum = None
    if returncode is not None and returncode < 0:
        signum = -returncode
    elif via_bwrap and returncode is not None and 128 < returncode < 128 + signal.NSIG:
        signum = returncode - 128
    if signum is None:
        return f"exit status {returncode}"
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"exit status {returncode} (killed by {name})"


def cut_middle(text: str, max_chars: int) -> str:
    """`text` in at most `max_chars` characters: its start and end around a marker saying how
    many characters were cut."""
    if len(text) <= max_chars:
        return text
    marker = f"\n[... {len(text)} characters cut ...]\n"
    keep = max_chars - len(marker)
    if keep <= 0:
        return text[:max_chars]
    start = keep - keep // 2
    end = len(text) - keep // 2
    return f"{text[:start]}\n[... {end - start} characters cut ...]\n{text[end:]}"
