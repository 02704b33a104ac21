"""Building the trainer role: the learner (one process, or rank 0 of FSDP2 ranks), the loss of
`algorithm.*`, and the hooks around its steps (evaluation, checkpoints, the trained-samples log).

`TrainerWithHooks` is the role the runtimes loop: each optimizer step is followed by its hooks,
and its record is kept for the driver (`drain`). Under in-place recovery (Ray mode), its bus
defers acks until a checkpoint covers their rows (`bus/deferred.py`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from streamrl.api import fields as F
from streamrl.api.role import LoopPolicy, RoleBase
from streamrl.api.run import RunContext
from streamrl.bus.deferred import DeferredAcks
from streamrl.config.derived import batches_per_step, in_place_recovery, multimodal
from streamrl.config.schema import Config
from streamrl.models.loading import load_policy_model, policy_tokenizer, resolve_device

if TYPE_CHECKING:
    from streamrl.trainer.algos.objective import LossSettings
    from streamrl.trainer.hooks import TrainerHooks
    from streamrl.trainer.learner import Learner
    from streamrl.trainer.ranks import RankedLearner
    from streamrl.trainer.service import BatchTrainer, TrainerRole


def loss_settings(cfg: Config) -> LossSettings:
    from streamrl.trainer.algos.objective import LossSettings

    return LossSettings.of(cfg.algorithm, cfg.rollout.max_new_tokens)


def trainer_extra_fields(cfg: Config) -> tuple[str, ...]:
    """Fields the trainer needs beyond the rollout's, reward's and advantage's."""
    a = cfg.algorithm
    extra = []
    # With LoRA the trainer computes the reference log-probs itself (`trainer/lora.py`).
    if a.kl.coef > 0 and not a.kl.in_reward and not cfg.trainer.lora.rank:
        extra.append(F.REF_LOGPROBS)
    if a.off_policy.proximal == "pi_old":
        extra.append(F.OLD_LOGPROBS)
    if a.routing_replay == "rollout":
        extra.append(F.ROUTED_EXPERTS)
    if multimodal(cfg):  # a vision-language policy: the prompts' media
        extra.append(F.MEDIA)
    if cfg.agent.enabled:  # only the model's own tokens of an episode are trained
        extra += [F.LOSS_MASK, F.EPISODE]  # (the episode: its metrics per step)
    return tuple(extra)


def make_learner(ctx: RunContext) -> Learner | RankedLearner:
    """The policy learner: in this process, or rank 0 of `trainer.world_size` FSDP2 ranks."""
    import torch

    from streamrl.models.vision import freeze_vision
    from streamrl.trainer.learner import Learner

    a, t = ctx.cfg.algorithm, ctx.cfg.trainer
    torch.manual_seed(ctx.cfg.run.seed)
    kwargs = dict(
        pad_token_id=policy_tokenizer(ctx).pad_token_id,
        lr=a.lr,
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        temperature=ctx.cfg.rollout.temperature,
        settings=loss_settings(ctx.cfg),
        lr_schedule=a.lr_schedule,
        warmup_steps=a.lr_warmup_steps,
        total_steps=t.steps,
        min_lr_ratio=a.min_lr_ratio,
        padding_free=t.padding_free,
        router_aux_loss_coef=a.router_aux_loss_coef,
    )
    # Mixed precision: fp32 master weights whatever `model.dtype` (the engines' and scorers').
    dtype = "float32" if t.mixed_precision else ctx.cfg.model.dtype
    if t.world_size == 1:
        # oneDNN's linears are a custom op that inductor cannot lower and autocast does not
        # cast: a compiled or mixed-precision trainer keeps PyTorch's.
        model = load_policy_model(ctx, onednn=not (t.compile or t.mixed_precision), dtype=dtype)
        if ctx.cfg.model.freeze_vision:  # before the optimizer is built: it leaves them out
            freeze_vision(model)
        if t.lora.rank:
            from streamrl.trainer.lora import LoraLearner, apply_lora

            model = apply_lora(model, t.lora, seed=ctx.cfg.run.seed)
            return LoraLearner(
                model, compile=t.compile, mixed_precision=t.mixed_precision, **kwargs
            )
        return Learner(model, compile=t.compile, mixed_precision=t.mixed_precision, **kwargs)
    # Imported here: FSDP2 and distributed checkpoints cost every role process a second of
    # imports (DTensor, sympy) that only a multi-rank trainer needs.
    from streamrl.trainer.ranks import RankedLearner, RankSpec

    spec = RankSpec(
        model_dir=str(ctx.policy_dir),
        dtype=dtype,
        learner_kwargs=kwargs,
        trainer=t,
        device=resolve_device("trainer.device", t.device),
        num_threads=torch.get_num_threads(),
        seed=ctx.cfg.run.seed,
        freeze_vision=ctx.cfg.model.freeze_vision,
    )
    return RankedLearner(spec, t.world_size)


def make_batch_trainer(ctx: RunContext) -> BatchTrainer:
    """The learner with the step logic around it (the trainer role's and the synchronous loop's)."""
    from streamrl.trainer.service import BatchTrainer
    from streamrl.trainer.updates import UpdatePlan

    cfg = ctx.cfg
    a = cfg.algorithm
    learner = make_learner(ctx)
    settings = learner.settings
    updates = UpdatePlan(
        epochs=a.ppo_epochs,
        mini_batch_groups=a.mini_batch_groups,
        micro_batch_rows=a.micro_batch_groups * cfg.rollout.group_size,
        seed=cfg.run.seed,
    )
    return BatchTrainer(
        learner,
        # A zero-advantage sample still has a gradient when KL or entropy is in the loss.
        skip_zero_advantage=a.skip_zero_advantage
        and not settings.kl_in_loss
        and settings.entropy_coef == 0,
        max_staleness=cfg.rollout.max_staleness,
        mask_truncated=a.shaping.mask_truncated,
        # One update per batch keeps training each micro-batch as it arrives.
        updates=updates if updates.several(cfg.rollout.batch_prompts) else None,
    )


class TrainerWithHooks(RoleBase):
    """The trainer role plus evaluation and checkpoints; `records` collects finished steps."""

    def __init__(self, role: TrainerRole, hooks: TrainerHooks, deferred: DeferredAcks | None):
        self.role = role
        self.hooks = hooks
        self.deferred = deferred  # acks held until a checkpoint covers their rows
        # Appended by the loop thread, drained by the driver's thread: a deque is safe for that.
        self.records: deque[dict[str, Any]] = deque()
        if role.current == 0:
            self.records.append(hooks.initial_record())

    def configure(self, policy: LoopPolicy) -> None:
        super().configure(policy)
        self.role.configure(policy)

    def start(self) -> None:
        self.role.reset_step_clock()  # the loop starts now, maybe well after the role was built

    def step(self) -> bool:
        record = self.role.step()
        if record is not None:
            record = self.hooks.after_step(record)
            metrics = record["metrics"]
            if "time/checkpoint_s" in metrics and self.deferred is not None:
                started = time.perf_counter()
                self.deferred.commit()  # deferred acks: their rows are now in a checkpoint
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

    def republish(self) -> int:
        """Publish the current weights again (the weight store was restarted empty); called by
        the loop's thread between steps. Returns the version published."""
        learner = self.role.trainer.learner
        self.role.weights.publish(learner.version, learner.named_weights())
        return learner.version

    def close(self) -> None:
        self.role.close()
        self.role.trainer.learner.close()  # stops the FSDP2 ranks, if any


def build(ctx: RunContext, bus, weights, *, start_step: int) -> TrainerWithHooks:
    from streamrl.data.role import make_feeder
    from streamrl.trainer.checkpoint import load_checkpoint
    from streamrl.trainer.hooks import TrainerHooks
    from streamrl.trainer.service import TrainerRole

    cfg = ctx.cfg
    deferred = DeferredAcks(bus, cfg.runtime.lease_s) if in_place_recovery(cfg) else None
    if deferred is not None:
        bus = deferred
    batch_trainer = make_batch_trainer(ctx)
    learner = batch_trainer.learner
    if ctx.checkpoint is not None:
        load_checkpoint(ctx.checkpoint, learner)
    assert learner.version == start_step, (learner.version, start_step)
    weights.publish(learner.version, learner.named_weights())
    role = TrainerRole(
        bus,
        weights,
        batch_trainer,
        extra_fields=trainer_extra_fields(cfg),
        batch_prompts=cfg.rollout.batch_prompts,
        micro_batch_rows=cfg.algorithm.micro_batch_groups * cfg.rollout.group_size,
        lease_s=cfg.runtime.lease_s,
        start_step=start_step,
        refill=make_feeder(ctx) if cfg.algorithm.dynamic_sampling.enabled else None,
        max_rounds=batches_per_step(cfg),
    )
    hooks = TrainerHooks(ctx, learner, bus_state=bus.state_dict)
    return TrainerWithHooks(role, hooks, deferred)
