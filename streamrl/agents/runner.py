"""Running a batch of agent episodes against one engine: what the agent rollout role and the
held-out evaluation both call.

`AgentRunner.run(tasks, params)` starts every task's episode at once in an asyncio loop of the
calling thread, batches their turns into the engine (`TurnScheduler`), enforces each episode's
deadline, and hands every finished episode to `on_finished` as soon as it ends (the rollout role
streams them to the bus). The result of an episode is its token ledger (the trained sample) and
its `Episode` outcome.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from streamrl.agents.chat import ChatFormat, chat_format, format_for_tokenizer
from streamrl.agents.episode import (
    Episode,
    EpisodeClient,
    Task,
    TurnTimeout,
    Workflow,
    env_loop,
    tool_loop,
)
from streamrl.agents.ledger import Segment, segment_fields
from streamrl.agents.scheduler import TurnScheduler
from streamrl.agents.tools import ToolBox, ToolLimits, load_tools
from streamrl.api import fields as F
from streamrl.api.engine import SamplingParams, WeightPoll
from streamrl.api.registry import load
from streamrl.config.agent_schema import AgentConfig
from streamrl.config.schema import Config


@dataclass
class Finished:
    """One episode's result: its task, its client (ledger, counters) and outcome."""

    task: Task
    client: EpisodeClient
    episode: Episode
    seconds: float

    def fields(self) -> dict[str, Any]:
        """The rollout's bus fields of the episode's sample (its last ledger segment, on the
        row's prompt; an episode whose sample cannot be is `rewritten`, dropped and counted)."""
        seg = self.client.ledger.sample(self.task.prompt_ids) or Segment(self.task.prompt_ids)
        return {
            **segment_fields(seg),
            F.FINISH_REASON: self.client.finish_reason,
            F.EPISODE: self.outcome(),
        }

    def outcome(self) -> dict[str, Any]:
        """The `episode` field: what the reward role and the metrics read."""
        e = self.episode
        return {
            "final_text": e.final_text,
            "reward": e.reward,
            "turn_rewards": list(e.turn_rewards),
            "status": e.status,
            "reason": e.reason,
            "metrics": {**self.client.metrics(), **e.metrics, "seconds": self.seconds},
        }


def make_workflow(cfg: AgentConfig, tokenizer=None) -> Workflow:
    """The workflow `agent.workflow` names, with the config's limits bound."""
    if cfg.workflow == "tool_loop":
        return functools.partial(tool_loop, max_turns=cfg.max_turns)
    if cfg.workflow == "env_loop":
        if not cfg.environment:
            raise ValueError("agent.workflow=env_loop needs agent.environment=package.module:Env")
        return functools.partial(env_loop, make_env=load(cfg.environment), max_turns=cfg.max_turns)
    if cfg.workflow == "program":
        from streamrl.agents.program import program_workflow

        return program_workflow(cfg, tokenizer)
    if ":" not in cfg.workflow:
        raise ValueError(
            f"agent.workflow={cfg.workflow!r}: expected 'tool_loop', 'env_loop', 'program' or "
            "'package.module:function'"
        )
    return load(cfg.workflow)


def make_toolbox(cfg: AgentConfig) -> ToolBox:
    limits = ToolLimits(
        timeout_s=cfg.tool_timeout_s,
        max_output_chars=cfg.tool_output_chars,
        max_calls=cfg.max_tool_calls,
        retries=cfg.tool_retries,
    )
    return ToolBox(load_tools(cfg.tools), limits)


def resolve_format(cfg: AgentConfig, tokenizer) -> ChatFormat:
    return format_for_tokenizer(tokenizer) if cfg.format == "auto" else chat_format(cfg.format)


class AgentRunner:
    """Runs episodes of `agent.workflow` with the run's tools on `engine`."""

    def __init__(self, engine, tokenizer, cfg: AgentConfig, *, max_batch: int = 512):
        self.engine = engine
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.chat = resolve_format(cfg, tokenizer)
        self.toolbox = make_toolbox(cfg)
        self.workflow = make_workflow(cfg, tokenizer)
        self.max_batch = max_batch

    def run(
        self,
        tasks: Sequence[Task],
        params: SamplingParams,
        *,
        on_finished: Callable[[Finished], None] | None = None,
        before_call: Callable[[], None] | None = None,
        weight_poll: WeightPoll | None = None,
    ) -> list[Finished]:
        """Every task's episode, in task order (also streamed to `on_finished` as each ends)."""
        return asyncio.run(self._run(tasks, params, on_finished, before_call, weight_poll))

    async def _run(self, tasks, params, on_finished, before_call, weight_poll) -> list[Finished]:
        scheduler = TurnScheduler(
            self.engine,
            params,
            priority=self.cfg.priority,
            max_batch=self.max_batch,
            before_call=before_call,
            weight_poll=weight_poll,
            retries=self.cfg.engine_retries,
        )
        serving = asyncio.create_task(scheduler.run())
        try:
            return list(
                await asyncio.gather(*(self._episode(t, scheduler, on_finished) for t in tasks))
            )
        finally:
            scheduler.close()
            await serving

    async def _episode(self, task: Task, scheduler, on_finished) -> Finished:
        client = EpisodeClient(
            task,
            scheduler=scheduler,
            tokenizer=self.tokenizer,
            chat=self.chat,
            tools=self.toolbox.episode(),
            max_total_tokens=self.cfg.max_total_tokens,
            turn_timeout_s=self.cfg.turn_timeout_s,
        )
        started = time.perf_counter()
        try:
            episode = await asyncio.wait_for(
                self.workflow(task, client), timeout=self.cfg.episode_timeout_s
            )
        except TimeoutError:
            episode = Episode(
                status="timeout",
                reason=f"episode ran past agent.episode_timeout_s={self.cfg.episode_timeout_s}",
            )
        except TurnTimeout as error:
            episode = Episode(status="turn_timeout", reason=str(error))
        if episode.status == "ok" and client.ledger.sample(task.prompt_ids) is None:
            episode = Episode(
                episode.final_text,
                status="rewritten",
                reason="the conversation no longer starts with the task's prompt; its last "
                "segment is not a sample of this row",
                metrics=episode.metrics,
            )
        finished = Finished(task, client, episode, time.perf_counter() - started)
        if on_finished is not None:
            on_finished(finished)
        return finished


def agent_runner(cfg: Config, engine, tokenizer) -> AgentRunner | None:
    """The run's runner of episodes over `engine` (the rollout's, the synchronous loop's or the
    held-out evaluation's); None when `agent.enabled` is off."""
    if not cfg.agent.enabled:
        return None
    return AgentRunner(engine, tokenizer, cfg.agent, max_batch=cfg.rollout.max_batch_size)
