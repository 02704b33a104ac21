"""Agent episodes: the workflow interface, the per-episode model client, and the built-in loops.

A workflow is an async function `workflow(task, client) -> Episode`: it talks to the model only
through `client` (`await client.turn()` samples one assistant turn onto the episode's token
ledger; `client.add_messages([...])` appends tool results or environment text as context) and
returns the episode's outcome. The rollout role runs many of them at once; their turns are
batched into the engine by `TurnScheduler`.

Built in:

- `tool_loop`: the model calls tools until it answers without a call, or `max_turns` is reached.
  A malformed call and a tool's own error go back to the model as the tool's error result
  (counted); a tool's infrastructure failing past its retries ends the episode `infra_error`.
- `env_loop`: a Gym-style environment (`reset(seed, task)`, `step(action_text)` ->
  (observation, reward, done), `close()`; the task's prompt is the first observation), seeded
  by the task's group so every response of a GRPO group starts from the same state; per-turn
  rewards are summed into the episode's.

The episode's reward is the workflow's own (`Episode.reward`) when it sets one, else the run's
reward function scores `Episode.final_text` against the task's answer (in the reward sandbox,
like a single-turn response). An episode that cannot finish (its deadline, a failing tool
server) keeps reward None with its status and reason: dropped from training and counted, never
scored 0.
"""

from __future__ import annotations

import asyncio
import inspect
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamrl.agents.chat import ChatFormat, ToolCall
from streamrl.agents.ledger import TokenLedger
from streamrl.agents.tools import ToolInfraError, ToolSession
from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest


@dataclass(frozen=True)
class Task:
    """What an episode starts from: one prompt row of the bus."""

    sample_id: str
    prompt_ids: list[int]
    answer: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    group_id: str = ""


@dataclass
class Episode:
    """An episode's outcome. `status` other than ok (timeout, infra_error) drops it, counted."""

    final_text: str = ""
    reward: float | None = None
    """The workflow's reward; None lets the run's reward function score `final_text`."""
    turn_rewards: list[float] = field(default_factory=list)
    status: str = "ok"
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Turn:
    """One sampled assistant turn, parsed."""

    text: str
    content: str
    tool_calls: list[ToolCall]
    errors: list[str]
    finish_reason: str


class EpisodeLimit(Exception):
    """The episode used up `max_total_tokens`: it ends where it is."""


class TurnTimeout(Exception):
    """A turn ran past `agent.turn_timeout_s`: the episode is dropped (status turn_timeout)."""


class EpisodeClient:
    """A workflow's handle on the model: one episode's ledger, chat format and tools."""

    def __init__(
        self,
        task: Task,
        *,
        scheduler,
        tokenizer,
        chat: ChatFormat,
        tools: ToolSession,
        max_total_tokens: int,
        turn_timeout_s: float | None = None,
    ):
        self.task = task
        self.turn_timeout_s = turn_timeout_s
        self.ledger = TokenLedger(list(task.prompt_ids))
        self.chat = chat
        self.tools = tools
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self.max_total_tokens = max_total_tokens
        self.num_turns = 0
        self.num_malformed_calls = 0
        self.num_tool_calls = 0  # well-formed calls the model made (whoever ran them)
        self.finish_reason = "stop"

    @property
    def params(self):
        """The sampling parameters this episode's turns are drawn with (the run's or the
        evaluation's)."""
        return self._scheduler.params

    @property
    def tokens_left(self) -> int:
        return self.max_total_tokens - self.ledger.num_response_tokens

    async def turn(self) -> Turn:
        """Sample the next assistant turn onto the ledger. Raises `EpisodeLimit` when no token
        of the episode's budget is left."""
        if self.tokens_left <= 0:
            raise EpisodeLimit
        request = GenerationRequest(
            f"{self.task.sample_id}/t{self.num_turns}", self.ledger.all_ids()
        )
        pending = self._scheduler.generate(request, self.ledger.oldest_version())
        try:
            result = await asyncio.wait_for(pending, timeout=self.turn_timeout_s)
        except TimeoutError:
            raise TurnTimeout(
                f"turn {self.num_turns} ran past agent.turn_timeout_s={self.turn_timeout_s}"
            ) from None
        ids, logprobs, versions = result.response_ids, result.logprobs, result.versions
        finish = result.finish_reason
        if len(ids) > self.tokens_left:  # the budget ends inside this turn
            keep = self.tokens_left
            ids, logprobs, versions, finish = ids[:keep], logprobs[:keep], versions[:keep], "length"
        self.ledger.add_sampled(ids, logprobs, versions, result.extra.get(F.ROUTED_EXPERTS))
        self.num_turns += 1
        self.finish_reason = finish
        text = self._tokenizer.decode(list(ids), skip_special_tokens=False)
        parsed = self.chat.parse(text, self.tools.schemas)
        self.num_malformed_calls += len(parsed.errors)
        self.num_tool_calls += len(parsed.tool_calls)
        return Turn(text, parsed.content, parsed.tool_calls, parsed.errors, finish)

    def add_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Append tool results / user or environment turns after the model's last turn, as
        context tokens (rendered by the chat format, opening the next assistant turn). Raises
        `EpisodeLimit` when they do not fit the budget."""
        text = self.chat.continuation(list(messages), self.tools.schemas)
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) >= self.tokens_left:
            raise EpisodeLimit
        self.ledger.add_context(ids)

    def metrics(self) -> dict[str, float]:
        return {
            "turns": float(self.num_turns),
            "tool_calls": float(self.num_tool_calls),
            "tool_errors": float(sum(self.tools.errors.values())),
            "malformed_calls": float(self.num_malformed_calls),
            "sampled_tokens": float(self.ledger.current.num_sampled),
            "splits": float(self.ledger.num_splits),
        }


Workflow = Callable[[Task, EpisodeClient], Awaitable[Episode]]


async def tool_loop(task: Task, client: EpisodeClient, *, max_turns: int = 4) -> Episode:
    """The model calls tools until it answers without one, or `max_turns` turns are sampled."""
    last = ""
    try:
        for _ in range(max_turns):
            turn = await client.turn()
            last = turn.content
            if turn.finish_reason == "length" or not (turn.tool_calls or turn.errors):
                return Episode(final_text=turn.content)
            messages = [_error_message(client.chat, message) for message in turn.errors]
            for call in turn.tool_calls:
                result = await client.tools.call(call.name, call.arguments)
                messages.append(client.chat.tool_message(call, result.text))
            client.add_messages(messages)
    except EpisodeLimit:
        pass
    except ToolInfraError as error:
        return Episode(final_text=last, status="infra_error", reason=f"tool: {error}")
    return Episode(final_text=last)


def _error_message(chat: ChatFormat, error: str) -> dict[str, Any]:
    return chat.tool_message(ToolCall("invalid_call", {}, "call_invalid"), f"error: {error}")


class Environment(Protocol):
    """A multi-step environment the model acts in (text in, text out). The task's prompt is
    the first observation; `reset` sets the start state."""

    def reset(self, seed: int, task: Task) -> None: ...
    def step(self, action: str) -> tuple[str, float, bool]: ...
    def close(self) -> None: ...


async def env_loop(
    task: Task, client: EpisodeClient, *, make_env: Callable[[], Environment], max_turns: int = 8
) -> Episode:
    """Act in an environment: the model's turn is the action, the observation goes back to it
    as a user turn; per-step rewards add up to the episode's reward. The environment is seeded
    by the task's group, so a GRPO group shares its start state."""
    env = make_env()
    rewards: list[float] = []
    last = ""
    try:
        await _maybe_await(env.reset(group_seed(task.group_id), task))
        for _ in range(max_turns):
            turn = await client.turn()
            last = turn.content
            observation, reward, done = await _maybe_await(env.step(turn.content))
            rewards.append(float(reward))
            if done:  # (a turn cut at rollout.max_new_tokens is still an action)
                break
            client.add_messages([{"role": "user", "content": observation}])
    except EpisodeLimit:
        pass
    finally:
        await _maybe_await(env.close())
    return Episode(final_text=last, reward=sum(rewards), turn_rewards=rewards)


def group_seed(group_id: str) -> int:
    """A stable seed for the environment of a GRPO group (the same for all its responses)."""
    return zlib.crc32(group_id.encode())


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
