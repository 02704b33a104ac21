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
from ray.exceptions import RayActorError

from streamrl.runtime.context import RunContext
from streamrl.runtime.control import read_requests
from streamrl.runtime.roles import active_roles, bus_capacity_groups, bus_consumers, stall_message
from streamrl.runtime.supervisor import Supervisor, base_role

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
        self.weights = weights
        self.role = build_role(
            base_role(name),
            ctx,
            bus,
            weights,
            start_step=start_step,
            claim_wait_s=ctx.cfg.runtime.claim_wait_s,
        )
        self.poll_s = ctx.cfg.runtime.poll_s
        self._stop = threading.Event()
        self.error: str | None = None

    def info(self) -> dict[str, Any]:
        """Where this role runs."""
        info = {
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }
        if hasattr(self.weights, "address"):  # the trainer's tcp weight server
            info["weights_port"] = self.weights.address[1]
        return info

    def ping(self) -> bool:
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
            address="local",  # our own instance, even if another Ray cluster runs on this machine
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

    t0 = time.perf_counter()
    ensure_ray(ctx)
    log.info("ray ready in %.1fs", time.perf_counter() - t0)
    rt = ctx.cfg.runtime
    bus = RayBus.create(capacity_groups=bus_capacity_groups(ctx), shards=rt.bus_shards)
    for consumer in bus_consumers(ctx):
        bus.register_consumer(consumer)
    publisher = weights_for_trainer(ctx)
    actor_cls = ray.remote(max_concurrency=4)(RoleActor)
    roles = ["trainer", *(r for r in active_roles(ctx) if r != "trainer"), "feeder"]
    names = [
        f"{role}#{i}" if i else role
        for role in roles
        for i in range(getattr(rt.roles, role).replicas)
    ]
    supervisor: Supervisor | None = None
    subscriber = publisher

    def make_actor(name: str):
        # A restarted feeder continues from the trainer's step (re-adding a live batch is a no-op).
        step = start_step
        if supervisor is not None and "trainer" in supervisor.actors:
            step = ray.get(supervisor.actors["trainer"].stats.remote())["step"]
        threads = ctx.cfg.trainer.threads if name == "trainer" else ROLE_THREADS
        options = placement_options(getattr(rt.roles, base_role(name)))
        weights = publisher if name == "trainer" else subscriber
        return actor_cls.options(**options).remote(name, ctx, bus, weights, step, threads)

    supervisor = Supervisor(
        make_actor,
        bus,
        ctx.run_dir,
        consumers={"critic": ("critic", "critic_train")},
        max_restarts=rt.max_restarts,
        backoff_s=rt.restart_backoff_s,
        health_interval_s=rt.health_interval_s,
        health_timeout_s=rt.health_timeout_s,
    )
    try:
        supervisor.start(["trainer"])  # first: its weight server's address goes to the others
        subscriber = weights_for_engines(ctx, publisher, supervisor.info["trainer"])
        supervisor.start([n for n in names if n != "trainer"])
        log.info("roles started in %.1fs", time.perf_counter() - t0)
        loop_started = time.perf_counter()
        trainer = supervisor.actors["trainer"]
        last_record = time.perf_counter()
        while True:
            try:
                records = ray.get(trainer.drain.remote())
            except RayActorError as e:
                supervisor.failed("trainer", f"process died ({type(e).__name__})")  # raises
                raise  # unreachable: `failed` raises TrainerLost for the trainer
            if records:  # cumulative busy time of the other roles, for per-step time per role
                records[-1]["roles"] = _role_stats(supervisor, exclude="trainer")
                supervisor.write_status()
            for record in records:
                on_record(record)
                last_record = time.perf_counter()
            if time.perf_counter() - last_record > rt.stall_timeout_s:
                raise RuntimeError(stall_message(ctx, _role_stats(supervisor), bus.stats()))
            if supervisor.check(timeout_s=0.2):
                break
            supervisor.reconcile(read_requests(ctx.run_dir))
        for record in ray.get(trainer.drain.remote()):
            on_record(record)
        train_wall_s = time.perf_counter() - loop_started
        stats = _role_stats(supervisor)
        stats["bus"] = bus.stats()
        stats["train_wall_s"] = train_wall_s
        stats["restarts"] = dict(supervisor.restarts)
        log.info("training done at %.1fs", time.perf_counter() - t0)
    finally:
        supervisor.stop()
        bus.close()
        log.info("roles stopped at %.1fs", time.perf_counter() - t0)
    return stats


def weights_for_trainer(ctx: RunContext):
    """The weight-sync handle the trainer publishes to (`runtime.weight_channel`)."""
    rt = ctx.cfg.runtime
    if rt.weight_channel == "tcp":
        from streamrl.weights.remote import TcpPublisher, resolve_token

        return TcpPublisher(rt.weight_bind, rt.weight_port, resolve_token(rt.weight_token))
    from streamrl.weights.dcs import RayWeights

    return RayWeights.create()


def weights_for_engines(ctx: RunContext, publisher, trainer_info: dict[str, Any]):
    """The handle the other roles read weights from: the publisher itself for the object-store
    channel, a client of the trainer's weight server for tcp."""
    if ctx.cfg.runtime.weight_channel != "tcp":
        return publisher
    from streamrl.weights.remote import TcpSubscriber
    from streamrl.weights.tcp import is_loopback

    host = "127.0.0.1" if is_loopback(publisher.host) else trainer_info["node"]
    return TcpSubscriber(host, trainer_info["weights_port"], publisher.token)


def placement_options(placement) -> dict[str, Any]:
    """Ray actor options for a role's `runtime.roles.<role>` entry."""
    options: dict[str, Any] = {
        "num_cpus": placement.num_cpus,
        "num_gpus": placement.num_gpus,
        "resources": dict(placement.resources),
    }
    if placement.node:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            node_id=_node_id(placement.node), soft=False
        )
    return options


def _node_id(node: str) -> str:
    alive = [n for n in ray.nodes() if n["Alive"]]
    for n in alive:
        if node in (n["NodeID"], n["NodeManagerAddress"]):
            return n["NodeID"]
    known = ", ".join(f"{n['NodeManagerAddress']} ({n['NodeID'][:8]})" for n in alive)
    raise ValueError(f"runtime.roles: no live Ray node {node!r}; nodes: {known}")


def _role_stats(supervisor: Supervisor, exclude: str = "") -> dict[str, Any]:
    """Stats of every live role; a role that is restarting right now is left out."""
    names = [n for n in supervisor.runs if n != exclude]
    refs = [supervisor.actors[n].stats.remote() for n in names]
    out = {}
    for name, ref in zip(names, refs, strict=True):
        try:
            out[name] = ray.get(ref, timeout=30)
        except Exception as e:  # noqa: BLE001 - a dying role must not end the run here
            log.debug("no stats from %s: %s", name, e)
    return out
