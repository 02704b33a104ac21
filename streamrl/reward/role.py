"""Building the reward role: the reward function of `reward.function`, scored in its sandbox.

The role's process never imports torch (rewards are plain numbers; the function runs in a
worker process of its own).
"""

from __future__ import annotations

import os

from streamrl.api.run import RunContext
from streamrl.config.derived import rows_per_batch
from streamrl.models.loading import policy_tokenizer
from streamrl.reward.sandbox import SandboxedScorer
from streamrl.reward.service import RewardRole


def make_scorer(ctx: RunContext) -> SandboxedScorer | None:
    """The run's reward functions behind their sandbox (its workers start at the first call);
    None when there are none (a judge or a remote reward alone)."""
    if not ctx.cfg.reward.functions:
        return None
    return SandboxedScorer.from_config(ctx.cfg.reward)


def make_eval_scorer(ctx: RunContext) -> SandboxedScorer:
    """What held-out evaluation scores with: `reward.eval_function`, else the reward functions."""
    return SandboxedScorer.from_config(ctx.cfg.reward.for_evaluation())


def make_remote(ctx: RunContext):
    """The remote reward service's client (`reward.remote`), None when it has no URL."""
    r = ctx.cfg.reward.remote
    if not r.url:
        return None
    from streamrl.reward.remote import RemoteReward, RemoteSettings

    settings = RemoteSettings(
        url=r.url,
        token=os.environ.get(r.token_env) or None,
        timeout_s=r.timeout_s,
        max_retries=r.max_retries,
        backoff_s=r.backoff_s,
        max_backoff_s=r.max_backoff_s,
        concurrency=r.concurrency,
        batch_size=r.batch_size,
    )
    return RemoteReward(settings)


def reward_sources(ctx: RunContext) -> dict:
    """`score_rows`'s keyword arguments for the run's remote reward and judge."""
    reward = ctx.cfg.reward
    return {
        "remote": make_remote(ctx),
        "remote_weight": reward.remote.weight,
        "judge_weight": reward.judge.weight if reward.judge.enabled else None,
    }


def build(ctx: RunContext, bus, weights, *, start_step: int) -> RewardRole:
    cfg = ctx.cfg
    return RewardRole(
        bus,
        make_scorer(ctx),
        policy_tokenizer(ctx),
        invalid_penalty=cfg.reward.invalid_output_penalty,
        max_rows=rows_per_batch(cfg),
        lease_s=cfg.runtime.lease_s,
        episodes=cfg.agent.enabled,
        **reward_sources(ctx),
    )
