"""The synchronous loop: generate a batch, score it, train on it, update the engine; repeat.

It runs every stage in turn in one process, on all the cores it is given, and is the baseline
that `max_staleness=0` must reproduce exactly and that async mode is measured against. It uses
the same functions as the roles, so the two differ only in scheduling. Under dynamic sampling a
step generates refill batches until it has enough groups with signal, and trains the same
groups the trainer role would (`trainer/dynamic_sampling.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from streamrl.agents.role import task_of
from streamrl.agents.runner import agent_runner
from streamrl.api import fields as F
from streamrl.api.run import RunContext
from streamrl.config.derived import batches_per_step
from streamrl.critic.role import make_critic
from streamrl.data.role import make_feeder
from streamrl.models.loading import load_policy_model, policy_tokenizer
from streamrl.reference.service import reference_fields
from streamrl.reward.role import make_scorer, reward_sources
from streamrl.reward.service import score_rows
from streamrl.rollout.engines import make_engine, sampling_params
from streamrl.rollout.service import result_fields, to_requests
from streamrl.runtime.errors import building
from streamrl.trainer.advantage import NORMALISER_FILE, NormaliserLog, advantage_fields
from streamrl.trainer.advantage_role import advantage_settings
from streamrl.trainer.algos.shaping import RewardNormaliser
from streamrl.trainer.checkpoint import load_checkpoint
from streamrl.trainer.dynamic_sampling import SURPLUS, StepGroups, group_informative, groups_of
from streamrl.trainer.hooks import TrainerHooks
from streamrl.trainer.role import make_batch_trainer


def run_sync(
    ctx: RunContext, on_record: Callable[[dict[str, Any]], None], *, start_step: int = 0
) -> dict[str, Any]:
    cfg = ctx.cfg
    tokenizer = policy_tokenizer(ctx)
    with building("feeder"):
        feeder = make_feeder(ctx)
    with building("trainer"):
        trainer = make_batch_trainer(ctx)
    if ctx.checkpoint is not None:
        load_checkpoint(ctx.checkpoint, trainer.learner)
    hooks = TrainerHooks(ctx, trainer.learner)
    with building("rollout"):
        engine = make_engine(ctx)
    engine.load_weights(trainer.learner.version, trainer.learner.named_weights())
    agents = agent_runner(cfg, engine, tokenizer)  # None: one response a prompt
    with building("reward"):
        scorer = make_scorer(ctx)
        sources = reward_sources(ctx)
    judge = None
    if cfg.reward.judge.enabled:
        from streamrl.judge.role import judge_fields, make_judge

        with building("judge"):
            judge = make_judge(ctx)
    # A LoRA trainer scores the reference log-probs itself, its adapters off (trainer/lora.py).
    has_reference = cfg.algorithm.kl.coef > 0 and not cfg.trainer.lora.rank
    reference = load_policy_model(ctx) if has_reference else None
    adv_settings = advantage_settings(cfg)
    reward_norm = (
        RewardNormaliser(cfg.algorithm.shaping.reward_norm_momentum)
        if cfg.algorithm.shaping.reward_norm
        else None
    )
    norm_log = None
    if reward_norm is not None:
        norm_log = NormaliserLog(reward_norm, ctx.run_dir / NORMALISER_FILE, keep_batches=2)
        if ctx.checkpoint is not None:
            norm_log.restore(start_step)
    critic = make_critic(ctx) if cfg.algorithm.advantage.estimator == "gae" else None
    params = sampling_params(cfg)
    micro = cfg.algorithm.micro_batch_groups * cfg.rollout.group_size
    rollout_s = 0.0

    def batch_rows(step: int, round_index: int) -> list[dict[str, Any]]:
        """One generation batch of `step`, through every stage up to its advantages."""
        nonlocal rollout_s
        started = time.perf_counter()
        rows = [
            {"sample_id": r["sample_id"], "group_id": r["group_id"], **r["fields"]}
            for r in feeder.batch(step, round_index)
        ]
        if agents is not None:  # multi-turn episodes, as the agent rollout role runs them
            for row, done in zip(rows, agents.run([task_of(r) for r in rows], params), strict=True):
                row.update(done.fields())
        else:
            for row, result in zip(rows, engine.generate(to_requests(rows), params), strict=True):
                row.update(result_fields(result))
        rollout_s += time.perf_counter() - started
        if judge is not None:
            _merge(rows, judge_fields(judge, rows, tokenizer))
        penalty = cfg.reward.invalid_output_penalty
        _merge(rows, score_rows(scorer, tokenizer, rows, penalty, **sources))
        if reference is not None:
            _merge(
                rows,
                reference_fields(
                    reference,
                    rows,
                    pad_token_id=tokenizer.pad_token_id,
                    temperature=cfg.rollout.temperature,
                ),
            )
        if cfg.algorithm.off_policy.proximal == "pi_old":  # the pi_old role's job, at this version
            _merge(rows, _old_logprobs(trainer.learner, rows, tokenizer.pad_token_id, cfg))
        if critic is not None:
            _merge(rows, critic.values(rows))
        if norm_log is not None:
            norm_log.start_batch(step)
        _merge(rows, advantage_fields(rows, adv_settings, reward_norm))
        if norm_log is not None:
            norm_log.save()
        return rows

    if start_step == 0:
        on_record(hooks.initial_record())
    loop_started = time.perf_counter()
    try:
        for step in range(start_step, cfg.trainer.steps):
            started = time.perf_counter()
            batches = [batch_rows(step, 0)]
            rows, plan = batches[0], None
            if cfg.algorithm.dynamic_sampling.enabled:
                plan = StepGroups(
                    target=cfg.rollout.batch_prompts, max_rounds=batches_per_step(cfg)
                )
                rows, surplus = _refill(plan, batches, step, feeder, batch_rows)
                trainer.drop_rows(surplus, "surplus")
            for start in range(0, len(rows), micro):
                trainer.train_microbatch(rows[start : start + micro])
            record = trainer.finish()
            if plan is not None:
                record["metrics"].update(plan.metrics(step + 1))
            if critic is not None:  # one critic step per generation batch, as the critic role
                for batch in batches:
                    for start in range(0, len(batch), micro):
                        critic.accumulate(batch[start : start + micro])
                    record["metrics"].update(critic.step())
            engine.load_weights(trainer.learner.version, trainer.learner.named_weights())
            record["metrics"]["time/step_s"] = time.perf_counter() - started
            record["roles"] = {"rollout": {"busy_s": rollout_s}}
            on_record(hooks.after_step(record))
            if hooks.stopped:  # `streamrl stop RUN_DIR`
                break
    finally:
        for part in (scorer, sources["remote"], judge):
            if part is not None:
                part.close()
        trainer.learner.close()
    return {"rollout": {"busy_s": rollout_s}, "train_wall_s": time.perf_counter() - loop_started}


def _refill(plan: StepGroups, batches: list, step: int, feeder, batch_rows) -> tuple[list, list]:
    """Dynamic sampling: record each generation batch's groups and generate refill batches
    (appended to `batches`) while the plan wants them; return (rows to train, surplus rows)."""
    while True:
        plan.add_round(feeder.group_ids(step, len(batches) - 1))
        for gid, members in groups_of(batches[-1]).items():
            plan.record(gid, group_informative(members))
        if not plan.wants_round:
            break
        batches.append(batch_rows(step, len(batches)))
    verdicts = plan.decide()
    rows = [r for batch in batches for r in batch]
    surplus = [r for r in rows if verdicts[r["group_id"]] == SURPLUS]
    return [r for r in rows if verdicts[r["group_id"]] != SURPLUS], surplus


def _old_logprobs(learner, rows, pad_token_id: int, cfg) -> dict[str, dict[str, Any]]:
    out = reference_fields(
        learner.model, rows, pad_token_id=pad_token_id, temperature=cfg.rollout.temperature
    )
    return {
        k: {F.OLD_LOGPROBS: v[F.REF_LOGPROBS], F.OLD_VERSION: learner.version}
        for k, v in out.items()
    }


def _merge(rows: list[dict[str, Any]], updates: dict[str, dict[str, Any]]) -> None:
    for row in rows:
        row.update(updates.get(row["sample_id"], {}))
