"""Supervision of the role actors in Ray mode: health checks, restarts, budgets, a status file.

Each role runs in its own actor. The supervisor watches two signals: the actor's loop ending
(with an error, or because its process died) and a periodic health ping that must be answered
within `runtime.ray.health_timeout_s` (a hung process is killed, then handled as dead).

- A stateless role (feeder, rollout, reward, reference, logp, advantage) is restarted in place:
  its open leases are handed back to the bus at once, so its rows are served again, and the new
  process pulls the current weights. The critic restarts the same way and
  continues from its newest state file (`critic/step-<k>.pt`).
- The trainer is stateful. With `resume_trainer` (`runtime.ray.trainer_recovery=in_place`) it is
  restarted alone from its latest checkpoint, the other roles running on (`runtime/recovery.py`
  says how the bus and the logs are rewound); without it `TrainerLost` is raised and the
  controller restarts every role from the latest checkpoint.
- Each role has `runtime.ray.max_restarts` restarts, with exponential backoff; when they are spent,
  the run fails with the role's last error.

The processes around the roles are watched too (`services`, health checks at the same interval,
and at once whenever a role fails, since a role often fails because of them):

| process | when it dies |
| --- | --- |
| weight store (`weights`, object-store channel) | Ray restarts it under the same handle and re-runs the calls in flight; the supervisor sees the new pid, asks the trainer to publish its current weights again, and counts a restart (same budget); engines keep their version meanwhile |
| bus shard (`bus#<k>`) | with `recover_shard` (in-place recovery): Ray restarts it empty under the same handle, holding the calls in flight; the supervisor sees the new pid and `recover_shard` rebuilds it while the other roles keep running (`runtime/recovery.py`); a restart counts against the same budget. Without it (or when Ray cannot restart it): `BusLost` is raised and the controller restarts every role from the latest checkpoint |

Every failure and action is logged, appended to `events.jsonl` in the run directory and to the
role's own log file (`logs/<role>.log`), and `roles.json` there always says where each role runs
(node, pid, log file), its restarts and its health; `streamrl status RUN_DIR` prints it.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from streamrl.api.registry import RoleSpec
from streamrl.runtime.errors import BusLost, RoleFailed, RoleNotBuilt, TrainerLost, one_line
from streamrl.runtime.logs import log_path, supervisor_line
from streamrl.runtime.roles import base_role
from streamrl.runtime.status import EVENTS_FILE, STATUS_FILE

log = logging.getLogger(__name__)


def _wait_gone(actor, timeout_s: float = 10.0) -> None:
    """Wait (a bounded time) until a killed actor's process is gone: calls to it then fail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=1.0)
        except RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.1)
    log.warning("a killed actor still answers after %.0fs", timeout_s)


class Supervisor:
    def __init__(
        self,
        make_actor: Callable[[str], Any],
        bus,
        run_dir: Path,
        *,
        specs: Mapping[str, RoleSpec],
        max_restarts: int,
        backoff_s: float,
        health_interval_s: float,
        health_timeout_s: float,
        log_sink=None,
        on_removed: Callable[[str], None] | None = None,
        resume_trainer: Callable[[], str] | None = None,
        recover_shard: Callable[[int], str] | None = None,
        store=None,
        service_restarts: Mapping[str, int] | None = None,
    ):
        self.make_actor = make_actor
        self.bus = bus
        self.run_dir = run_dir
        self.specs = specs
        self.pacer = next(name for name, spec in specs.items() if spec.paces_run)
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.log_sink = log_sink
        self.on_removed = on_removed  # a drained replica is gone (its placement bundle is free)
        self.resume_trainer = resume_trainer  # readies a restart in place; says what it did
        self.recover_shard = recover_shard  # rebuilds a restarted bus shard; says what it did
        self.actors: dict[str, Any] = {}
        self.runs: dict[str, Any] = {}
        self.info: dict[str, dict[str, Any]] = {}
        self.restarts: dict[str, int] = {}
        self._pings: dict[str, tuple[Any, float]] = {}
        self._last_health = 0.0
        self._stopped = False
        self.draining: dict[str, Any] = {}  # replica -> its run ref, while it finishes its work
        # The processes around the roles: bus shards, and the weight store when it is an actor
        # Ray restarts (`weights/dcs.py`; `store` has `.handle`).
        self.store = store
        self.services: dict[str, dict[str, Any]] = {}
        self._carried = dict(service_restarts or {})  # bus shard restarts of earlier attempts
        self._service_pings: dict[str, Any] = {}

    # -- starting ----------------------------------------------------------------------------------

    def start(self, names: list[str], *, run: bool = True) -> None:
        """Create the roles' actors and (unless `run` is false: see `run`) start their loops."""
        for name in names:
            self.actors[name] = self.make_actor(name)
        refs = [self.actors[n].info.remote() for n in names]
        infos = []
        for name, ref in zip(names, refs, strict=True):
            try:
                infos.append(ray.get(ref))
            except RayActorError as e:
                infos.append({"build_error": _start_error(name, e)})
            if "build_error" in infos[-1]:
                raise RoleNotBuilt(infos[-1]["build_error"], log=log_path(self.run_dir, name))
        for name, info in zip(names, infos, strict=True):
            self.info[name] = {
                **info,
                "healthy": True,
                "restarts": self.restarts.get(name, 0),
                "log": str(log_path(self.run_dir, name).relative_to(self.run_dir)),
            }
        if run:
            self.run(names)
        self.write_status()

    def watch_services(self) -> None:
        """Learn the bus shards' and the weight store's processes (their first health check)."""
        for name, ref in self._service_refs().items():
            pid = _pid(ray.get(ref, timeout=60))
            self.services[name] = {
                "pid": pid,
                "healthy": True,
                "restarts": self._carried.get(name, 0),
            }
        self.write_status()

    def _service_refs(self) -> dict[str, Any]:
        refs = {f"bus#{k}": ref for k, ref in self.bus.ping_all().items()}
        if self.store is not None:
            refs["weights"] = self.store.handle.incarnation.remote()
        return refs

    def check_services(self, timeout_s: float = 60.0) -> None:
        """Check every service now (a role failed: was it because of one?)."""
        for name, ref in self._service_refs().items():
            try:
                self._service_answered(name, ray.get(ref, timeout=timeout_s))
            except ray.exceptions.GetTimeoutError:
                pass  # busy, not dead: the next health check looks again
            except RayActorError as e:
                self.service_died(name, e)

    def _service_answered(self, name: str, answer: Any) -> None:
        info = self.services.get(name)
        if info is None:
            return
        pid = _pid(answer)
        if pid != info["pid"]:
            self._service_restarted(name, info["pid"], pid)

    def service_died(self, name: str, error: Exception) -> None:
        """Service `name` is gone (a health check failed, or a call to it did)."""
        self._service_lost(
            name, f"process died (pid {self.services[name]['pid']}, {type(error).__name__})"
        )

    def _service_lost(self, name: str, reason: str) -> None:
        """Mark service `name` down, log the event and raise `BusLost`, which restarts every
        role from the latest checkpoint."""
        info = self.services[name]
        info["healthy"] = False
        # A shard's rows are gone; the store only dies for good if Ray cannot restart it.
        what = "bus shard" if name.startswith("bus#") else "weight store"
        self._event(name, reason, f"{what} lost: every role restarts from the latest checkpoint")
        self.write_status()
        raise BusLost(f"{what} {name} lost: {reason}", process=name, since=time.time())

    def service_recovered(self, lost: BusLost, start_step: int) -> None:
        """Every role runs again after the loss of `lost.process`: log how long that took."""
        self._event(
            lost.process,
            "recovered",
            f"every role restarted from step {start_step}, "
            f"{time.time() - lost.since:.1f}s after the loss",
        )

    def _service_restarted(self, name: str, old_pid: int, new_pid: int) -> None:
        """Ray restarted a service (empty): a bus shard is rebuilt in place (`recover_shard`),
        the weight store gets the trainer's weights again."""
        t0 = time.monotonic()
        info = self.services[name]
        used = info["restarts"]
        shard = name.startswith("bus#")
        if shard and self.recover_shard is None:
            self._service_lost(name, f"process died (pid {old_pid})")
        if used >= self.max_restarts:
            info["healthy"] = False
            self._event(
                name, f"process died (pid {old_pid})", "restart budget spent: stopping the run"
            )
            self.write_status()
            raise RoleFailed(
                f"{'bus shard ' + name if shard else 'the weight store'}'s process died "
                f"{used + 1} times (runtime.ray.max_restarts={self.max_restarts})"
            )
        info.update(pid=new_pid, restarts=used + 1, healthy=True)
        self.restarts[name] = used + 1
        if shard:
            how = self.recover_shard(int(name.removeprefix("bus#")))
        elif self.pacer in self.runs:
            try:
                version = ray.get(self.actors[self.pacer].republish.remote(), timeout=300)
                how = f"the trainer published version {version} again"
            except (RayActorError, RayTaskError, ray.exceptions.GetTimeoutError) as e:
                how = f"the trainer could not publish again ({one_line(e)}): its next step will"
        else:
            how = "the trainer publishes when it restarts"
        info["recovery_s"] = round(time.monotonic() - t0, 3)
        self._event(
            name,
            f"process died (pid {old_pid})",
            f"restarted by Ray as pid {new_pid} ({used + 1}/{self.max_restarts}); {how} "
            f"in {info['recovery_s']:.1f}s",
        )
        self.write_status()

    def halt(self, names: list[str]) -> None:
        """Kill roles now (a shard's recovery restarts them with `start`) and wait until their
        processes are gone, so none acks, writes or logs anything more."""
        for name in names:
            self.runs.pop(name, None)
            self._pings.pop(name, None)
            try:
                ray.kill(self.actors[name])
            except Exception:  # already gone
                pass
        for name in names:
            _wait_gone(self.actors[name])

    def run(self, names: list[str]) -> None:
        """Start the loops of roles created by `start(..., run=False)`."""
        for name in names:
            self.runs[name] = self.actors[name].run.remote()

    # -- watching ------------------------------------------------------------------------------------

    def check(self, timeout_s: float) -> bool:
        """Handle roles whose loop ended; ping for health. True when the pacing role (the
        trainer) finished."""
        refs = {ref: name for name, ref in self.runs.items()}
        finished, _ = ray.wait(list(refs), timeout=timeout_s, num_returns=len(refs))
        pacer_done = False
        for ref in finished:
            name = refs[ref]
            try:
                ray.get(ref)
            except RayActorError as e:
                self.failed(name, f"process died ({type(e).__name__})")
                continue
            except RayTaskError as e:  # the role's own error, with its traceback in its log
                cause = e.cause if isinstance(e.cause, BaseException) else e
                self.failed(name, one_line(cause))
                continue
            except Exception as e:  # Ray's own (an object lost, ...)
                self.failed(name, one_line(e))
                continue
            if name == self.pacer:
                pacer_done = True
            else:
                del self.runs[name]  # a role whose work is done (e.g. the feeder's last batch)
        if not pacer_done:
            self._health()
        return pacer_done

    def _health(self) -> None:
        now = time.monotonic()
        for name, (ref, sent) in list(self._pings.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self._pings[name]
                self.info[name]["healthy"] = True
            elif now - sent > self.health_timeout_s and name in self.runs:
                del self._pings[name]
                self._event(
                    name, f"no answer to a health check in {self.health_timeout_s:.0f}s", "killed"
                )
                ray.kill(self.actors[name])  # its run ref now fails and `check` restarts it
        for name, ref in list(self._service_pings.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self._service_pings[name]
                try:
                    self._service_answered(name, ray.get(ref))
                except RayActorError as e:
                    self.service_died(name, e)
        if now - self._last_health >= self.health_interval_s:
            self._last_health = now
            for name in self.runs:
                if name not in self._pings:
                    self._pings[name] = (self.actors[name].ping.remote(), now)
            if self.services and not self._service_pings:
                self._service_pings = self._service_refs()

    def failed(self, name: str, reason: str) -> None:
        """Handle a role that failed: restart it, or raise (the trainer without in-place
        recovery, or the budget spent)."""
        self.info[name]["healthy"] = False
        self.runs.pop(name, None)
        self._pings.pop(name, None)
        if self.services:
            # A shard lost for good raises BusLost (restarting this role is moot); one that Ray
            # restarted is rebuilt first, which may restart this role already.
            self.check_services()
            if name in self.runs:
                return
        if name == self.pacer and self.resume_trainer is None:
            self._event(name, reason, "resume from the latest checkpoint, restarting every role")
            self.write_status()
            raise TrainerLost(f"trainer failed: {reason}")
        used = self.restarts.get(name, 0)
        if used >= self.max_restarts:
            self._event(name, reason, "restart budget spent: stopping the run")
            self.write_status()
            raise RoleFailed(
                f"role {name!r} failed {used + 1} times (runtime.ray.max_restarts={self.max_restarts}); "
                f"last failure: {reason}",
                log=log_path(self.run_dir, name),
            )
        self.restarts[name] = used + 1
        delay = self.backoff_s * 2**used
        try:
            ray.kill(self.actors[name])  # first: a trainer must not ack or log anything more
        except Exception:  # already gone
            pass
        restart = f"restart {used + 1}/{self.max_restarts} in {delay:.1f}s"
        if name == self.pacer:
            _wait_gone(self.actors[name])  # it may hold the tcp weight port its successor binds
            self._event(name, reason, f"{restart}, {self.resume_trainer()}")
        else:
            # With several replicas this also hands back the healthy ones' leases: safe (writes
            # are idempotent, a row is trained once), it only repeats some work.
            spec = self.specs[base_role(name)]
            released = sum(self.bus.release_consumer(c) for c in spec.bus_consumers)
            note = f" ({spec.restart_note})" if spec.restart_note else ""
            self._event(name, reason, f"{restart}; {released} leases handed back{note}")
        time.sleep(delay)
        self.start([name])

    # -- elastic replicas ------------------------------------------------------------------------------

    def replicas(self, role: str) -> list[str]:
        return sorted(n for n in self.runs if base_role(n) == role)

    def reconcile(self, wanted: dict[str, int]) -> None:
        """Start or drain replicas until each role in `wanted` has that many live ones."""
        for role, count in wanted.items():
            live = self.replicas(role)
            if not live and role not in {base_role(n) for n in self.actors}:
                continue  # a role this run does not have (e.g. reference without KL)
            if len(live) < count:
                used = {n for n in self.actors}
                fresh = [
                    n for n in (f"{role}#{i}" if i else role for i in range(64)) if n not in used
                ]
                added = fresh[: count - len(live)]
                self._event(role, f"{len(live)} replicas, {count} wanted", f"starting {added}")
                self.start(added)
            elif len(live) > count:
                surplus = sorted(live, key=lambda n: (n != role, n))[count:]
                for name in surplus:
                    self.actors[name].stop.remote()  # finishes the rows it holds, then returns
                    self.draining[name] = self.runs.pop(name)
                    self._pings.pop(name, None)
                self._event(role, f"{len(live)} replicas, {count} wanted", f"draining {surplus}")
        for name, ref in list(self.draining.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self.draining[name]
                ray.kill(self.actors.pop(name))
                self.info.pop(name, None)
                if self.on_removed is not None:
                    self.on_removed(name)
                self._event(name, "drained", "removed")
                self.write_status()

    # -- reporting ------------------------------------------------------------------------------------

    def _event(self, role: str, failure: str, action: str) -> None:
        log.warning("role %s: %s -> %s", role, failure, action)
        if self.log_sink is not None:
            self.log_sink.write.remote(role, [supervisor_line(failure, action)])
        with open(self.run_dir / EVENTS_FILE, "a") as f:
            f.write(
                json.dumps(
                    {"time": time.time(), "role": role, "failure": failure, "action": action}
                )
                + "\n"
            )

    def write_status(self) -> None:
        status = {
            "updated": time.time(),
            "running": not self._stopped,
            "roles": self.info,
            "services": self.services,
        }
        tmp = self.run_dir / (STATUS_FILE + ".tmp")
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(self.run_dir / STATUS_FILE)

    def stop(self) -> None:
        for actor in self.actors.values():
            try:
                actor.stop.remote()
            except Exception:
                pass
        pending = [*self.runs.values(), *self.draining.values()]
        if pending:
            ray.wait(pending, timeout=10, num_returns=len(pending))
        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception:
                pass
        # Until they are gone: a role still in its constructor (the run failed while another
        # was being built) outlived the kill, and Ray's shutdown then made it abort (SIGABRT).
        for actor in self.actors.values():
            _wait_gone(actor)
        self._stopped = True
        self.write_status()


def _pid(answer: Any) -> int:
    """The pid in a service's health answer: a shard's pid, or the store's `incarnation`."""
    return answer["pid"] if isinstance(answer, dict) else answer


def _start_error(name: str, error: RayActorError) -> str:
    """One line on why a role's process died before it answered: the last line Ray gives."""
    lines = [line.strip() for line in (error.error_msg or "").splitlines() if line.strip()]
    last = re.sub(r"\x1b\[[0-9;]*m", "", lines[-1]) if lines else type(error).__name__
    return f"the {name} role's process died while it started: {last}"
