"""Configuration of agent runs (`agent:`): multi-turn episodes with tools. Imports no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.config.section import Section


class AgentConfig(Section):
    enabled: bool = False
    """Generate multi-turn episodes (docs/agents.md) instead of one response a prompt: each
    prompt row starts an episode of `workflow`; the model's turns are trained, tool output is
    not (the loss mask)."""
    workflow: str = "tool_loop"
    """`tool_loop` (call tools until an answer), `env_loop` (act in `environment`), `program`
    (an agent program of your own that talks to the OpenAI-compatible endpoint, see `program`),
    or `package.module:function`, an async function `(task, client) -> Episode` of your own."""
    environment: str | None = None
    """`workflow: env_loop`: the environment, `package.module:Name` of a class (or zero-argument
    function) whose instances have `reset(seed, task)`, `step(action) -> (observation, reward,
    done)` and `close()` (docs/agents.md)."""
    tools: list[str] = Field(default_factory=lambda: ["streamrl.agents.tools:calculate"])
    """Tools the model may call, as `package.module:function` (a plain or async Python function
    whose typed arguments become the tool's JSON schema) or a `Tool` object."""
    format: Literal["auto", "streamrl", "hermes", "qwen3"] = "auto"
    """Chat format of turns and tool calls: `streamrl` (the built-in model's), `hermes`
    (Qwen2.5: `<tool_call>{json}</tool_call>`), `qwen3`; auto: told from the tokenizer."""
    max_turns: int = Field(4, ge=1)
    """Most assistant turns an episode samples."""
    max_total_tokens: int = Field(256, ge=1)
    """Most tokens after the prompt an episode holds (sampled and tool output together); each
    turn samples at most `rollout.max_new_tokens`."""
    episode_timeout_s: float | None = Field(600.0, gt=0)
    """An episode running longer is dropped (status timeout, counted), never scored 0."""
    turn_timeout_s: float | None = Field(None, gt=0)
    """Deadline of one assistant turn, queueing and generation together (None: none); an
    episode whose turn runs past it is dropped (status turn_timeout, counted)."""
    engine_retries: int = Field(2, ge=0)
    """Retries of an engine call that raised, with exponential backoff (0.5 s, 1 s, ...);
    past them the error ends the rollout role's step (its rows are handed back and rerun)."""
    tool_timeout_s: float | None = Field(None, gt=0)
    """Deadline of each tool call (None: each tool's own, 10 s by default); past it the model
    gets an error result."""
    tool_output_chars: int = Field(2000, ge=16)
    """A tool result longer than this is cut (the model is told how much was cut)."""
    max_tool_calls: int = Field(8, ge=1)
    """Tool calls an episode may make; later calls get an error result."""
    tool_retries: int = Field(3, ge=0)
    """Retries of a tool call that failed on infrastructure (`ToolInfraError`), with
    exponential backoff; past them the episode is dropped (status infra_error)."""
    priority: Literal["oldest_version", "fifo"] = "oldest_version"
    """Order of queued turn requests: the episode holding the oldest tokens first (the
    staleness bound is then not hit by a starved episode), or first come first served."""
    program: list[str] | None = None
    """`workflow: program`: the command of an agent program run once per episode (e.g.
    `[python, examples/agent_openai.py]`; `python` is the run's own interpreter). It talks to
    the model with the `openai` client through OPENAI_BASE_URL and OPENAI_API_KEY, reads its
    task from STREAMRL_PROMPT, may post a reward to `/v1/reward`, and ends the episode when it
    exits (docs/agents.md)."""
    endpoint_host: str = "127.0.0.1"
    """Address of the OpenAI-compatible endpoint that program episodes talk to. Off loopback,
    every route needs an episode's key."""
    endpoint_port: int = Field(0, ge=0, le=65535)
    """Its port; 0 takes any free one (each program is told where in OPENAI_BASE_URL)."""
    max_programs: int = Field(8, ge=1)
    """Agent programs running at once in a batch of episodes; the others wait to start."""
