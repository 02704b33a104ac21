"""Building and looping roles, the same way in every runtime.

A role is built in the process (or thread) that runs it, by the builder its `RoleSpec` names
(`api/registry.py`), then configured with the runtime's `LoopPolicy` and looped by `loop_role`:
an asyncio-free loop in a thread of its own (threads mode, Ray actors), or one turn at a time by
inline mode's driver.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from streamrl.api.registry import RoleSpec, load, load_plugins, role_spec
from streamrl.api.role import LoopPolicy, Role
from streamrl.api.run import RunContext
from streamrl.runtime.errors import building


def base_role(name: str) -> str:
    """`rollout#2` -> `rollout`: replicas share their role's code and bus consumer."""
    return name.split("#", 1)[0]


def build_role(
    name: str,
    ctx: RunContext,
    bus,
    weights,
    *,
    start_step: int,
    claim_wait_s: float = 0.0,
    idle_wait_s: float | None = None,
    overlapping_calls: bool = False,
) -> Role:
    """Build role `name` (or a replica of it) and configure its loop: `claim_wait_s` > 0 makes
    its empty claims long-poll the bus, for `idle_wait_s` (default: the same) in roles that only
    the bus gives work to; `overlapping_calls`: the bus takes calls from two threads at once."""
    with building(name):
        load_plugins(ctx.cfg.run.plugins)
        spec = role_spec(base_role(name))
        role = load(spec.builder)(ctx, bus, weights, start_step=start_step)
    role.configure(loop_policy(spec, claim_wait_s, idle_wait_s, overlapping_calls))
    return role


def loop_policy(
    spec: RoleSpec, claim_wait_s: float, idle_wait_s: float | None, overlapping_calls: bool
) -> LoopPolicy:
    """How long a role's empty calls wait: `idle_wait_s` for roles that only the bus, or a
    publish, gives work to (woken by it at once), `claim_wait_s` for the others and wherever
    blocking is off (`claim_wait_s` = 0)."""
    wait_s = claim_wait_s
    if spec.bus_only and idle_wait_s is not None and claim_wait_s > 0:
        wait_s = idle_wait_s
    return LoopPolicy(wait_s=wait_s, overlapping_calls=overlapping_calls)


class RoleLoop:
    """Turns of one role's loop: a step, and after a step that did nothing a wait of `poll_s`,
    doubling while idle up to 16x, unless the step already waited inside the bus or the weight
    service (a long poll of its `LoopPolicy.wait_s`), in which case the next turn looks at once."""

    def __init__(self, role: Role, stop: threading.Event, poll_s: float):
        self.role = role
        self.stop = stop
        self.poll_s = poll_s
        self.idle_s = poll_s

    def turn(self) -> bool:
        """One step (and its back-off); returns whether it did any work."""
        started = time.monotonic()
        long_poll_s = self.role.policy.wait_s
        if self.role.step():
            self.idle_s = self.poll_s
            return True
        if long_poll_s > 0 and time.monotonic() - started >= long_poll_s / 2:
            self.idle_s = self.poll_s  # the step already waited (a long poll): look again now
        else:  # back off while there is nothing to do
            self.stop.wait(self.idle_s)
            self.idle_s = min(self.idle_s * 2, self.poll_s * 16)
        return False


def loop_role(
    role: Role,
    stop: threading.Event,
    poll_s: float,
    after_step: Callable[[], None] | None = None,
) -> None:
    """Call `role.step()` until `stop` is set or the role is done (a role's own thread or process)."""
    loop = RoleLoop(role, stop, poll_s)
    role.start()
    while not stop.is_set() and not role.done:
        loop.turn()
        if after_step is not None:
            after_step()


def stall_message(ctx: RunContext, role_stats: dict[str, Any], bus_stats: dict[str, Any]) -> str:
    """What to tell the user when no training step finished for `runtime.stall_timeout_s`."""
    return (
        f"no training step finished in {ctx.cfg.runtime.stall_timeout_s:.0f}s: the pipeline is "
        f"stuck (a role waiting for a field nobody writes?). Role stats: {role_stats}. "
        f"Bus: {bus_stats}. Raise runtime.stall_timeout_s if steps are legitimately this slow."
    )
