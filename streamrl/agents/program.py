"""Episodes of an external agent program: `agent.workflow: program` runs `agent.program` once per
episode, a process that talks to the model through the OpenAI API only.

    program_loop(task, client)
      ├─ open a session on the process's endpoint (agents/endpoint.py): a fresh API key
      ├─ start the program (its own process group) with
      │     OPENAI_BASE_URL   http://host:port/v1      OPENAI_API_KEY   the session's key
      │     STREAMRL_PROMPT   the task's prompt text   STREAMRL_SAMPLE_ID, STREAMRL_EXTRA (JSON)
      │   every chat request of the program is one turn of the episode, on its ledger
      └─ the program exits: the episode ends

The reward is the one the program posted to `/v1/reward`, if any; else the run's reward
function scores the content of the last turn the program was sent (`Episode.final_text`)
against the task's answer, which the program never sees. A program that exits non-zero drops
the episode (status infra_error, with its stderr's tail); one still running at the episode's
deadline is killed with its whole process group. At most `agent.max_programs` programs run at
once in a batch of episodes; the others wait for a slot before they start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import weakref
from collections.abc import Sequence

from streamrl.agents.endpoint import EndpointServer, Session, shared_endpoint
from streamrl.agents.episode import Episode, EpisodeClient, Task
from streamrl.api.engine import SamplingParams
from streamrl.config.agent_schema import AgentConfig

log = logging.getLogger(__name__)

OUTPUT_CHARS = 4000
"""How much of a program's stdout and stderr (each, the end) is kept for the log."""


async def program_loop(
    task: Task,
    client: EpisodeClient,
    *,
    command: Sequence[str],
    server: EndpointServer,
    tokenizer,
    max_turns: int,
    slots: asyncio.Semaphore | None = None,
) -> Episode:
    """Run `command` as the agent of one episode (see the module docstring)."""
    async with slots if slots is not None else contextlib.nullcontext():
        session = server.open(client, tokenizer, params=_run_params(client), max_turns=max_turns)
        try:
            code, out, err = await _run(command, _environment(task, session, server, tokenizer))
        finally:
            server.close(session)
    name = os.path.basename(command[0])
    log.debug(
        "program %s (%s) exited %d\nstdout: %s\nstderr: %s", name, task.sample_id, code, out, err
    )
    metrics = {"requests": float(session.num_requests)}
    if code != 0:
        log.warning("program %s (%s) exited %d; stderr:\n%s", name, task.sample_id, code, err)
        tail = err.strip()[-500:] or "(no stderr)"
        reason = f"agent program {' '.join(command)} exited {code}: {tail}"
        return Episode(session.final_text, status="infra_error", reason=reason, metrics=metrics)
    return Episode(session.final_text, reward=session.reward, metrics=metrics)


def _run_params(client: EpisodeClient) -> SamplingParams:
    """The sampling parameters the episode's turns are drawn with (the run's, or the
    evaluation's): requests asking for others are refused."""
    return client.params


def _environment(task: Task, session: Session, server: EndpointServer, tokenizer) -> dict:
    return {
        **os.environ,
        "OPENAI_BASE_URL": server.base_url,
        "OPENAI_API_KEY": session.key,
        "STREAMRL_PROMPT": tokenizer.decode(list(task.prompt_ids), skip_special_tokens=True),
        "STREAMRL_SAMPLE_ID": task.sample_id,
        "STREAMRL_EXTRA": json.dumps(dict(task.extra), default=str),
    }


async def _run(command: Sequence[str], env: dict) -> tuple[int, str, str]:
    """(exit code, stdout tail, stderr tail) of `command`. Whatever the program started is
    killed with its process group when it exits, and the whole group when the episode is
    cancelled (its deadline) while it runs."""
    proc = await asyncio.create_subprocess_exec(
        *command,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,  # its own process group
    )
    output = asyncio.gather(_tail(proc.stdout), _tail(proc.stderr))
    try:
        code = await proc.wait()
    except BaseException:  # the deadline (CancelledError), or anything else: nothing outlives it
        _kill_group(proc.pid)
        await asyncio.shield(proc.wait())
        output.cancel()
        raise
    _kill_group(proc.pid)  # a child left behind still holding the pipes
    out, err = await output
    return code, out, err


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _tail(stream: asyncio.StreamReader | None, limit: int = OUTPUT_CHARS) -> str:
    """The last `limit` characters a stream carries, read to its end."""
    kept = b""
    while stream is not None and (chunk := await stream.read(65536)):
        kept = (kept + chunk)[-limit:]
    return kept.decode(errors="replace")


class ProgramWorkflow:
    """`program_loop` with a run's settings bound: the workflow of `agent.workflow: program`.
    The endpoint starts with the first episode; the program slots belong to each batch's event
    loop."""

    def __init__(self, cfg: AgentConfig, tokenizer):
        if not cfg.program:
            raise ValueError(
                "agent.workflow=program needs agent.program, the command that runs the agent "
                "(e.g. [python, examples/agent_openai.py])"
            )
        self.cfg = cfg
        self.tokenizer = tokenizer
        command = list(cfg.program)
        if command[0] in ("python", "python3"):  # the run's own interpreter and packages
            command[0] = sys.executable
        self.command = command
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def __call__(self, task: Task, client: EpisodeClient) -> Episode:
        loop = asyncio.get_running_loop()
        if loop not in self._slots:
            self._slots[loop] = asyncio.Semaphore(self.cfg.max_programs)
        return await program_loop(
            task,
            client,
            command=self.command,
            server=shared_endpoint(self.cfg.endpoint_host, self.cfg.endpoint_port),
            tokenizer=self.tokenizer,
            max_turns=self.cfg.max_turns,
            slots=self._slots[loop],
        )


def program_workflow(cfg: AgentConfig, tokenizer) -> ProgramWorkflow:
    """The workflow `agent.workflow: program` names (`AgentRunner` calls this)."""
    return ProgramWorkflow(cfg, tokenizer)
