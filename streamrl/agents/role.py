"""The rollout role of an agent run: each claimed prompt row is one episode, not one response.

Claiming, admission control (the staleness dial), weight pulls between engine calls and in-flight
updates inside them, streaming results to the bus and acknowledging are the single-turn rollout
role's (`rollout/service.py`); only generation differs: the claimed rows' episodes run together
(`AgentRunner`), each written to the bus the moment it ends, with its ledger as the sample
(`response_ids` after the prompt, per-token log-probs and versions, the `loss_mask`) and its
outcome in `episode` (the reward role scores its final answer, or takes the workflow's reward).

A row is acknowledged only after every episode of the claim is written: a rollout process killed
mid-episode leaves its lease to be handed back, and the episodes run again from their prompts
under the same request ids (the same tokens, where the weights are the same).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np

from streamrl.agents.episode import Task
from streamrl.agents.runner import AgentRunner, Finished, agent_runner
from streamrl.api import fields as F
from streamrl.api.run import RunContext
from streamrl.models.loading import policy_tokenizer
from streamrl.rollout.engines import make_engine, rows_per_claim, sampling_params
from streamrl.rollout.role import build as build_rollout
from streamrl.rollout.service import RolloutRole

log = logging.getLogger(__name__)


def task_of(row: dict[str, Any]) -> Task:
    return Task(
        sample_id=row["sample_id"],
        prompt_ids=[int(t) for t in np.asarray(row[F.PROMPT_IDS]).reshape(-1)],
        answer=str(row.get(F.ANSWER, "")),
        extra=dict(row.get(F.EXTRA) or {}),
        group_id=str(row.get("group_id", "")),
    )


class AgentRolloutRole(RolloutRole):
    claims = (F.PROMPT_IDS, F.ANSWER, F.EXTRA)

    def __init__(self, bus, weights, engine, runner: AgentRunner, **kwargs: Any):
        super().__init__(bus, weights, engine, **kwargs)
        self.runner = runner
        self.episodes: Counter[str] = Counter()  # by status
        self.episode_totals: Counter[str] = Counter()  # summed episode metrics

    def generate_rows(self, rows, emit) -> None:
        def on_finished(done: Finished) -> None:
            self.episodes[done.episode.status] += 1
            for name, value in done.outcome()["metrics"].items():
                self.episode_totals[name] += value
            emit({done.task.sample_id: done.fields()})

        self.runner.run(
            [task_of(r) for r in rows],
            self.params,
            on_finished=on_finished,
            before_call=self._load_newer,
            weight_poll=self.poll_inflight if self.inflight_updates else None,
        )

    def _load_newer(self) -> None:
        """Before each engine call of the episodes: newer weights, if there are any (between
        turns, so an episode's later turns are sampled by a newer policy)."""
        update = self.poll_inflight() if self.inflight_updates else None
        if update is not None:
            self.engine.load_weights(*update)

    def stats(self) -> dict[str, Any]:
        num = max(sum(self.episodes.values()), 1)
        return {
            **super().stats(),
            "episodes": dict(self.episodes),
            **{f"episode_{k}_mean": v / num for k, v in sorted(self.episode_totals.items())},
        }


def build(ctx: RunContext, bus, weights, *, start_step: int) -> RolloutRole:
    """The rollout role: the single-turn one (`rollout/role.py`), or with `agent.enabled` the
    agent role over the same engine."""
    cfg = ctx.cfg
    if not cfg.agent.enabled:
        return build_rollout(ctx, bus, weights, start_step=start_step)
    engine = make_engine(ctx)
    return AgentRolloutRole(
        bus,
        weights,
        engine,
        agent_runner(cfg, engine, policy_tokenizer(ctx)),
        params=sampling_params(cfg),
        max_staleness=cfg.rollout.max_staleness,
        max_rows=rows_per_claim(cfg),
        inflight_updates=cfg.rollout.inflight_weight_updates,
        lease_s=cfg.runtime.lease_s,
    )
