"""Ray mode: every role its own Ray actor process, joined by the Ray bus and Ray weight store.

The dataflow and what each loop waits on: `runtime/driver.py`.

Each actor runs its role's loop in a thread (`run`), so the driver can ask it for stats and
records or tell it to stop while the loop runs. Ray starts locally when no address is given.
Around the roles: their placement (`runtime/placement.py`, optionally one placement group),
their supervision (`runtime/supervisor.py`; a lost trainer resumes in place,
`runtime/recovery.py`), their logs (`RUN_DIR/logs/<role>.log`, `runtime/logs.py`) and the weight
channel (`runtime.weights.channel`: object store, tcp or collective).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import RayActorError

from streamrl.api.registry import bus_consumers, load_plugins, pacing_role, role_spec, run_roles
from streamrl.api.run import RunContext
from streamrl.config.derived import (
    bus_capacity_groups,
    groups_per_step,
    held_groups,
    in_place_recovery,
)
from streamrl.control import read_requests
from streamrl.runtime.driver import drive
from streamrl.runtime.errors import BusLost, RoleError, RoleNotBuilt, TrainerLost
from streamrl.runtime.logs import attach_role_log, log_failure, start_log_sink
from streamrl.runtime.placement import (
    RolePlacementGroup,
    local_cores,
    placement_options,
    role_placement,
    role_threads,
)
from streamrl.runtime.recovery import lost_rows, settle_trainer_rows
from streamrl.runtime.roles import base_role, loop_role
from streamrl.runtime.supervisor import Supervisor
from streamrl.trainer.checkpoint import latest_checkpoint, read_state
from streamrl.weights.channels import (
    publisher_for,
    publisher_info,
    restarted_publisher,
    subscriber_for,
)
from streamrl.weights.dcs import RayWeights

log = logging.getLogger(__name__)

BUS_THREADS = 64  # the fewest threads of each bus shard actor
STATS_LOG_S = 30.0  # how often a role writes its counters into its log


class RoleActor:
    """One role in its own process: builds it, then loops `step()` until told to stop."""

    def __init__(
        self,
        name: str,
        ctx: RunContext,
        bus,
        weights,
        start_step: int,
        threads: int,
        log_sink=None,
    ):
        from streamrl.models.loading import set_threads
        from streamrl.runtime.roles import build_role

        self.log_handler = attach_role_log(log_sink, name) if log_sink is not None else None
        load_plugins(ctx.cfg.run.plugins)
        uses_torch = not role_spec(base_role(name)).torchless
        log.info(
            "%s: starting (pid %d, start step %d, %s)",
            name,
            os.getpid(),
            start_step,
            f"{threads} torch threads" if uses_torch else "no torch",
        )
        t0 = time.perf_counter()
        if uses_torch:  # importing torch costs a role process about 2 CPU-s
            set_threads(threads)
        self.name = name
        self.weights = weights
        # Set when the role cannot be built: `info` reports it and the supervisor stops the run
        # (raising here instead makes Ray print the traceback twice and abort the process).
        self.build_error: str | None = None
        self.poll_s = ctx.cfg.runtime.poll_s
        self._stop = threading.Event()
        self._republish: dict[str, Any] | None = None  # asked by `republish`, done by the loop
        self._republish_lock = threading.Lock()
        try:
            self.role = build_role(
                base_role(name),
                ctx,
                bus,
                weights,
                start_step=start_step,
                claim_wait_s=ctx.cfg.runtime.claim_wait_s,
                idle_wait_s=ctx.cfg.runtime.idle_wait_s,
                overlapping_calls=True,  # the Ray bus client is thread-safe
            )
        except RoleNotBuilt as e:
            self._log_traceback(f"{name}: could not be built")
            self._flush_log()
            self.build_error = str(e)
            return
        log.info("%s: built in %.1fs", name, time.perf_counter() - t0)

    def info(self) -> dict[str, Any]:
        """Where this role runs (or, if it could not be built, why)."""
        if self.build_error is not None:
            return {"build_error": self.build_error}
        context = ray.get_runtime_context()
        info = {
            "pid": os.getpid(),
            "node": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "placement_group": context.get_placement_group_id(),
        }
        info.update(publisher_info(self.weights))  # the trainer's tcp weight server's port
        return info

    def ping(self) -> bool:
        return True

    def republish(self, timeout_s: float = 240.0) -> int:
        """The trainer: publish the current weights again (the weight store restarted empty).
        Done by the loop's thread between two steps, never during an optimizer step; returns
        the version published."""
        request: dict[str, Any] = {"done": threading.Event()}
        with self._republish_lock:
            self._republish = request
        if not request["done"].wait(timeout_s):
            raise TimeoutError(f"{self.name}: no step ended within {timeout_s:.0f}s to publish")
        if "error" in request:
            raise request["error"]
        return request["version"]

    def _serve_republish(self) -> None:
        with self._republish_lock:
            request, self._republish = self._republish, None
        if request is None:
            return
        try:
            request["version"] = self.role.republish()
            log.info("%s: published version %d again", self.name, request["version"])
        except Exception as e:  # noqa: BLE001 - handed to the caller, which reports it
            request["error"] = e
        request["done"].set()

    def run(self) -> None:
        log.info("%s: running", self.name)
        next_stats = time.monotonic() + STATS_LOG_S

        def log_stats() -> None:
            nonlocal next_stats
            self._serve_republish()
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + STATS_LOG_S
                log.info("%s: %s", self.name, self.role.stats())

        try:
            loop_role(self.role, self._stop, self.poll_s, after_step=log_stats)
        except Exception:
            self._log_traceback(f"{self.name}: loop failed")
            raise
        finally:
            self.role.close()
            try:
                log.info("%s: stopped; %s", self.name, self.role.stats())
            except Exception as e:  # noqa: BLE001 - a broken role's stats must not hide its error
                log.info("%s: stopped (no stats: %s)", self.name, e)
            self._flush_log()

    def _log_traceback(self, message: str) -> None:
        """The exception being handled, into the role's log only: the driver prints the
        one-line reason."""
        if self.log_handler is not None:
            log_failure(self.log_handler, message, log.name)
        else:
            log.exception(message)

    def _flush_log(self) -> None:
        if self.log_handler is not None:
            self.log_handler.flush(wait_s=5.0)

    def stop(self) -> None:
        self._stop.set()

    def stats(self) -> dict[str, Any]:
        return self.role.stats()

    def drain(self) -> list[dict[str, Any]]:
        return self.role.drain()


class _QuietTokenNotice(logging.Filter):
    """Drops Ray's notice that a new local instance uses token authentication (what streamrl
    wants: it printed across the progress bar of every run). Warnings that it is off stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"


def ensure_ray(ctx: RunContext) -> None:
    if ray.is_initialized():
        return
    token_log = logging.getLogger(_TOKEN_LOGGER)
    if not any(isinstance(f, _QuietTokenNotice) for f in token_log.filters):
        token_log.addFilter(_QuietTokenNotice())
    rt = ctx.cfg.runtime
    if rt.ray.address:
        ray.init(address=rt.ray.address, log_to_driver=True)
    else:
        ray.init(
            address="local",  # our own instance, even if another Ray cluster runs on this machine
            num_cpus=local_cores(ctx.cfg),
            include_dashboard=False,
            log_to_driver=True,
            object_store_memory=256 * 2**20,
            configure_logging=False,
        )


def run_ray(
    ctx: RunContext,
    on_record: Callable[[dict[str, Any]], None],
    *,
    start_step: int = 0,
    on_rewind: Callable[[int], None] | None = None,
    recovering: BusLost | None = None,
    service_restarts: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Run every role as a Ray actor until the trainer is done. `on_rewind(step)` is called when
    a lost trainer resumes in place from the checkpoint of `step` (truncate the run's logs).
    `recovering`: this attempt follows the loss of a bus shard (its recovery time is logged);
    `service_restarts`: each bus shard's restarts so far, for `roles.json`."""
    from streamrl.bus.ray_bus import RayBus

    t0 = time.perf_counter()
    ensure_ray(ctx)
    log.info("ray ready in %.1fs", time.perf_counter() - t0)
    rt = ctx.cfg.runtime
    specs = run_roles(ctx.cfg)
    pacer = pacing_role(ctx.cfg)  # the trainer
    names = [
        f"{spec.name}#{i}" if i else spec.name
        for spec in specs
        for i in range(role_placement(rt.ray.roles, spec.name).replicas)
    ]
    group = None
    if rt.ray.placement_group.strategy != "none":  # first: it fails fast if it cannot be reserved
        group = RolePlacementGroup(
            names, rt.ray.roles, rt.ray.placement_group.strategy, rt.ray.placement_group.timeout_s
        )
    log_sink = start_log_sink(ctx.run_dir)
    capacity = bus_capacity_groups(ctx.cfg) + held_groups(ctx.cfg, groups_per_step(ctx.cfg))
    # A role's call that waits for rows holds one of a shard's threads; each replica has at
    # most two calls in flight (the trainer's prefetch claim and its acks), plus the driver's.
    # Replicas added later (`streamrl scale`) share the margin; past it, calls queue, briefly.
    threads = max(BUS_THREADS, 16 + 4 * len(names))
    bus = RayBus.create(
        capacity_groups=capacity,
        shards=rt.ray.bus_shards,
        max_concurrency=threads,
        restartable=in_place_recovery(ctx.cfg),  # a lost shard is rebuilt in place
    )
    for consumer in bus_consumers(ctx.cfg):
        bus.register_consumer(consumer)
    actor_cls = ray.remote(max_concurrency=4)(RoleActor)
    cores = local_cores(ctx.cfg)
    log.info(
        "torch threads: %s",
        ", ".join(
            "{} {} ({})".format(role, *role_threads(ctx.cfg, role, cores))
            for role in ("trainer", "rollout")  # the roles with threads of their own
        ),
    )
    supervisor: Supervisor | None = None
    # What a (re)started trainer is given, and the weights handle of every other role.
    # Only the feeder reads the training rows; every other role's process gets the context
    # without them (each copy of a 300,000-row file cost about 0.3 GiB: docs/benchmarks-log.md).
    lean = replace(ctx, train_rows=None)
    trainer_start = {"ctx": lean, "step": start_step, "weights": publisher_for(ctx.cfg)}
    subscriber = None

    def make_actor(name: str):
        threads, _ = role_threads(ctx.cfg, base_role(name), cores)
        if group is not None:  # its bundle (a restarted replica goes back into its own)
            options = group.options(name)
        else:
            options = placement_options(role_placement(rt.ray.roles, base_role(name)))
        if name == pacer:
            args = (trainer_start["ctx"], bus, trainer_start["weights"], trainer_start["step"])
        else:
            role_ctx = ctx if role_spec(base_role(name)).reads_train_rows else lean
            step = _pacer_step(supervisor, trainer_start["step"])
            args = (role_ctx, bus, subscriber, step)
        return actor_cls.options(**options).remote(name, *args, threads, log_sink)

    def resume_trainer() -> str:
        """Before a lost trainer restarts in place: the checkpoint, the bus, the logs."""
        checkpoint = latest_checkpoint(ctx.run_dir)
        step = read_state(checkpoint)["next_step"] if checkpoint is not None else 0
        released, acked = settle_trainer_rows(bus, pacer, step)
        if on_rewind is not None:
            on_rewind(step)
        trainer_start.update(ctx=replace(lean, checkpoint=checkpoint), step=step)
        return (
            f"resuming from {checkpoint or 'the start'} in place ({released} leases handed "
            f"back, {acked} checkpointed rows acked; the other roles keep running)"
        )

    def recover_shard(k: int) -> str:
        """Ray restarted bus shard k empty: the trainer resumes from its latest checkpoint c and
        the shard's rows of batches c.. come back under their own ids (`runtime/recovery.py`)."""
        feeders = [n for n in supervisor.actors if role_spec(base_role(n)).reads_train_rows]
        # Where the feeder got to; if it cannot say, every batch (the feeder's later adds of
        # those rows are no-ops; rows added early wait on the bus as any prompt does).
        added_to = _feeder_next_batch(supervisor, feeders)
        added_to = ctx.cfg.trainer.steps if added_to is None else added_to
        supervisor.halt([pacer, *feeders])
        checkpoint = latest_checkpoint(ctx.run_dir)
        freed = read_state(checkpoint).get("bus", {}).get("freed", []) if checkpoint else []
        bus.restore_shard(k, bus_consumers(ctx.cfg), freed)
        resumed = resume_trainer()
        step = trainer_start["step"]
        rows = lost_rows(ctx, bus, k, range(step, min(added_to, ctx.cfg.trainer.steps)))
        bus.restore_rows(rows)
        supervisor.start([pacer, *feeders])
        return (
            f"rebuilt in place: {len(rows)} rows of batches {step}..{added_to - 1} re-added "
            f"under their own ids; the trainer is {resumed}"
        )

    supervisor = Supervisor(
        make_actor,
        bus,
        ctx.run_dir,
        specs={spec.name: spec for spec in specs},
        max_restarts=rt.ray.max_restarts,
        backoff_s=rt.ray.restart_backoff_s,
        health_interval_s=rt.ray.health_interval_s,
        health_timeout_s=rt.ray.health_timeout_s,
        log_sink=log_sink,
        on_removed=group.release if group is not None else None,
        resume_trainer=resume_trainer if in_place_recovery(ctx.cfg) else None,
        recover_shard=recover_shard if in_place_recovery(ctx.cfg) else None,
        store=trainer_start["weights"]
        if isinstance(trainer_start["weights"], RayWeights)
        else None,
        service_restarts=service_restarts,
    )
    try:
        supervisor.watch_services()
        # The trainer starts its loop last, so that its first step's time does not include the
        # others' start-up. Over tcp it is also created first: its weight server's address goes
        # to the others. Every other channel needs nothing from it, so all roles are built at
        # once (their imports and model loads overlap: seconds off every run's start).
        others = [n for n in names if n != pacer]
        if rt.weights.channel == "tcp":
            supervisor.start([pacer], run=False)
            info = supervisor.info[pacer]
            subscriber = subscriber_for(ctx.cfg, trainer_start["weights"], info)
            trainer_start["weights"] = restarted_publisher(ctx.cfg, trainer_start["weights"], info)
            supervisor.start(others)
        else:
            subscriber = subscriber_for(ctx.cfg, trainer_start["weights"], {})
            supervisor.start(names, run=False)
            supervisor.run(others)
        supervisor.run([pacer])
        log.info("roles started in %.1fs", time.perf_counter() - t0)
        if recovering is not None:
            supervisor.service_recovered(recovering, start_step)
        deployment = RayDeployment(supervisor, bus, ctx.run_dir)
        try:
            train_wall_s = drive(ctx, deployment, on_record)
        except (RoleError, TrainerLost):
            raise
        except Exception as e:
            # A call that failed because a bus shard died (the driver's own, or one the
            # supervisor made while handling a role's failure): recover as from its loss.
            dead = bus.dead_shards()
            if not dead:
                raise
            supervisor.service_died(f"bus#{dead[0]}", e)  # raises BusLost
        stats = _role_stats(supervisor)
        stats["bus"] = bus.stats()
        stats["train_wall_s"] = train_wall_s
        stats["restarts"] = dict(supervisor.restarts)
        log.info("training done at %.1fs", time.perf_counter() - t0)
    except TrainerLost as e:
        e.restarts = dict(supervisor.restarts)  # the summary counts them over every attempt
        raise
    finally:
        supervisor.stop()
        bus.close()
        if supervisor.store is not None:  # Ray would restart it: this attempt is over
            ray.kill(supervisor.store.handle)
        ray.kill(log_sink)
        if group is not None:
            group.remove()
        log.info("roles stopped at %.1fs", time.perf_counter() - t0)
    return stats


def _pacer_step(supervisor: Supervisor | None, default: int) -> int:
    """The trainer's step, where a (re)started feeder continues (re-adding a live batch is a
    no-op); `default` while there is no live trainer to ask."""
    if supervisor is None or supervisor.pacer not in supervisor.runs:
        return default
    try:
        return ray.get(supervisor.actors[supervisor.pacer].stats.remote(), timeout=30)["step"]
    except (RayActorError, ray.exceptions.GetTimeoutError):
        return default


def _feeder_next_batch(supervisor: Supervisor, feeders: list[str]) -> int | None:
    """The first batch the feeder has not added yet (None if it cannot say)."""
    try:
        return max(
            ray.get(supervisor.actors[n].stats.remote(), timeout=30)["next_batch"] for n in feeders
        )
    except (RayActorError, ray.exceptions.GetTimeoutError, KeyError, ValueError):
        return None


class RayDeployment:
    """The driver's view of the role actors: their supervisor and the bus."""

    def __init__(self, supervisor: Supervisor, bus, run_dir) -> None:
        self.supervisor = supervisor
        self.bus = bus
        self.run_dir = run_dir

    def advance(self) -> bool:
        """Supervise for up to 0.2 s (health, restarts), then apply `streamrl scale` requests."""
        if self.supervisor.check(timeout_s=0.2):
            return True
        self.supervisor.reconcile(read_requests(self.run_dir))
        return False

    def records(self) -> list[dict[str, Any]]:
        try:
            records = ray.get(self.supervisor.actors[self.supervisor.pacer].drain.remote())
        except RayActorError as e:
            # Restarts it in place (or raises TrainerLost: the controller restarts all).
            self.supervisor.failed(self.supervisor.pacer, f"process died ({type(e).__name__})")
            return []
        if records:
            records[-1]["roles"] = _role_stats(self.supervisor, exclude=self.supervisor.pacer)
            self.supervisor.write_status()
        return records

    def role_stats(self) -> dict[str, Any]:
        return _role_stats(self.supervisor)

    def bus_stats(self) -> dict[str, Any]:
        return self.bus.stats()


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
