"""Errors the runtime raises to the controller (no Ray import, so every mode can catch them)."""


class TrainerLost(RuntimeError):
    """The trainer's process died or its loop failed; resume from the latest checkpoint."""


class RoleFailed(RuntimeError):
    """A role failed more often than its restart budget allows."""
