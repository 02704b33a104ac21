"""Inline mode: every role in one thread of one process, sharing an in-process bus.

For debugging and tests: the same roles, bus contract and weight-sync interface as the Ray
runtime, with no processes or threads to start. The driver's `advance` gives every role one
turn in order, sleeping briefly when none of them found anything to do; no call ever blocks
(`LoopPolicy.wait_s` = 0).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from streamrl.api.registry import bus_consumers, pacing_role, run_roles
from streamrl.api.role import Role
from streamrl.bus.local import LocalBus
from streamrl.config.derived import bus_capacity_groups
from streamrl.runtime.driver import InProcessDeployment, drive
from streamrl.runtime.roles import RoleLoop, build_role
from streamrl.weights.channels import publisher_for


class InlineDeployment(InProcessDeployment):
    def __init__(self, trainer: Role, others: dict[str, Role], bus: LocalBus, poll_s: float):
        self.trainer = trainer
        self.others = others
        self.bus = bus
        self.poll_s = poll_s
        self._stop = threading.Event()  # never set: the loops only use it to sleep
        self._loops = [RoleLoop(role, self._stop, 0.0) for role in (trainer, *others.values())]

    def advance(self) -> bool:
        if self.trainer.done:
            return True
        if not any([loop.turn() for loop in self._loops]):  # every role takes its turn
            self._stop.wait(self.poll_s)
        return self.trainer.done

    def role_stats(self) -> dict[str, Any]:
        return {name: role.stats() for name, role in self.others.items()}


def run_inline(
    ctx, on_record: Callable[[dict[str, Any]], None], *, start_step: int = 0
) -> dict[str, Any]:
    bus = LocalBus(capacity_groups=bus_capacity_groups(ctx.cfg))
    for consumer in bus_consumers(ctx.cfg):
        bus.register_consumer(consumer)
    weights = publisher_for(ctx.cfg)  # in-process: one store, both sides
    pacer = pacing_role(ctx.cfg)
    trainer = build_role(pacer, ctx, bus, weights, start_step=start_step)
    others = {
        spec.name: build_role(spec.name, ctx, bus, weights, start_step=start_step)
        for spec in run_roles(ctx.cfg)
        if spec.name != pacer
    }
    deployment = InlineDeployment(trainer, others, bus, ctx.cfg.runtime.poll_s)
    for role in (trainer, *others.values()):
        role.start()
    try:
        train_wall_s = drive(ctx, deployment, on_record)
    finally:
        for role in (*others.values(), trainer):
            role.close()
    stats = deployment.role_stats()
    stats[pacer] = trainer.stats()
    stats["bus"] = bus.stats()
    stats["train_wall_s"] = train_wall_s
    return stats
