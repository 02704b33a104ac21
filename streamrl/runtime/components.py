"""Building a role's heavy parts (model, engine, learner, scorer) from the run context.

Each process builds its own; the same functions serve the sync loop, inline mode and Ray actors.
"""

from __future__ import annotations

import torch

from streamrl.api.engine import SamplingParams
from streamrl.data.feeder import PromptFeeder
from streamrl.data.prompts import encode_prompt
from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.reward.sandbox import SandboxedScorer
from streamrl.reward.scoring import resolve_callable
from streamrl.rollout.builtin_engine import BuiltinEngine
from streamrl.runtime.context import RunContext
from streamrl.trainer.algos.grpo import LossSettings
from streamrl.trainer.evaluate import greedy_accuracy
from streamrl.trainer.learner import Learner
from streamrl.trainer.service import BatchTrainer


def set_threads(num: int) -> None:
    torch.set_num_threads(num)


def make_feeder(ctx: RunContext) -> PromptFeeder:
    r = ctx.cfg.rollout
    tokenizer = load_tokenizer(ctx.policy_dir)
    return PromptFeeder(
        ctx.train_rows,
        tokenizer,
        batch_prompts=r.batch_prompts,
        group_size=r.group_size,
        seed=ctx.cfg.data.seed,
    )


def make_engine(ctx: RunContext, model=None) -> BuiltinEngine:
    tok = load_tokenizer(ctx.policy_dir)
    model = (
        model if model is not None else load_causal_lm(ctx.policy_dir, dtype=ctx.cfg.model.dtype)
    )
    return BuiltinEngine(
        model,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_batch_size=ctx.cfg.rollout.max_batch_size,
    )


def sampling_params(ctx: RunContext) -> SamplingParams:
    r = ctx.cfg.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, seed=ctx.cfg.run.seed
    )


def make_batch_trainer(ctx: RunContext) -> BatchTrainer:
    a = ctx.cfg.algorithm
    torch.manual_seed(ctx.cfg.run.seed)
    model = load_causal_lm(ctx.policy_dir, dtype=ctx.cfg.model.dtype)
    settings = LossSettings(a.clip_eps_low, a.clip_eps_high, a.kl_coef, a.tis_cap, a.loss_agg)
    learner = Learner(
        model,
        pad_token_id=load_tokenizer(ctx.policy_dir).pad_token_id,
        lr=a.lr,
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        temperature=ctx.cfg.rollout.temperature,
        settings=settings,
        lr_schedule=a.lr_schedule,
        total_steps=ctx.cfg.trainer.steps,
        min_lr_ratio=a.min_lr_ratio,
    )
    return BatchTrainer(
        learner,
        skip_zero_advantage=a.skip_zero_advantage and a.kl_coef == 0,
        max_staleness=ctx.cfg.rollout.max_staleness,
    )


def make_scorer(ctx: RunContext) -> SandboxedScorer:
    return SandboxedScorer(ctx.cfg.reward.function, timeout_s=ctx.cfg.reward.timeout_s)


class Evaluator:
    """Greedy held-out accuracy of a model, with its own engine over the same model object."""

    def __init__(self, ctx: RunContext, model):
        self.tokenizer = load_tokenizer(ctx.policy_dir)
        self.engine = make_engine(ctx, model)
        self.rows = ctx.eval_rows
        self.prompt_ids = [encode_prompt(self.tokenizer, r.prompt) for r in self.rows]
        self.reward_fn = resolve_callable(ctx.cfg.reward.function)
        self.max_new_tokens = ctx.cfg.rollout.max_new_tokens

    def accuracy(self) -> float:
        self.engine.model.eval()
        return greedy_accuracy(
            self.engine,
            self.tokenizer,
            self.rows,
            self.prompt_ids,
            self.reward_fn,
            self.max_new_tokens,
        )
