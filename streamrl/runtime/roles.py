"""Building each role from the run context, the same way in every runtime.

A role is an object with `step() -> bool` (did it do any work) and `stats() -> dict`; the
runtime supplies the loop around it (an asyncio task inline, `loop_role` in a thread of its
own in threads mode and inside a Ray actor).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from streamrl.api.weights import wait_newer
from streamrl.bus.transform import TransformRole
from streamrl.data.feeder import PromptFeeder
from streamrl.models.loading import load_tokenizer
from streamrl.reward.service import RewardRole
from streamrl.rollout.service import RolloutRole
from streamrl.runtime import components as C
from streamrl.runtime.context import RunContext
from streamrl.runtime.errors import building
from streamrl.runtime.recovery import feeder_bound, in_place_recovery
from streamrl.trainer.checkpoint import load_checkpoint
from streamrl.trainer.hooks import TrainerHooks
from streamrl.trainer.service import TrainerRole

CONSUMERS = ("rollout", "reward", "advantage", "trainer")
# Roles whose process never imports torch (their fields are numpy arrays; the reward function
# runs in a sandbox process of its own): in Ray mode they start about 2 CPU-s sooner.
TORCHLESS_ROLES = ("feeder", "reward")


def base_role(name: str) -> str:
    """`rollout#2` -> `rollout`: replicas share their role's code and bus consumer."""
    return name.split("#", 1)[0]


def active_roles(ctx: RunContext) -> tuple[str, ...]:
    """The consuming roles of this run: reference only with a KL term, pi_old only for
    decoupled PPO, the critic only for GAE."""
    a = ctx.cfg.algorithm
    optional = (
        ("reference", a.kl_coef > 0),
        ("logp", a.proximal == "pi_old"),
        ("critic", a.advantage == "gae"),
    )
    return CONSUMERS + tuple(name for name, wanted in optional if wanted)


def bus_consumers(ctx: RunContext) -> tuple[str, ...]:
    """Consumer names to register on the bus: one per role, two for the critic (it scores new
    responses and, separately, trains on returns)."""
    roles = active_roles(ctx)
    return roles + (("critic_train",) if "critic" in roles else ())


class FeederRole:
    """Adds one batch of prompt groups whenever the bus has room (capacity backpressure), leaving
    `reserve_groups` free for the trainer's dynamic-sampling refills."""

    def __init__(
        self,
        bus,
        feeder: PromptFeeder,
        *,
        start_batch: int,
        end_batch: int,
        reserve_groups: int = 0,
        newest_batch: Callable[[], int] | None = None,
        wait_for_batch: Callable[[int, float], None] | None = None,
    ):
        self.bus = bus
        self.feeder = feeder
        self.next_batch = start_batch
        self.end_batch = end_batch
        self.reserve_groups = reserve_groups
        # When the trainer keeps trained rows for recovery (runtime/recovery.py), capacity no
        # longer bounds how far ahead the feeder runs: the newest admissible batch does.
        self.newest_batch = newest_batch
        # wait_for_batch(batch, wait_s): block until `batch` may be admissible (a newer policy
        # version), for at most wait_s; the runtime sets `claim_wait_s` where blocking is fine.
        self.wait_for_batch = wait_for_batch
        self.claim_wait_s = 0.0

    def step(self) -> bool:
        if self.next_batch >= self.end_batch:
            return False
        # The policy version first: while it rules the next batch out, the bus is not asked.
        if self.newest_batch is not None and self.next_batch > self.newest_batch():
            if self.wait_for_batch is not None and self.claim_wait_s > 0:
                self.wait_for_batch(self.next_batch, self.claim_wait_s)
            return False
        if not self.bus.can_add(
            self.feeder.batch_prompts + self.reserve_groups, wait_s=self.claim_wait_s
        ):
            return False
        self.bus.add_rows(self.feeder.batch(self.next_batch))
        self.next_batch += 1
        return True

    def stats(self) -> dict[str, Any]:
        return {"next_batch": self.next_batch}


def loop_role(
    role, stop: threading.Event, poll_s: float, after_step: Callable[[], None] | None = None
) -> None:
    """Call `role.step()` until `stop` is set or the role is done (a role's own thread or process).

    A step that did nothing is followed by a wait of `poll_s`, doubling while idle up to 16x,
    unless the step already waited inside the bus or the weight service (a long poll of the
    role's `claim_wait_s`), in which case the loop looks again at once.
    """
    idle_s = poll_s
    target = getattr(role, "role", role)  # the trainer's hooks wrap its role
    long_poll_s = getattr(target, "claim_wait_s", 0.0)
    reset_step_clock = getattr(target, "reset_step_clock", None)
    if reset_step_clock is not None:  # the loop starts now, maybe well after the role was built
        reset_step_clock()
    while not stop.is_set():
        if getattr(role, "done", False):
            return
        started = time.monotonic()
        if role.step():
            idle_s = poll_s
        elif long_poll_s > 0 and time.monotonic() - started >= long_poll_s / 2:
            idle_s = poll_s  # the step already waited (a long poll): look again now
        else:  # back off while there is nothing to do
            stop.wait(idle_s)
            idle_s = min(idle_s * 2, poll_s * 16)
        if after_step is not None:
            after_step()


def stall_message(ctx: RunContext, role_stats: dict[str, Any], bus_stats: dict[str, Any]) -> str:
    """What to tell the user when no training step finished for `runtime.stall_timeout_s`."""
    return (
        f"no training step finished in {ctx.cfg.runtime.stall_timeout_s:.0f}s: the pipeline is "
        f"stuck (a role waiting for a field nobody writes?). Role stats: {role_stats}. "
        f"Bus: {bus_stats}. Raise runtime.stall_timeout_s if steps are legitimately this slow."
    )


def bus_capacity_groups(ctx: RunContext) -> int:
    """At most (max_staleness + 1) batches of prompts in flight, plus room for the refill
    batches of the step being trained under dynamic sampling (reserved: the feeder leaves it)."""
    r = ctx.cfg.rollout
    return (r.max_staleness + C.batches_per_step(ctx.cfg)) * C.prompts_per_batch(ctx.cfg)


def build_role(
    name: str,
    ctx: RunContext,
    bus,
    weights,
    *,
    start_step: int,
    claim_wait_s: float = 0.0,
    idle_wait_s: float | None = None,
):
    """Build role `name`; `claim_wait_s` > 0 makes its empty claims long-poll the bus, for
    `idle_wait_s` (default: the same) in roles that only the bus gives work to."""
    with building(name):
        role = _build_role(name, ctx, bus, weights, start_step=start_step)
    target = role.role if isinstance(role, TrainerWithHooks) else role
    if hasattr(target, "claim_wait_s"):
        target.claim_wait_s = long_poll_s(target, claim_wait_s, idle_wait_s)
    if hasattr(target, "prefetch_claims"):  # a long-polling bus is a Ray bus: thread-safe
        target.prefetch_claims = claim_wait_s > 0
    return role


def long_poll_s(role, claim_wait_s: float, idle_wait_s: float | None) -> float:
    """How long `role` waits inside the bus (or the weight service) when it has no work:
    `idle_wait_s` for roles that only the bus, or a publish, gives work to (woken by it at
    once), `claim_wait_s` for the others and wherever blocking is off (`claim_wait_s` = 0)."""
    bus_only = isinstance(role, TransformRole | FeederRole)
    if bus_only and idle_wait_s is not None and claim_wait_s > 0:
        return idle_wait_s
    return claim_wait_s


def _build_role(name: str, ctx: RunContext, bus, weights, *, start_step: int):
    cfg, rt = ctx.cfg, ctx.cfg.runtime
    group_rows = C.prompts_per_batch(cfg) * cfg.rollout.group_size
    if name == "feeder":
        return FeederRole(
            bus,
            C.make_feeder(ctx),
            start_batch=start_step,
            end_batch=cfg.trainer.steps,
            reserve_groups=(C.batches_per_step(cfg) - 1) * C.prompts_per_batch(cfg),
            newest_batch=feeder_bound(cfg, weights, start_step),
            wait_for_batch=lambda batch, wait_s: wait_newer(
                weights, batch - cfg.rollout.max_staleness - 1, wait_s
            ),
        )
    if name == "rollout":
        return RolloutRole(
            bus,
            weights,
            C.make_engine(ctx),
            params=C.sampling_params(ctx),
            max_staleness=cfg.rollout.max_staleness,
            max_rows=C.rollout_rows_per_claim(cfg),
            inflight_updates=cfg.rollout.inflight_weight_updates,
            lease_s=rt.lease_s,
        )
    if name == "reward":
        return RewardRole(
            bus,
            C.make_scorer(ctx),
            load_tokenizer(ctx.policy_dir),
            invalid_penalty=cfg.reward.invalid_output_penalty,
            max_rows=group_rows,
            lease_s=rt.lease_s,
        )
    if name in ("reference", "logp"):
        from streamrl.reference.service import LogpRole, ReferenceRole

        model = C.load_policy_model(ctx)
        scoring = {
            "pad_token_id": load_tokenizer(ctx.policy_dir).pad_token_id,
            "temperature": cfg.rollout.temperature,
            "max_rows": group_rows,
            "lease_s": rt.lease_s,
        }
        if name == "logp":  # follows the published weights; the reference stays frozen
            return LogpRole(bus, weights, model, **scoring)
        return ReferenceRole(bus, model, **scoring)
    if name == "critic":
        from streamrl.critic.service import CriticRole

        return CriticRole(
            bus,
            weights,
            C.make_critic(ctx),
            groups_per_batch=C.prompts_per_batch(cfg),
            max_staleness=cfg.rollout.max_staleness,
            max_rows=cfg.algorithm.micro_batch_groups * cfg.rollout.group_size,
            lease_s=rt.lease_s,
            state_dir=ctx.run_dir / "critic",
            save_every=cfg.trainer.checkpoint_every,
            start_batch=start_step,
            resume_step=start_step if ctx.checkpoint is not None else None,
            # The bus holds the rows no checkpoint covers yet only where the trainer's do too.
            defer_acks=in_place_recovery(cfg),
        )
    if name == "advantage":
        from streamrl.trainer.advantage import NORMALISER_FILE, AdvantageRole  # torch

        return AdvantageRole(
            bus,
            weights,
            C.advantage_settings(cfg),
            groups_per_batch=C.prompts_per_batch(cfg),
            max_staleness=cfg.rollout.max_staleness,
            max_rows=group_rows,
            lease_s=rt.lease_s,
            normaliser_path=ctx.run_dir / NORMALISER_FILE,
            resume_step=start_step if ctx.checkpoint is not None else None,
            keep_batches=cfg.rollout.max_staleness + 2 * max(cfg.trainer.checkpoint_every, 1) + 2,
        )
    if name == "trainer":
        return build_trainer(ctx, bus, weights, start_step=start_step, checkpoint=ctx.checkpoint)
    raise ValueError(f"unknown role {name!r}; roles: feeder, reference, {', '.join(CONSUMERS)}")


class TrainerWithHooks:
    """The trainer role plus evaluation and checkpoints; `records` collects finished steps."""

    def __init__(self, role: TrainerRole, hooks: TrainerHooks):
        self.role = role
        self.hooks = hooks
        # Appended by the loop thread, drained by the driver's thread: a deque is safe for that.
        self.records: deque[dict[str, Any]] = deque()
        if role.current == 0:
            self.records.append(hooks.initial_record())

    def step(self) -> bool:
        record = self.role.step()
        if record is not None:
            record = self.hooks.after_step(record)
            metrics = record["metrics"]
            if "time/checkpoint_s" in metrics and hasattr(self.role.bus, "commit"):
                started = time.perf_counter()
                self.role.bus.commit()  # deferred acks (runtime/recovery.py): now on disk
                metrics["time/checkpoint_s"] += time.perf_counter() - started
            self.role.reset_step_clock()  # evaluation and checkpoint are not the next step's
            self.records.append(record)
        return self.role.progressed

    @property
    def done(self) -> bool:
        return self.hooks.stopped or self.role.current >= self.hooks.ctx.cfg.trainer.steps

    def drain(self) -> list[dict[str, Any]]:
        out = []
        while self.records:
            out.append(self.records.popleft())
        return out

    def stats(self) -> dict[str, Any]:
        return {"busy_s": self.role.trainer.busy_s, "step": self.role.current}

    def close(self) -> None:
        self.role.close()
        self.role.trainer.learner.close()  # stops the FSDP2 ranks, if any


def build_trainer(
    ctx: RunContext, bus, weights, *, start_step: int, checkpoint=None
) -> TrainerWithHooks:
    cfg = ctx.cfg
    batch_trainer = C.make_batch_trainer(ctx)
    learner = batch_trainer.learner
    if checkpoint is not None:
        load_checkpoint(checkpoint, learner)
    assert learner.version == start_step, (learner.version, start_step)
    weights.publish(learner.version, learner.named_weights())
    role = TrainerRole(
        bus,
        weights,
        batch_trainer,
        extra_fields=C.trainer_extra_fields(cfg),
        batch_prompts=cfg.rollout.batch_prompts,
        micro_batch_rows=cfg.algorithm.micro_batch_groups * cfg.rollout.group_size,
        lease_s=cfg.runtime.lease_s,
        start_step=start_step,
        refill=C.make_feeder(ctx) if cfg.algorithm.dynamic_sampling else None,
        max_rounds=C.batches_per_step(cfg),
    )
    return TrainerWithHooks(role, TrainerHooks(ctx, learner, bus_state=bus.state_dict))
