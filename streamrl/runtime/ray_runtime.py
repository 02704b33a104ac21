"""Ray mode: every role its own Ray actor process, joined by the Ray bus and Ray weight store.

```
 feeder ─rows─► bus actor ◄─claim/write/ack─ rollout, reward, advantage, trainer actors
 trainer ─publish(v, buckets)─► weight store actor ─fetch_newer─► rollout (between decode steps)
 driver: starts everything, drains trainer records, logs, stops the roles when done
```

| loop | consumes | produces | waits on | unblocked by |
| --- | --- | --- | --- | --- |
| feeder | bus capacity | prompt rows of batch b | (max_staleness+1) batches in flight | trainer acks |
| rollout | prompt rows with b <= version + s | responses, log-probs, versions | weight version | trainer publish |
| reward | responses | reward + status | responses | rollout |
| advantage | whole scored groups | advantages | last sample of a group | reward |
| trainer | groups of batch k with advantages | version k+1 | slowest group of batch k | advantage |

Each actor runs its role's loop in a thread (`run`), so the driver can ask it for stats and
records or tell it to stop while the loop runs. Ray starts locally when no address is given.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from streamrl.runtime.context import RunContext
from streamrl.runtime.roles import active_roles, bus_capacity_groups, stall_message

log = logging.getLogger(__name__)

# torch threads per role process: one each (two cores: rollout and trainer each get one);
# the trainer's comes from `trainer.threads`.
ROLE_THREADS = 1


class RoleActor:
    """One role in its own process: builds it, then loops `step()` until told to stop."""

    def __init__(self, name: str, ctx: RunContext, bus, weights, start_step: int, threads: int):
        from streamrl.runtime.components import set_threads
        from streamrl.runtime.roles import build_role

        set_threads(threads)
        self.name = name
        self.role = build_role(
            name,
            ctx,
            bus,
            weights,
            start_step=start_step,
            claim_wait_s=ctx.cfg.runtime.claim_wait_s,
        )
        self.poll_s = ctx.cfg.runtime.poll_s
        self._stop = threading.Event()
        self.error: str | None = None

    def ready(self) -> bool:
        return True

    def run(self) -> None:
        try:
            idle_s = self.poll_s
            while not self._stop.is_set():
                if getattr(self.role, "done", False):
                    return
                if self.role.step():
                    idle_s = self.poll_s
                else:  # back off while there is nothing to do, up to 16x the poll interval
                    time.sleep(idle_s)
                    idle_s = min(idle_s * 2, self.poll_s * 16)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            raise
        finally:
            close = getattr(self.role, "close", None)
            if close is not None:
                close()

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, Any]:
        return self.role.stats()

    def drain(self) -> list[dict[str, Any]]:
        return self.role.drain() if hasattr(self.role, "drain") else []


def ensure_ray(ctx: RunContext) -> None:
    if ray.is_initialized():
        return
    rt = ctx.cfg.runtime
    if rt.ray_address:
        ray.init(address=rt.ray_address, log_to_driver=True)
    else:
        ray.init(
            num_cpus=rt.num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            log_to_driver=True,
            object_store_memory=256 * 2**20,
            configure_logging=False,
        )


def run_ray(
    ctx: RunContext, on_record: Callable[[dict[str, Any]], None], *, start_step: int = 0
) -> dict[str, Any]:
    from streamrl.bus.ray_bus import RayBus
    from streamrl.weights.dcs import RayWeights

    t0 = time.perf_counter()
    ensure_ray(ctx)
    log.info("ray ready in %.1fs", time.perf_counter() - t0)
    bus = RayBus.create(capacity_groups=bus_capacity_groups(ctx))
    for consumer in active_roles(ctx):
        bus.register_consumer(consumer)
    weights = RayWeights.create()
    actor_cls = ray.remote(num_cpus=0, max_concurrency=4)(RoleActor)
    names = ("trainer", *(r for r in active_roles(ctx) if r != "trainer"), "feeder")
    actors = {
        n: actor_cls.options(name=None).remote(
            n,
            ctx,
            bus,
            weights,
            start_step,
            ctx.cfg.trainer.threads if n == "trainer" else ROLE_THREADS,
        )
        for n in names
    }
    ray.get([a.ready.remote() for a in actors.values()])
    log.info("roles started in %.1fs", time.perf_counter() - t0)
    loop_started = time.perf_counter()
    runs = {n: a.run.remote() for n, a in actors.items()}
    trainer = actors["trainer"]
    try:
        last_record = time.perf_counter()
        while True:
            records = ray.get(trainer.drain.remote())
            if records:  # cumulative busy time of the other roles, for per-step time per role
                others = [n for n in actors if n != "trainer"]
                records[-1]["roles"] = dict(
                    zip(others, ray.get([actors[n].stats.remote() for n in others]), strict=True)
                )
            for record in records:
                on_record(record)
                last_record = time.perf_counter()
            if time.perf_counter() - last_record > ctx.cfg.runtime.stall_timeout_s:
                stats = {n: ray.get(a.stats.remote()) for n, a in actors.items()}
                raise RuntimeError(stall_message(ctx, stats, bus.stats()))
            finished, _ = ray.wait(list(runs.values()), timeout=0.2, num_returns=len(runs))
            for ref in finished:
                ray.get(ref)  # re-raises a role's error here, with its traceback
            if runs["trainer"] in finished:
                break
        for record in ray.get(trainer.drain.remote()):
            on_record(record)
        train_wall_s = time.perf_counter() - loop_started
        stats = {n: ray.get(a.stats.remote()) for n, a in actors.items()}
        stats["bus"] = bus.stats()
        stats["train_wall_s"] = train_wall_s
        log.info("training done at %.1fs", time.perf_counter() - t0)
    finally:
        for a in actors.values():
            a.stop.remote()
        ray.wait(list(runs.values()), timeout=10, num_returns=len(runs))
        for a in actors.values():
            ray.kill(a)
        bus.close()
        log.info("roles stopped at %.1fs", time.perf_counter() - t0)
    return stats
