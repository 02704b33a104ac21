"""The OpenAI-compatible endpoint and agent programs, through the real `AgentRunner`, a real
HTTP server and the real `openai` client.

Turns come from the builtin engine on the tiny model where any text will do, and from a
scripted engine (an `Engine` that answers each prompt with a known turn) where the test needs to
know the turn: a tool call, then the copy of the tool's result.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import openai
import pytest

from streamrl.agents.chat import chat_format
from streamrl.agents.endpoint import MODEL_NAME, EndpointServer
from streamrl.agents.episode import Episode, Task
from streamrl.agents.program import ProgramWorkflow
from streamrl.agents.runner import AgentRunner
from streamrl.api.engine import GenerationResult, SamplingParams
from streamrl.config.agent_schema import AgentConfig
from streamrl.models.loading import load_causal_lm
from streamrl.models.tokenizer import build_tokenizer
from streamrl.rollout.builtin_engine import BuiltinEngine

REPO = Path(__file__).resolve().parents[3]
CHAT = chat_format("streamrl")
PARAMS = SamplingParams(max_new_tokens=48, temperature=1.0)
CALCULATE = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
CALL = '<call>calculate("12*34")</call><|end|>'


class CalculatorEngine:
    """Answers like a model that has learnt the calculator task: a prompt ending in a user turn
    `a*b=` gets the tool call, one ending in a tool result gets that result copied."""

    version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def load_weights(self, version, named_tensors) -> None:
        raise AssertionError("not used")

    def generate(self, requests, params, *, on_finished=None, weight_poll=None):
        results = []
        for request in requests:
            prompt = self.tokenizer.decode(list(request.prompt_ids), skip_special_tokens=False)
            tool = re.search(r"<\|tool\|>([^<]*)<\|end\|><\|assistant\|>$", prompt)
            user = re.findall(r"<\|user\|>(\d+)\*(\d+)=", prompt)
            if tool:
                text = f"{tool.group(1)}<|end|>"
            elif user:
                text = f'<call>calculate("{user[-1][0]}*{user[-1][1]}")</call><|end|>'
            else:
                text = "?<|end|>"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            results.append(
                GenerationResult(request.request_id, ids, [-0.5] * len(ids), [0] * len(ids), finish)
            )
        if on_finished is not None:
            on_finished(results)
        return results


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def server():
    server = EndpointServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def builtin(model_dir, tok):
    model = load_causal_lm(model_dir)
    return BuiltinEngine(
        model, tokenizer=tok, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )


def task(tok, prompt: str = "12*34=", sample_id: str = "s0", extra=None) -> Task:
    text = CHAT.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return Task(sample_id, ids, answer="408", extra=extra or {}, group_id="g0")


def run_program(engine, tok, server, body, *, cfg: AgentConfig | None = None, tasks=None):
    """Run one episode (per task) whose workflow opens a session and awaits `body(openai
    client, session)`; returns the runner's `Finished` and what `body` returned."""
    cfg = cfg or AgentConfig(enabled=True, max_turns=4, max_total_tokens=128)
    runner = AgentRunner(engine, tok, cfg)
    results = []

    async def workflow(t, client) -> Episode:
        session = server.open(client, tok, params=PARAMS, max_turns=cfg.max_turns)
        api = openai.AsyncOpenAI(base_url=server.base_url, api_key=session.key, max_retries=0)
        try:
            results.append(await body(api, session))
        finally:
            server.close(session)
            await api.close()
        return Episode(session.final_text, reward=session.reward)

    runner.workflow = workflow
    finished = runner.run(tasks or [task(tok)], PARAMS)
    return finished, results


def runs(seg) -> list[tuple[int, list[int]]]:
    """The segment's tokens as (mask, ids) runs."""
    out: list[tuple[int, list[int]]] = []
    for token, mask in zip(seg.ids, seg.mask, strict=True):
        if out and out[-1][0] == mask:
            out[-1][1].append(token)
        else:
            out.append((mask, [token]))
    return out


def spans(seg) -> list[tuple[int, str]]:
    """The segment's tokens as (mask, text) runs."""
    tok = build_tokenizer()
    return [(mask, tok.decode(ids, skip_special_tokens=False)) for mask, ids in runs(seg)]


def test_completions_and_streaming_sample_turns_onto_the_ledger(builtin, tok, server) -> None:
    async def body(api, session):
        models = await api.models.list()
        first = await api.chat.completions.create(
            model="any-name", messages=[{"role": "user", "content": "12*34="}], max_tokens=10**6
        )
        history = [
            {"role": "user", "content": "12*34="},
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "again"},
        ]
        stream = await api.chat.completions.create(
            model="any-name",
            messages=history,
            stream=True,
            stream_options={"include_usage": True},
            temperature=PARAMS.temperature,  # the run's own: accepted
        )
        chunks = [chunk async for chunk in stream]
        return models, first, chunks

    (done,), [(models, first, chunks)] = run_program(builtin, tok, server, body)
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert first.object == "chat.completion" and first.model == MODEL_NAME
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")

    seg = done.client.ledger.current
    assert done.client.ledger.num_splits == 0 and done.client.num_turns == 2
    texts = spans(seg)
    assert [mask for mask, _ in texts] == [1, 0, 1]  # turn, the user's turn as context, turn
    assert texts[1][1] == "<|user|>again<|end|><|assistant|>"
    # Each response is the parse of exactly the tokens sampled for it.
    turn1, turn2 = texts[0][1], texts[2][1]
    assert first.choices[0].message.content == CHAT.assistant_message(turn1)["content"]
    assert first.usage.completion_tokens == len(runs(seg)[0][1])
    assert first.usage.prompt_tokens == len(done.task.prompt_ids)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (CHAT.assistant_message(turn2)["content"] or "")
    assert chunks[-2].choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(
        done.client.ledger.all_ids()
    )
    assert done.episode.final_text == streamed


def test_a_tool_call_round_trip_keeps_tool_output_out_of_the_loss(tok, server) -> None:
    async def body(api, session):
        messages = [{"role": "user", "content": "12*34="}]
        call = await api.chat.completions.create(model="m", messages=messages, tools=[CALCULATE])
        message = call.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        tool_call = message.tool_calls[0]
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "408"})
        answer = await api.chat.completions.create(model="m", messages=messages, tools=[CALCULATE])
        posted = await api.post("/reward", body={"reward": 0.75}, cast_to=object)
        return call, answer, posted

    (done,), [(call, answer, posted)] = run_program(CalculatorEngine(tok), tok, server, body)
    expected = CHAT.assistant_message(CALL, [CALCULATE])
    assert call.choices[0].finish_reason == "tool_calls"
    assert call.choices[0].message.model_dump(exclude_unset=True) == expected
    (tool_call,) = call.choices[0].message.tool_calls
    assert tool_call.function.name == "calculate"
    assert json.loads(tool_call.function.arguments) == {"expression": "12*34"}
    assert answer.choices[0].message.content == "408"
    assert answer.choices[0].finish_reason == "stop"
    assert posted == {"reward": 0.75} and done.episode.reward == 0.75

    ledger = done.client.ledger
    assert ledger.num_splits == 0
    assert spans(ledger.current) == [
        (1, CALL),
        (0, "<|tool|>408<|end|><|assistant|>"),
        (1, "408<|end|>"),
    ]
    assert ledger.current.logprobs[0] == -0.5 and ledger.current.logprobs[len(CALL) + 1] == 0.0


def test_streamed_tool_calls_and_a_rewritten_history(tok, server) -> None:
    async def body(api, session):
        messages = [{"role": "user", "content": "12*34="}]
        stream = await api.chat.completions.create(
            model="m", messages=messages, tools=[CALCULATE], stream=True
        )
        chunks = [chunk async for chunk in stream]
        # The program drops the call and asks another question in the same conversation.
        rewritten = [
            {"role": "user", "content": "12*34="},
            {"role": "assistant", "content": "I do not know"},
            {"role": "user", "content": "5*6="},
        ]
        again = await api.chat.completions.create(model="m", messages=rewritten, tools=[CALCULATE])
        return chunks, again

    (done,), [(chunks, again)] = run_program(CalculatorEngine(tok), tok, server, body)
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("calculate", {"expression": "12*34"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert again.choices[0].message.tool_calls[0].function.arguments == '{"expression": "5*6"}'

    ledger = done.client.ledger
    assert ledger.num_splits == 1  # a new training sample, counted
    assert spans(ledger.segments[0]) == [(1, CALL)]
    prompt = tok.decode(ledger.current.prompt_ids, skip_special_tokens=False)
    assert (
        prompt
        == "<|user|>12*34=<|end|><|assistant|>I do not know<|end|><|user|>5*6=<|end|><|assistant|>"
    )
    assert spans(ledger.current) == [(1, '<call>calculate("5*6")</call><|end|>')]


def test_a_first_request_that_is_not_the_task_prompt_starts_a_new_sample(tok, server) -> None:
    async def body(api, session):
        messages = [
            {"role": "system", "content": "Use the tool."},
            {"role": "user", "content": "12*34="},
        ]
        return await api.chat.completions.create(model="m", messages=messages, tools=[CALCULATE])

    (done,), [reply] = run_program(CalculatorEngine(tok), tok, server, body)
    assert reply.choices[0].finish_reason == "tool_calls"
    ledger = done.client.ledger
    assert ledger.num_splits == 1 and ledger.segments[0].ids == []
    assert tok.decode(ledger.current.prompt_ids, skip_special_tokens=False).startswith(
        "<|system|>Use the tool.<|end|>"
    )


UNSUPPORTED = [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"temperature": 0.2}, "temperature"),
    ({"top_p": 0.5}, "top_p"),
    ({"stop": ["\n"]}, "stop"),
    ({"functions": [CALCULATE["function"]]}, "functions"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"extra_body": {"top_k": 5}}, "top_k"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
    ({"max_tokens": 0}, "max_tokens"),
]


def test_unsupported_parameters_are_refused_before_any_turn(tok, server) -> None:
    async def body(api, session):
        refused = {}
        for kwargs, _ in UNSUPPORTED:
            with pytest.raises(openai.BadRequestError) as error:
                await api.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "1*2="}], **kwargs
                )
            refused[json.dumps(kwargs)] = error.value.body
        # Harmless ones pass; a smaller max_tokens cuts the turn.
        short = await api.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "12*34="}],
            max_tokens=4,
            user="u",
            seed=3,
            parallel_tool_calls=False,
            tools=[CALCULATE],
        )
        plain = await api.chat.completions.create(  # tool_choice none: a call stays text
            model="m",
            messages=[
                {"role": "user", "content": "12*34="},
                short.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "5*6="},
            ],
            tools=[CALCULATE],
            tool_choice="none",
        )
        return refused, short, plain

    (done,), [(refused, short, plain)] = run_program(CalculatorEngine(tok), tok, server, body)
    for kwargs, param in UNSUPPORTED:
        error = refused[json.dumps(kwargs)]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "run's temperature=1.0" in refused[json.dumps({"temperature": 0.2})]["message"]
    assert short.choices[0].finish_reason == "length"
    assert short.choices[0].message.content == "<cal"  # the cut turn: no call, just its text
    assert plain.choices[0].message.content == '<call>calculate("5*6")</call>'
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"
    assert done.client.num_turns == 2 and done.client.ledger.num_splits == 0
    assert done.client.ledger.current.mask[:5] == [1, 1, 1, 1, 0]  # the cut turn: 4 tokens


def test_keys_are_per_episode_and_a_spent_episode_answers_length(tok, server) -> None:
    async def body(api, session):
        wrong = api.with_options(api_key="not-a-session")
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "1*2="}]
            )
        with pytest.raises(openai.AuthenticationError):
            await wrong.post("/reward", body={"reward": 1.0}, cast_to=object)
        listed = await wrong.models.list()  # open on loopback
        messages = [{"role": "user", "content": "12*34="}]
        replies = []
        for _ in range(2):  # max_turns=1: the second turn is past the limit
            reply = await api.chat.completions.create(
                model="m", messages=messages, tools=[CALCULATE]
            )
            replies.append(reply)
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": "call_0", "content": "408"},
            ]
        return listed, replies, session.key

    cfg = AgentConfig(enabled=True, max_turns=1, max_total_tokens=128)
    (done,), [(listed, replies, key)] = run_program(
        CalculatorEngine(tok), tok, server, body, cfg=cfg
    )
    assert listed.data[0].id == MODEL_NAME
    assert replies[0].choices[0].finish_reason == "tool_calls"
    assert replies[1].choices[0].finish_reason == "length"
    assert replies[1].choices[0].message.content == ""
    assert done.client.num_turns == 1 and done.episode.final_text == ""

    ended = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # the episode is over: its key with it
        ended.chat.completions.create(model="m", messages=[{"role": "user", "content": "1="}])


def test_off_loopback_every_route_needs_a_key() -> None:
    server = EndpointServer(host="0.0.0.0").start()
    try:
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        api = openai.OpenAI(base_url=server.base_url, api_key="nobody", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            api.models.list()
    finally:
        server.stop()


# --- agent programs ----------------------------------------------------------------------------


def program_runner(tok, *command: str, **agent) -> AgentRunner:
    cfg = AgentConfig(
        enabled=True,
        max_turns=3,
        max_total_tokens=96,
        workflow="tool_loop",
        program=list(command),
        **agent,
    )
    runner = AgentRunner(CalculatorEngine(tok), tok, cfg)
    runner.workflow = ProgramWorkflow(cfg, tok)  # what `agent.workflow: program` selects
    return runner


def test_the_example_openai_agent_runs_as_an_episode(tok) -> None:
    runner = program_runner(tok, "python", str(REPO / "examples" / "agent_openai.py"))
    (done,) = runner.run([task(tok)], PARAMS)
    assert done.episode.status == "ok", done.episode.reason
    assert done.episode.final_text == "408" and done.episode.reward is None
    assert done.episode.metrics["requests"] == 2
    assert spans(done.client.ledger.current) == [
        (1, CALL),
        (0, "<|tool|>408<|end|><|assistant|>"),
        (1, "408<|end|>"),
    ]


def python(source: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(source)]


def test_a_program_sees_its_task_but_not_the_answer_and_may_post_a_reward(tok, tmp_path) -> None:
    seen = tmp_path / "env.json"
    source = f"""
        import json, os, openai
        keys = [k for k in os.environ if k.startswith(("OPENAI_", "STREAMRL_"))]
        json.dump({{k: os.environ[k] for k in keys}}, open({str(seen)!r}, "w"))
        openai.OpenAI().post("/reward", body={{"reward": 2.5}}, cast_to=object)
    """
    runner = program_runner(tok, *python(source))
    (done,) = runner.run([task(tok, extra={"level": 3})], PARAMS)
    assert done.episode.status == "ok" and done.episode.reward == 2.5
    env = json.loads(seen.read_text())
    assert env["STREAMRL_PROMPT"] == "12*34=" and env["STREAMRL_SAMPLE_ID"] == "s0"
    assert json.loads(env["STREAMRL_EXTRA"]) == {"level": 3}
    assert env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
    # The answer stays with the run. (Only what describes the task is checked: the port and the
    # random key may hold "408" by chance.)
    told = ("STREAMRL_PROMPT", "STREAMRL_SAMPLE_ID", "STREAMRL_EXTRA")
    assert not any("408" in env[name] for name in told)


def test_a_failing_program_drops_its_episode_with_its_stderr(tok) -> None:
    runner = program_runner(tok, *python("import sys; sys.exit('no model for me')"))
    (done,) = runner.run([task(tok)], PARAMS)
    assert done.episode.status == "infra_error"
    assert "exited 1" in done.episode.reason and "no model for me" in done.episode.reason


def test_a_program_past_the_deadline_is_killed(tok, tmp_path) -> None:
    pid_file = tmp_path / "pid"
    source = f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(60)
    """
    runner = program_runner(tok, *python(source), episode_timeout_s=2.0)
    started = time.monotonic()
    (done,) = runner.run([task(tok)], PARAMS)
    assert done.episode.status == "timeout" and time.monotonic() - started < 20
    for pid in map(int, pid_file.read_text().split()):  # the program and what it started
        # SIGKILL went to the whole group at the deadline; a process dies (and an orphan is
        # reaped) a moment after the signal, later on a loaded machine.
        assert wait_until(lambda pid=pid: not _alive(pid), 10.0), pid


def wait_until(check, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead; its parent reaps it
        return stat.read().split(") ")[1][0] != "Z"


def test_at_most_max_programs_run_at_once(tok, tmp_path) -> None:
    log = tmp_path / "log"
    source = f"""
        import time
        with open({str(log)!r}, "a") as f: f.write(f"+ {{time.monotonic()}}\\n")
        time.sleep(0.3)
        with open({str(log)!r}, "a") as f: f.write(f"- {{time.monotonic()}}\\n")
    """
    runner = program_runner(tok, *python(source), max_programs=2)
    tasks = [task(tok, sample_id=f"s{i}") for i in range(5)]
    assert all(d.episode.status == "ok" for d in runner.run(tasks, PARAMS))
    events = sorted(
        (float(t), sign) for sign, t in (line.split() for line in log.read_text().splitlines())
    )
    running = peak = 0
    for _, sign in events:
        running += 1 if sign == "+" else -1
        peak = max(peak, running)
    assert peak == 2
