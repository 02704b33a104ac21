"""The seccomp filter of the `namespaces` sandbox: system calls that untrusted code never needs
and that a sandbox escape goes through, refused by the kernel before they run.

Compiled by libseccomp (through `pyseccomp`, a ctypes binding) into a BPF program that bwrap
installs on the sandboxed process (`--seccomp FD`) just before it runs the command; children
inherit it, and it cannot be removed. Every other system call is allowed: the filter narrows the
kernel's surface and leaves namespaces, the read-only filesystem and the limits to do the rest.

| refused | why |
| --- | --- |
| `ptrace`, `process_vm_readv`/`writev` | reading or steering another process |
| `unshare`, `setns`; `clone` with a CLONE_NEW* flag | new or other namespaces: nested user namespaces are where most kernel escapes start |
| `mount`, `umount2`, `pivot_root`, `chroot`, `open_by_handle_at`, `name_to_handle_at` | changing or leaving the filesystem view |
| `bpf`, `perf_event_open`, `userfaultfd`, `io_uring_*`, `keyctl`, `add_key`, `request_key` | large kernel interfaces behind many escapes |
| `init_module`, `finit_module`, `delete_module`, `kexec_*`, `reboot`, `swapon`, `swapoff`, `acct`, `syslog`, `iopl`, `ioperm`, clock setters | administering the machine |

Refused calls fail with EPERM, except `clone3`, which fails with ENOSYS: its flags sit in a
structure a filter cannot read, and ENOSYS makes the C library fall back to `clone`, whose flags
are checked. Where libseccomp is not installed the filter is off and the sandbox says so.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_by_handle_at",
    "name_to_handle_at",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "syslog",
    "iopl",
    "ioperm",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
)
# clone(2) flags that make new namespaces (linux/sched.h).
CLONE_NEW = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}


@functools.cache
def seccomp_program() -> tuple[bytes | None, str]:
    """(the BPF program, how the sandbox reports it): the program is None, and the report says
    why, where libseccomp is not available."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError) as e:  # pyseccomp raises when libseccomp is absent
        return None, f"off (libseccomp not available: {e}; apt install libseccomp2)"
    program = sc.SyscallFilter(sc.ALLOW)
    refused = []
    for name in DENIED:
        try:
            program.add_rule(sc.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError, OSError):
            continue  # not a system call of this architecture (iopl off x86)
        refused.append(name)
    program.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in CLONE_NEW.values():
        program.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    with tempfile.TemporaryFile() as out:
        program.export_bpf(out)
        out.seek(0)
        compiled = out.read()
    return compiled, f"on ({len(refused)} system calls and namespace clones refused)"


def program_fd() -> int | None:
    """A file descriptor holding the BPF program from its start, for bwrap's `--seccomp`; the
    caller closes it once bwrap started. None where the filter is off."""
    compiled, _ = seccomp_program()
    if compiled is None:
        return None
    fd = os.memfd_create("streamrl-seccomp", 0)  # not inherited unless passed
    os.write(fd, compiled)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
