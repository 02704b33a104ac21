"""Threads mode: every role a thread of one process, sharing an in-process bus and weight store.

The asynchronous job without processes between the roles: the same roles, bus contract and
weight-sync interface as the Ray runtime, but samples and weights change hands as references
in memory instead of through Ray calls and the object store. PyTorch releases the GIL inside
its kernels, so the rollout's and the trainer's computations run on different cores at once;
every role computes on one torch thread (the process's intra-op pool has one thread), so that
the two busy roles keep one core each instead of competing for both.

What it gives up against Ray mode: the roles share one failure domain (a role that raises ends
the run; nothing restarts), one machine, and the interpreter (the roles' Python code, as
opposed to their tensor kernels, runs one thread at a time). Use it where the roles' own work is
small next to what Ray's per-call costs add (tiny models on a laptop's few cores); use Ray mode
for isolation, restarts, GPUs and clusters.

The trainer runs in the driver's thread (a turn of it per `advance`), so its records reach the
driver as in inline mode; every other role loops in a daemon thread (`loop_role`) until the
trainer is done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from streamrl.api.registry import bus_consumers, pacing_role, run_roles
from streamrl.api.role import Role
from streamrl.bus.local import LocalBus
from streamrl.config.derived import bus_capacity_groups
from streamrl.models.loading import set_threads
from streamrl.runtime.driver import InProcessDeployment, drive
from streamrl.runtime.errors import RoleFailed, one_line
from streamrl.runtime.roles import RoleLoop, build_role, loop_role
from streamrl.weights.channels import publisher_for


class RoleThread:
    """One role looping in a daemon thread; `error` holds what ended it, if it failed."""

    def __init__(self, name: str, role: Role, stop: threading.Event, poll_s: float):
        self.name = name
        self.role = role
        self.error: BaseException | None = None
        self._stop = stop
        self._poll_s = poll_s
        self.thread = threading.Thread(target=self._run, name=f"streamrl-{name}", daemon=True)

    def _run(self) -> None:
        # OpenMP keeps a thread count per thread: set this one's too. (vLLM's CPU attention
        # fails when it differs from the count vLLM built its metadata with at start-up.)
        set_threads(1)
        try:
            loop_role(self.role, self._stop, self._poll_s)
        except BaseException as e:  # noqa: BLE001 - handed to the driver, which ends the run
            # (and writes its traceback into logs/controller.log)
            self.error = e
            self._stop.set()


class ThreadsDeployment(InProcessDeployment):
    def __init__(self, trainer: Role, others: dict[str, RoleThread], bus, poll_s: float):
        self.trainer = trainer
        self.others = others
        self.bus = bus
        self.stop = threading.Event()
        self._loop = RoleLoop(trainer, self.stop, poll_s)

    def advance(self) -> bool:
        """A turn of the trainer, after checking that no other role's thread failed."""
        failed = next((t for t in self.others.values() if t.error is not None), None)
        if failed is not None:
            raise RoleFailed(f"role {failed.name} failed: {one_line(failed.error)}") from (
                failed.error
            )
        if self.trainer.done:
            return True
        self._loop.turn()
        return self.trainer.done

    def role_stats(self) -> dict[str, Any]:
        return {name: t.role.stats() for name, t in self.others.items()}


def run_threads(
    ctx, on_record: Callable[[dict[str, Any]], None], *, start_step: int = 0
) -> dict[str, Any]:
    rt = ctx.cfg.runtime
    set_threads(1)
    bus = LocalBus(capacity_groups=bus_capacity_groups(ctx.cfg))
    for consumer in bus_consumers(ctx.cfg):
        bus.register_consumer(consumer)
    weights = publisher_for(ctx.cfg)  # in-process: one store, both sides

    def build(name: str) -> Role:
        return build_role(
            name,
            ctx,
            bus,
            weights,
            start_step=start_step,
            claim_wait_s=rt.claim_wait_s,
            idle_wait_s=rt.idle_wait_s,
            overlapping_calls=True,  # the local bus is thread-safe
        )

    pacer = pacing_role(ctx.cfg)
    trainer = build(pacer)
    deployment = ThreadsDeployment(trainer, {}, bus, rt.poll_s)
    deployment.others = {
        spec.name: RoleThread(spec.name, build(spec.name), deployment.stop, rt.poll_s)
        for spec in run_roles(ctx.cfg)
        if spec.name != pacer
    }
    trainer.start()
    for t in deployment.others.values():
        t.thread.start()
    try:
        train_wall_s = drive(ctx, deployment, on_record)
    finally:
        deployment.stop.set()
        for t in deployment.others.values():
            t.thread.join(timeout=rt.idle_wait_s + rt.claim_wait_s + 30.0)
            t.role.close()
        trainer.close()
    stats = deployment.role_stats()
    stats[pacer] = trainer.stats()
    stats["bus"] = bus.stats()
    stats["train_wall_s"] = train_wall_s
    return stats
