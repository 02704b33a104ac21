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

The trainer runs in the calling thread, so its records reach the driver as in inline mode;
every other role loops in a daemon thread (`loop_role`) until the trainer is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from streamrl.bus.local import LocalBus
from streamrl.runtime.components import set_threads
from streamrl.runtime.context import RunContext
from streamrl.runtime.errors import RoleFailed, one_line
from streamrl.runtime.roles import (
    active_roles,
    build_role,
    bus_capacity_groups,
    bus_consumers,
    loop_role,
    stall_message,
)
from streamrl.weights.dcs import InProcessWeights


class RoleThread:
    """One role looping in a daemon thread; `error` holds what ended it, if it failed."""

    def __init__(self, name: str, role, stop: threading.Event, poll_s: float):
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


def run_threads(
    ctx: RunContext, on_record: Callable[[dict[str, Any]], None], *, start_step: int = 0
) -> dict[str, Any]:
    rt = ctx.cfg.runtime
    set_threads(1)
    bus = LocalBus(capacity_groups=bus_capacity_groups(ctx))
    for consumer in bus_consumers(ctx):
        bus.register_consumer(consumer)
    weights = InProcessWeights()

    def build(name: str):
        return build_role(
            name,
            ctx,
            bus,
            weights,
            start_step=start_step,
            claim_wait_s=rt.claim_wait_s,
            idle_wait_s=rt.idle_wait_s,
        )

    trainer = build("trainer")
    stop = threading.Event()
    others = {
        name: RoleThread(name, build(name), stop, rt.poll_s)
        for name in ("feeder", *active_roles(ctx))
        if name != "trainer"
    }

    def role_stats() -> dict[str, Any]:
        return {name: t.role.stats() for name, t in others.items()}

    for record in trainer.drain():
        on_record(record)
    started = time.perf_counter()
    for t in others.values():
        t.thread.start()
    try:
        _train(ctx, trainer, bus, others, stop, role_stats, on_record)
    finally:
        stop.set()
        for t in others.values():
            t.thread.join(timeout=rt.idle_wait_s + rt.claim_wait_s + 30.0)
            close = getattr(t.role, "close", None)
            if close is not None:
                close()
        trainer.close()
    stats = role_stats()
    stats["trainer"] = trainer.stats()
    stats["bus"] = bus.stats()
    stats["train_wall_s"] = time.perf_counter() - started
    return stats


def _train(ctx, trainer, bus, others, stop, role_stats, on_record) -> None:
    """The trainer's loop in this thread, handing its records on as they come; ends the run
    when another role's thread fails or no step finishes for `runtime.stall_timeout_s`."""
    stall_timeout_s = ctx.cfg.runtime.stall_timeout_s
    last_record = time.perf_counter()

    def after_step() -> None:
        nonlocal last_record
        failed = next((t for t in others.values() if t.error is not None), None)
        if failed is not None:
            raise RoleFailed(f"role {failed.name} failed: {one_line(failed.error)}") from (
                failed.error
            )
        records = trainer.drain()
        if records:
            records[-1]["roles"] = role_stats()
        for record in records:
            on_record(record)
            last_record = time.perf_counter()
        if time.perf_counter() - last_record > stall_timeout_s:
            raise RuntimeError(stall_message(ctx, role_stats(), bus.stats()))

    loop_role(trainer, stop, ctx.cfg.runtime.poll_s, after_step=after_step)
    if stop.is_set():  # a role failed while the trainer waited
        after_step()
    for record in trainer.drain():
        on_record(record)
