"""Building the critic role (PPO's value model, for GAE): its model, optimizer and snapshots."""

from __future__ import annotations

from streamrl.api.run import RunContext
from streamrl.config.derived import in_place_recovery, prompts_per_batch
from streamrl.models.loading import policy_tokenizer


def make_critic(ctx: RunContext):
    """The value model with its optimizer (the critic role's, and the synchronous loop's)."""
    import torch

    from streamrl.critic.service import Critic, load_value_model
    from streamrl.models.onednn import configure_linears

    c = ctx.cfg.critic
    torch.manual_seed(ctx.cfg.run.seed)
    model = load_value_model(ctx.policy_dir, ctx.cfg.model.dtype)
    configure_linears(model, ctx.cfg.model.onednn_linears)
    return Critic(
        model,
        pad_token_id=policy_tokenizer(ctx).pad_token_id,
        lr=c.lr,
        value_clip=c.value_clip,
        grad_clip=c.grad_clip,
    )


def build(ctx: RunContext, bus, weights, *, start_step: int):
    from streamrl.critic.service import CriticRole

    cfg = ctx.cfg
    return CriticRole(
        bus,
        weights,
        make_critic(ctx),
        groups_per_batch=prompts_per_batch(cfg),
        max_staleness=cfg.rollout.max_staleness,
        max_rows=cfg.algorithm.micro_batch_groups * cfg.rollout.group_size,
        lease_s=cfg.runtime.lease_s,
        state_dir=ctx.run_dir / "critic",
        save_every=cfg.trainer.checkpoint_every,
        start_batch=start_step,
        resume_step=start_step if ctx.checkpoint is not None else None,
        # The bus holds the rows no checkpoint covers yet only where the trainer's do too.
        defer_acks=in_place_recovery(cfg),
    )
