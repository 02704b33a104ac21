"""Contract of a role: the object a runtime loops, whatever the runtime.

A role (rollout, reward, reference, logp, critic, advantage, trainer, feeder, or one a user adds)
is built in its own process or thread by the builder its `RoleSpec` names (`api/registry.py`),
then driven by the runtime:

```
configure(policy)          once, before the loop: how long calls may block, may they overlap
start()                    the loop starts now (a role that times its steps resets its clock)
while not done: step()     one unit of work; False when there was none (the runtime backs off)
stats(), drain()           any time, from the driver: counters, and finished training records
close()                    once, after the loop, also after a failure
```

Roles declare what they are (`RoleSpec`) and receive what the runtime is (`LoopPolicy`); the
runtime never probes a role's attributes, and a role never guesses its runtime. Imports no torch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class LoopPolicy:
    """What the runtime allows a role's calls, decided once per role when it is built."""

    wait_s: float = 0.0
    """How long one call into the bus or the weight service may block waiting for work (a long
    poll). 0: never block (inline mode, where every role shares one thread)."""
    overlapping_calls: bool = False
    """The bus takes calls from several threads of one role at once (threads and Ray modes): a
    role may prefetch its next claim while it computes."""


@runtime_checkable
class Role(Protocol):
    """One RL role's loop body. Called from one thread only (the runtime's loop), except `stats`
    and `drain`, which the driver may call from another while the loop runs."""

    policy: LoopPolicy
    """The policy `configure` was given (the runtime's loop reads its `wait_s`)."""

    def configure(self, policy: LoopPolicy) -> None:
        """Called once, before `start`; the role keeps `policy.wait_s` as the longest wait of a
        step that finds nothing to do."""
        ...

    def start(self) -> None:
        """Called when the loop starts (maybe long after the role was built)."""
        ...

    def step(self) -> bool:
        """Do one unit of work; return whether any was done. A step that found none may have
        waited up to `policy.wait_s` inside a call: the runtime then looks again at once."""
        ...

    @property
    def done(self) -> bool:
        """True once the role has nothing more to do in this run (the trainer after its last
        step); the runtime ends the run when the trainer is done."""
        ...

    def stats(self) -> dict[str, Any]:
        """Cumulative counters (`busy_s`, `weights_s`, `tokens`, ...), read by the driver for
        metrics; under `metrics`, the role's latest values of its own metrics (name -> number,
        NaN for none yet), logged with the training step as they are."""
        ...

    def drain(self) -> list[dict[str, Any]]:
        """Training records finished since the last call (only the trainer has any)."""
        ...

    def close(self) -> None:
        """Release processes, threads and files the role holds; called once, last."""
        ...


class RoleBase(abc.ABC):
    """Defaults for the parts of `Role` most roles do not need: subclass and write `step`."""

    policy: LoopPolicy = LoopPolicy()

    def configure(self, policy: LoopPolicy) -> None:
        self.policy = policy

    @property
    def long_poll_s(self) -> float:
        """How long a call of this role may block waiting for work (`LoopPolicy.wait_s`)."""
        return self.policy.wait_s

    def start(self) -> None:  # noqa: B027 - a default: most roles keep no clock
        return None

    @abc.abstractmethod
    def step(self) -> bool:
        """One unit of work (`Role.step`)."""

    @property
    def done(self) -> bool:
        return False

    def stats(self) -> dict[str, Any]:
        return {}

    def drain(self) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:  # noqa: B027 - a default: most roles hold nothing to release
        return None
