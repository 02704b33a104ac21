"""Errors the runtime raises to the controller (no Ray import, so every mode can catch them)."""

from collections.abc import Iterator
from contextlib import contextmanager


class TrainerLost(RuntimeError):
    """The trainer's process died or its loop failed; resume from the latest checkpoint."""


class RoleNotBuilt(RuntimeError):
    """A role's constructor failed (a model, config or environment it cannot use): starting it
    again would fail the same way, so the run stops with this one-line reason. `log`: the file
    that holds the traceback, once known (said after the reason)."""

    def __init__(self, reason: str, log: object = None):
        super().__init__(reason)
        self.reason, self.log = reason, log

    def __str__(self) -> str:
        return self.reason if self.log is None else f"{self.reason} (traceback: {self.log})"


class RoleFailed(RuntimeError):
    """A role failed more often than its restart budget allows."""


@contextmanager
def building(role: str) -> Iterator[None]:
    """Turn a failure while building `role` into `RoleNotBuilt`, with the reason in one line."""
    try:
        yield
    except RoleNotBuilt:
        raise
    except Exception as e:
        raise RoleNotBuilt(f"the {role} role could not be built: {type(e).__name__}: {e}") from e
