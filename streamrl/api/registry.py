"""The registries of roles and rollout engines: the one place the runtime learns their names.

A role or an engine is registered by the dotted path of the function that builds it, imported
only in the process that builds it (so a process that never builds the trainer never imports
torch for it). The built-in ones are listed here; code outside the package adds its own with
`register_role` / `register_engine` in a module the config names in `run.plugins`, which every
process of a run imports before it builds anything (CONTRIBUTING.md shows both).

```python
# my_pkg/plugin.py, with run.plugins=[my_pkg.plugin]
from streamrl.api.registry import RoleSpec, register_engine, register_role

register_role(RoleSpec("reward", "my_pkg.judge:build"))   # replaces the built-in reward role
register_engine("toy", "my_pkg.toy_engine:build")         # rollout.engine=toy
```

A role builder is `build(ctx: RunContext, bus, weights, *, start_step: int) -> Role`; an engine
factory is `build(ctx: RunContext) -> Engine`. Imports no torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamrl.config.schema import Config


def _always(cfg: Config) -> bool:
    return True


@dataclass(frozen=True)
class RoleSpec:
    """What a role is, as the runtime needs to know it (never found out by probing the role)."""

    name: str
    """Role name: the key of `runtime.ray.roles.<name>` and of the role's log file."""
    builder: str
    """`package.module:function` building the role in its own process."""
    consumers: tuple[str, ...] | None = None
    """Bus consumer names it registers (each acks rows independently); None: just `name`.
    Empty for a role that only adds rows (the feeder)."""
    wanted: Callable[[Config], bool] = _always
    """Whether a run with this config has the role (the reference only with a KL term, ...)."""
    torchless: bool = False
    """Its process never imports torch (its fields are plain arrays): it starts sooner."""
    reads_train_rows: bool = False
    """It reads the training prompts (the feeder): other roles' processes are given a run
    context without them (a large dataset copied into every process costs memory)."""
    bus_only: bool = False
    """Only the bus (or a publish) gives it work, and wakes it at once: its empty steps wait
    `runtime.idle_wait_s` instead of `runtime.claim_wait_s`."""
    paces_run: bool = False
    """Its steps are the run's steps (the trainer): it publishes the weights the others
    subscribe to, its step records are the run's, the run ends when it is done, and a lost one
    resumes from the run's checkpoint. A run has exactly one such role."""
    restart_note: str = ""
    """What a restarted replica continues from, for the supervisor's log line."""
    description: str = field(default="", compare=False)

    @property
    def bus_consumers(self) -> tuple[str, ...]:
        return (self.name,) if self.consumers is None else self.consumers


def _has_reference(cfg: Config) -> bool:
    # A LoRA trainer scores the reference log-probs itself, its adapters off (trainer/lora.py).
    return cfg.algorithm.kl.coef > 0 and not cfg.trainer.lora.rank


def _has_pi_old(cfg: Config) -> bool:
    return cfg.algorithm.off_policy.proximal == "pi_old"


def _has_judge(cfg: Config) -> bool:
    return cfg.reward.judge.enabled


def _has_critic(cfg: Config) -> bool:
    return cfg.algorithm.advantage.estimator == "gae"


# Built in, in the order roles are built and listed. The trainer first: it publishes the first
# weights, which the others may wait for.
_ROLES: dict[str, RoleSpec] = {
    spec.name: spec
    for spec in (
        RoleSpec(
            "trainer", "streamrl.trainer.role:build", paces_run=True, description="optimizer steps"
        ),
        # One response a prompt (`rollout/role.py`), or an agent run's episodes.
        RoleSpec("rollout", "streamrl.agents.role:build", description="generation"),
        # A generative reward model's verdicts, added into the reward (`reward.judge`).
        RoleSpec("judge", "streamrl.judge.role:build", wanted=_has_judge, bus_only=True),
        RoleSpec("reward", "streamrl.reward.role:build", torchless=True, bus_only=True),
        RoleSpec("advantage", "streamrl.trainer.advantage_role:build", bus_only=True),
        RoleSpec(
            "reference", "streamrl.reference.role:build", wanted=_has_reference, bus_only=True
        ),
        RoleSpec("logp", "streamrl.reference.role:build_logp", wanted=_has_pi_old, bus_only=True),
        RoleSpec(
            "critic",
            "streamrl.critic.role:build",
            consumers=("critic", "critic_train"),  # scores new responses; trains on returns
            wanted=_has_critic,
            restart_note="the critic continues from its newest saved state",
        ),
        RoleSpec(
            "feeder",
            "streamrl.data.role:build",
            consumers=(),
            torchless=True,
            reads_train_rows=True,
            bus_only=True,
        ),
    )
}

_ENGINES: dict[str, str] = {
    "builtin": "streamrl.rollout.engines:builtin_engine",
    "vllm": "streamrl.rollout.engines:vllm_engine",
    "sglang": "streamrl.rollout.engines:sglang_engine",
}


def register_role(spec: RoleSpec) -> None:
    """Add a role, or replace the built-in role of the same name."""
    if ":" not in spec.builder:
        raise ValueError(f"RoleSpec.builder {spec.builder!r}: expected 'package.module:function'")
    _ROLES[spec.name] = spec


def register_engine(name: str, factory: str) -> None:
    """Make `rollout.engine=<name>` build its engine with `factory` ('package.module:function')."""
    if ":" not in factory:
        raise ValueError(f"engine factory {factory!r}: expected 'package.module:function'")
    _ENGINES[name] = factory


def role_spec(name: str) -> RoleSpec:
    try:
        return _ROLES[name]
    except KeyError:
        raise ValueError(f"unknown role {name!r}; roles: {', '.join(_ROLES)}") from None


def run_roles(cfg: Config) -> tuple[RoleSpec, ...]:
    """The roles of a run with this config, in build order."""
    return tuple(spec for spec in _ROLES.values() if spec.wanted(cfg))


def pacing_role(cfg: Config) -> str:
    """The name of the run's one role with `paces_run` (the trainer, unless a plugin replaced it)."""
    pacers = [spec.name for spec in run_roles(cfg) if spec.paces_run]
    if len(pacers) != 1:
        raise ValueError(
            f"a run needs exactly one role with RoleSpec.paces_run (its steps are the run's); "
            f"this one has {pacers or 'none'}"
        )
    return pacers[0]


def bus_consumers(cfg: Config) -> tuple[str, ...]:
    """Consumer names to register on the bus for a run with this config."""
    return tuple(c for spec in run_roles(cfg) for c in spec.bus_consumers)


def engine_names() -> tuple[str, ...]:
    return tuple(_ENGINES)


def engine_factory(name: str) -> Callable[..., Any]:
    if name not in _ENGINES:
        raise ValueError(
            f"rollout.engine={name!r} is not a known engine; known: {', '.join(_ENGINES)} "
            "(an engine of your own is registered with register_engine in a module named in "
            "run.plugins)"
        )
    return load(_ENGINES[name])


def load(path: str) -> Callable[..., Any]:
    """The function `package.module:function` names."""
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {path!r}: {type(e).__name__}: {e}") from e


def load_plugins(modules: Sequence[str]) -> None:
    """Import the modules `run.plugins` names (they register roles and engines); every process
    of a run calls this before it builds anything. Importing twice is a no-op."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"run.plugins: cannot import {module!r}: {e}") from e
