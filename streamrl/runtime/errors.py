"""Errors the runtime raises to the controller (no Ray import, so every mode can catch them)."""

from collections.abc import Iterator
from contextlib import contextmanager


class TrainerLost(RuntimeError):
    """The trainer's process died or its loop failed; resume from the latest checkpoint."""


class RoleError(RuntimeError):
    """A role stopped the run: the CLI prints this one-line reason, not a traceback. `log`: the
    file that holds the traceback, once known (said after the reason)."""

    def __init__(self, reason: str, log: object = None):
        super().__init__(reason)
        self.reason, self.log = reason, log

    def __str__(self) -> str:
        return self.reason if self.log is None else f"{self.reason} (traceback: {self.log})"


class RoleNotBuilt(RoleError):
    """A role's constructor failed (a model, config or environment it cannot use): starting it
    again would fail the same way, so the run stops."""


class RoleFailed(RoleError):
    """A role failed more often than its restart budget allows."""


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`: a failure as the console and events.jsonl say it."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


@contextmanager
def building(role: str) -> Iterator[None]:
    """Turn a failure while building `role` into `RoleNotBuilt`, with the reason in one line."""
    try:
        yield
    except RoleNotBuilt:
        raise
    except Exception as e:
        raise RoleNotBuilt(f"the {role} role could not be built: {type(e).__name__}: {e}") from e
