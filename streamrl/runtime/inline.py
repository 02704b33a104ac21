"""Inline mode: every role an asyncio task in one process, sharing an in-process bus.

For debugging and tests: same roles, same bus contract, same weight-sync interface as the Ray
runtime, with no processes to start. Each task loops `role.step()`, yielding to the others
between steps (and sleeping briefly when its role found nothing to do).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from streamrl.bus.local import LocalBus
from streamrl.runtime.context import RunContext
from streamrl.runtime.roles import (
    active_roles,
    build_role,
    bus_capacity_groups,
    bus_consumers,
    stall_message,
)
from streamrl.weights.dcs import InProcessWeights


def run_inline(
    ctx: RunContext, on_record: Callable[[dict[str, Any]], None], *, start_step: int = 0
) -> dict[str, Any]:
    return asyncio.run(_run(ctx, on_record, start_step))


async def _run(ctx: RunContext, on_record, start_step: int) -> dict[str, Any]:
    bus = LocalBus(capacity_groups=bus_capacity_groups(ctx))
    consumers = active_roles(ctx)
    for consumer in bus_consumers(ctx):
        bus.register_consumer(consumer)
    weights = InProcessWeights()
    trainer = build_role("trainer", ctx, bus, weights, start_step=start_step)
    others = {
        name: build_role(name, ctx, bus, weights, start_step=start_step)
        for name in ("feeder", *consumers)
        if name != "trainer"
    }
    poll_s = ctx.cfg.runtime.poll_s

    async def loop(role) -> None:
        while not trainer.done:
            progressed = role.step()
            await asyncio.sleep(0 if progressed else poll_s)

    async def train_loop() -> None:
        last_record = time.perf_counter()
        while not trainer.done:
            progressed = trainer.step()
            for record in trainer.drain():
                record["roles"] = {name: role.stats() for name, role in others.items()}
                on_record(record)
                last_record = time.perf_counter()
            if time.perf_counter() - last_record > ctx.cfg.runtime.stall_timeout_s:
                stats = {name: role.stats() for name, role in others.items()}
                raise RuntimeError(stall_message(ctx, stats, bus.stats()))
            await asyncio.sleep(0 if progressed else poll_s)
        for record in trainer.drain():
            on_record(record)

    for record in trainer.drain():
        on_record(record)
    started = time.perf_counter()
    try:
        await asyncio.gather(train_loop(), *(loop(r) for r in others.values()))
    finally:
        others["reward"].close()
        trainer.close()
    stats = {name: role.stats() for name, role in others.items()}
    stats["trainer"] = trainer.stats()
    stats["bus"] = bus.stats()
    stats["train_wall_s"] = time.perf_counter() - started
    return stats
