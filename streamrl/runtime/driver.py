"""The driver loop of an asynchronous run, one for every runtime (inline, threads, Ray).

```
 dataset ─► feeder ─prompt rows─► bus ◄─claim / write / ack─ rollout, reward, reference, logp,
                                   │                          critic, advantage (each its loop)
                                   └─► trainer: micro-batches of whole groups ─► optimizer step
 trainer ─publish(version, weights)─► weight channel ─fetch_newer─► rollout, logp, critic
 driver (this loop): trainer records ─► metrics, progress, summary; stall check; supervision
```

| loop | consumes | produces | waits on | unblocked by |
| --- | --- | --- | --- | --- |
| feeder | bus capacity | prompt rows of batch b | (max_staleness+1) batches in flight | trainer acks |
| rollout | prompt rows with b <= version + s | responses, log-probs, versions | weight version | trainer publish |
| reward | responses | reward + status | responses | rollout |
| advantage | whole scored groups | advantages | last sample of a group | reward |
| trainer | groups of batch k with advantages | version k+1 | slowest group of batch k | advantage |
| driver | trainer records | metrics | the trainer | each optimizer step |

The roles run their own loops (`runtime/roles.py:loop_role`); a runtime places them and hands
the driver a `Deployment`, which lets the roles work (`advance`), yields the trainer's finished
records, and says when the trainer is done. Restarts belong to the deployment: Ray's supervisor
restarts roles in place, and a lost trainer reaches the controller as `TrainerLost`, which
resumes the whole run from its latest checkpoint. The synchronous loop (`runtime/sync.py`) is
the same algorithm with no concurrency, written out as the reference.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Any, Protocol

from streamrl.api.run import RunContext
from streamrl.runtime.roles import stall_message


class Deployment(Protocol):
    """A run's roles, placed and started by one runtime."""

    def advance(self) -> bool:
        """Let the roles work for a moment (inline: a turn of every role; threads: a turn of
        the trainer; Ray: supervise for up to 0.2 s, restarting failed roles); raise when a role
        failed for good. True once the trainer is done."""
        ...

    def records(self) -> list[dict[str, Any]]:
        """The trainer's records finished since the last call; the last one carries the other
        roles' cumulative counters (`roles`), read now."""
        ...

    def role_stats(self) -> dict[str, Any]:
        """Every live role's counters."""
        ...

    def bus_stats(self) -> dict[str, Any]: ...


class InProcessDeployment(abc.ABC):
    """The part of a `Deployment` shared by the modes whose trainer and bus live in the driver's
    process (inline, threads): `trainer`, `bus` and `role_stats` are set by the subclass."""

    trainer: Any
    bus: Any

    @abc.abstractmethod
    def role_stats(self) -> dict[str, Any]:
        """Every role's counters but the trainer's."""

    def records(self) -> list[dict[str, Any]]:
        records = self.trainer.drain()
        if records:
            records[-1]["roles"] = self.role_stats()
        return records

    def bus_stats(self) -> dict[str, Any]:
        return self.bus.stats()


def drive(
    ctx: RunContext, deployment: Deployment, on_record: Callable[[dict[str, Any]], None]
) -> float:
    """Hand the trainer's records to `on_record` until the trainer is done; raise when no step
    finishes for `runtime.stall_timeout_s`. Returns the loop's wall time."""
    started = last_record = time.perf_counter()
    while True:
        for record in deployment.records():
            on_record(record)
            last_record = time.perf_counter()
        if time.perf_counter() - last_record > ctx.cfg.runtime.stall_timeout_s:
            raise RuntimeError(stall_message(ctx, deployment.role_stats(), deployment.bus_stats()))
        if deployment.advance():
            break
    for record in deployment.records():
        on_record(record)
    return time.perf_counter() - started
