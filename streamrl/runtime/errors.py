"""Errors the runtime raises to the controller (no Ray import, so every mode can catch them)."""

from collections.abc import Iterator
from contextlib import contextmanager


class TrainerLost(RuntimeError):
    """The trainer's process died or its loop failed; resume from the latest checkpoint.
    `restarts`: the restarts in place of the attempt that ended (role or process -> count), set
    by the runtime so that the run's summary counts them."""

    restarts: dict[str, int] | None = None


class BusLost(TrainerLost):
    """A bus shard's process died, and the rows it held with it: the controller restarts every
    role from the latest checkpoint (the feeder re-adds the batches after it under their own
    sample ids). `process` names the shard (`bus#<k>`), `since` is when its loss was seen."""

    def __init__(self, reason: str, process: str, since: float):
        super().__init__(reason)
        self.process, self.since = process, since


class RoleError(RuntimeError):
    """A role stopped the run: the CLI prints this one-line reason, not a traceback. `log`: the
    file that holds the traceback, once known (said after the reason); `resume`: the run
    directory, when `streamrl train --resume` can continue the run as it is (said last)."""

    def __init__(self, reason: str, log: object = None, resume: object = None):
        super().__init__(reason)
        self.reason, self.log, self.resume = reason, log, resume

    def __str__(self) -> str:
        text = self.reason if self.log is None else f"{self.reason} (traceback: {self.log})"
        if self.resume is not None:
            text += (
                f"; `streamrl train --resume {self.resume}` continues it from its latest checkpoint"
            )
        return text


class RoleNotBuilt(RoleError):
    """A role's constructor failed (a model, config or environment it cannot use): starting it
    again would fail the same way, so the run stops."""


class RoleFailed(RoleError):
    """A role failed more often than its restart budget allows."""


class RunFailed(RoleError):
    """Something the run cannot restart in place failed (a bus shard, the weight store, Ray
    itself): the run stops with this one line; the traceback is in logs/controller.log."""


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
