"""The `python` tool (`streamrl.agents.code_tool`): what the model sees of a run, deadlines that
kill, and the reward sandbox's hostile-code suite run through the tool.

The hostile programs are the reward suite's own (`SOURCE` of tests/unit/test_sandbox.py, its
`hostile` function, one attack a call), and the suite runs under `namespaces` where the reward
suite does: `namespaces_or_skip` decides, so a machine without it fails here as it fails there
while the default config requires it.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

import streamrl
from streamrl.agents.code_tool import cut_middle, format_run, python_tool
from streamrl.agents.episode import Task
from streamrl.agents.tools import Tool, ToolBox, ToolLimits, ToolResult, load_tools
from streamrl.api.engine import GenerationResult, SamplingParams
from streamrl.reward.isolation import IsolationUnavailable
from streamrl.reward.seccomp import seccomp_program
from tests.unit.test_sandbox import (
    CLONE_NEWUSER,
    SOURCE,
    _processes_with,
    namespaces_or_skip,
    wait_for,
)


def run(python: Tool, code: str, limits: ToolLimits | None = None) -> ToolResult:
    return asyncio.run(ToolBox([python], limits).episode().call(python.name, {"code": code}))


@pytest.fixture(scope="module")
def python() -> Tool:
    """The strongest level this machine gives."""
    return python_tool(sandbox="namespaces", require_sandbox=False, timeout_s=1.0)


# -- what the model sees -----------------------------------------------------------------------


def test_exit_status_stdout_and_stderr_come_back(python) -> None:
    code = "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)"
    result = run(python, code)
    assert (result.status, result.text) == ("ok", "exit status 3\nstdout:\nout\nstderr:\nerr")
    crash = run(python, "1 / 0")
    assert crash.text.startswith("exit status 1\nstdout:\n\nstderr:\nTraceback")
    assert crash.text.endswith("ZeroDivisionError: division by zero")


def test_each_call_starts_fresh_in_a_temporary_directory(python) -> None:
    first = run(python, "import os\nopen('note.txt', 'w').write('x')\nprint(os.getcwd())")
    second = run(python, "import os\nprint(os.path.exists('note.txt'))")
    assert first.text.startswith("exit status 0") and second.text.startswith("exit status 0")
    assert "stdout:\nFalse\n" in second.text
    workdir = first.text.split("stdout:\n")[1].split("\n")[0]
    assert workdir != os.getcwd() and not Path(workdir, "note.txt").exists()


def test_long_output_is_cut_keeping_both_ends_of_each_stream() -> None:
    python = python_tool(sandbox="process", require_sandbox=False, max_output_chars=300)
    code = "import sys\nprint('A' + 'a' * 5000 + 'Z')\nsys.exit('B' + 'b' * 5000 + 'END')"
    text = run(python, code).text
    assert len(text) <= 300
    assert text.startswith("exit status 1\nstdout:\nAaaa") and "aaaZ\nstderr:\nBbbb" in text
    assert text.endswith("bbbEND") and text.count("characters cut") == 2


def test_format_run_gives_a_short_stream_its_whole_text() -> None:
    text = format_run(0, "short", "e" * 1000, 200)
    assert text.startswith("exit status 0\nstdout:\nshort\nstderr:\ne") and len(text) <= 200
    assert format_run(-9, "", "", 200) == "exit status -9 (killed by SIGKILL)\nstdout:\n\nstderr:\n"
    assert format_run(137, "", "", 200, via_bwrap=True).startswith(
        "exit status 137 (killed by SIGKILL)"
    )
    assert cut_middle("abcdefghij" * 10, 50).count("characters cut") == 1
    assert len(cut_middle("abcdefghij" * 10, 50)) <= 50


def test_an_endless_loop_is_killed_at_the_deadline(python) -> None:
    start = time.monotonic()
    result = run(python, "print('started', flush=True)\nwhile True:\n    pass")
    elapsed = time.monotonic() - start
    assert (result.status, result.reason) == ("error", "timeout")
    assert result.text.startswith("error: the program ran longer than 1 s and was killed\n")
    assert "stdout:\nstarted" in result.text  # what it printed before
    assert 0.9 <= elapsed < 3.0, elapsed


def test_a_call_cancelled_by_the_sessions_deadline_kills_its_process() -> None:
    python = python_tool(sandbox="namespaces", require_sandbox=False, timeout_s=30.0)
    marker = f"streamrl-busy-{uuid.uuid4().hex}"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'while 1: pass', '{marker}'])"
    start = time.monotonic()
    result = run(python, code, ToolLimits(timeout_s=1.0))
    assert (result.status, result.reason) == ("error", "timeout")
    assert time.monotonic() - start < 3.0
    assert wait_for(lambda: not _processes_with(marker)), "the program outlived its call"


def test_the_tool_reports_its_isolation_level(python) -> None:
    report = python.fn.isolation_level()
    assert report == python.fn.isolation.describe()
    assert report.startswith(f"sandbox level {python.fn.level}: scrubbed environment on")
    assert python.schema["function"]["parameters"]["required"] == ["code"]


def test_agent_tools_can_name_the_python_tool_factory() -> None:
    namespaces_or_skip()
    (python,) = load_tools(["streamrl.agents.code_tool:python_tool"])
    assert (python.name, python.fn.level) == ("python", "namespaces")
    assert run(python, "print(6 * 7)").text == "exit status 0\nstdout:\n42\nstderr:\n"


def test_a_level_the_machine_lacks_is_refused_with_what_to_do(monkeypatch) -> None:
    from streamrl.reward import isolation

    monkeypatch.setattr(isolation, "find_bwrap", lambda: None)
    with pytest.raises(IsolationUnavailable, match="python tool, sandbox=namespaces: .*bubblewrap"):
        python_tool()
    assert python_tool(require_sandbox=False).fn.level == "process"


# -- the reward suite's hostile code, through the tool -----------------------------------------


@pytest.fixture(scope="module")
def jail() -> Tool:
    namespaces_or_skip()
    return python_tool(sandbox="namespaces", timeout_s=2.0, memory_limit_gb=1.0, max_processes=32)


def attack(python: Tool, response: str) -> ToolResult:
    """Run the reward suite's `hostile(response, "")` as a program, then another call in the same
    episode, which must still work."""

    async def episode() -> tuple[ToolResult, ToolResult]:
        session = ToolBox([python]).episode()
        code = f"{SOURCE}\nprint(hostile({response!r}, ''))\n"
        return await session.call("python", {"code": code}), await session.call(
            "python", {"code": "print('next')"}
        )

    result, after = asyncio.run(episode())
    assert after.text == "exit status 0\nstdout:\nnext\nstderr:\n", "the episode cannot go on"
    return result


def failed(result: ToolResult, *needles: str) -> bool:
    """The attack came back as a failure (an error result or a nonzero exit) saying why."""
    refused = result.status == "error" or not result.text.startswith("exit status 0\n")
    return refused and any(n in result.text for n in needles)


def succeeded(result: ToolResult) -> bool:
    return result.status == "ok" and result.text.startswith("exit status 0\n")


def test_a_secret_in_the_users_home_cannot_be_read(jail) -> None:
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    secret = home / f".streamrl-sandbox-secret-{uuid.uuid4().hex}"
    secret.write_text("the-home-secret")
    secret.chmod(0o600)
    try:
        result = attack(jail, f"read:{secret}")
    finally:
        secret.unlink()
    assert failed(result, "FileNotFoundError", "PermissionError"), result
    assert "the-home-secret" not in result.text


def test_root_only_files_cannot_be_read(jail) -> None:
    assert failed(attack(jail, "read:/etc/shadow"), "PermissionError", "FileNotFoundError")


def test_nothing_outside_the_temporary_directory_can_be_written(jail) -> None:
    targets = [Path(streamrl.__file__).parent / "written.txt", Path(sys.prefix) / "written.txt"]
    try:
        for target in targets:
            result = attack(jail, f"write:{target}")
            assert failed(result, "Read-only file system"), result
            assert not target.exists()
    finally:
        for target in targets:
            target.unlink(missing_ok=True)
    name = f"streamrl-sandbox-{uuid.uuid4().hex}"
    assert "\n1.0\nstderr:" in attack(jail, f"write_tmp:{name}").text  # its own /tmp works
    assert not (Path("/tmp") / name).exists()  # and is not the host's


def test_the_parents_secrets_are_not_in_the_environment(jail, monkeypatch) -> None:
    monkeypatch.setenv("STREAMRL_WEIGHT_TOKEN", "s3cret-token")
    result = attack(jail, "env:STREAMRL_WEIGHT_TOKEN")
    assert failed(result, "LookupError: STREAMRL_WEIGHT_TOKEN is in no environment"), result
    assert "s3cret" not in result.text


def test_no_connection_reaches_a_listener_on_the_host(jail) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        result = attack(jail, f"connect:{listener.getsockname()[1]}")
        assert failed(result, "Connection refused", "unreachable"), result
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_no_process_outlives_the_call_that_started_it(jail) -> None:
    marker = f"streamrl-orphan-{uuid.uuid4().hex}"
    assert succeeded(attack(jail, f"orphan:{marker}"))
    assert wait_for(lambda: not _processes_with(marker)), "a process outlived its call"
    # Without a PID namespace it does outlive the call (the `process` level's known limit),
    # which shows this check can see one.
    control = f"streamrl-orphan-{uuid.uuid4().hex}"
    outside = python_tool(sandbox="process", timeout_s=2.0)
    assert succeeded(run(outside, f"{SOURCE}\nprint(hostile('orphan:{control}', ''))\n"))
    try:
        assert wait_for(lambda: bool(_processes_with(control)))
    finally:
        for pid in _processes_with(control):
            os.kill(pid, 9)


def test_a_fork_bomb_is_stopped_at_the_process_limit(jail) -> None:
    result = attack(jail, "fork:500")
    assert failed(result, "BlockingIOError", "Resource temporarily unavailable"), result


def test_an_allocation_past_the_memory_limit_fails(jail) -> None:
    assert failed(attack(jail, f"alloc:{4 * 2**30}"), "MemoryError")
    assert "\n1048576.0\nstderr:" in attack(jail, f"alloc:{2**20}").text


def test_an_endless_loop_is_stopped_at_the_deadline(jail) -> None:
    start = time.monotonic()
    result = attack(jail, "loop:")
    assert (result.status, result.reason) == ("error", "timeout")
    assert "ran longer than 2 s and was killed" in result.text
    assert time.monotonic() - start < 6


def test_system_calls_of_sandbox_escapes_are_refused(jail) -> None:
    if seccomp_program()[0] is None:
        pytest.skip("libseccomp is not installed: the filter is off")
    for attempt in (f"unshare:{CLONE_NEWUSER}", "ptrace:", "unshare:0"):
        assert failed(attack(jail, attempt), "Operation not permitted"), attempt
    outside = python_tool(sandbox="process")
    assert succeeded(run(outside, f"{SOURCE}\nprint(hostile('unshare:0', ''))\n"))


def test_killing_the_parent_kills_nothing_outside(jail) -> None:
    assert failed(attack(jail, "kill_parent:"), "PermissionError")
    result = attack(jail, f"kill:{os.getpid()}")  # this test process, by its pid out here
    assert failed(result, "ProcessLookupError", "PermissionError"), result
    assert os.getpid() > 0  # still here to say so


# -- the same attacks, written by "the model" inside episodes of a run --------------------------


class ScriptedModel:
    """An `Engine` that plays the model of these episodes: turn n of every episode is
    `turns[n]` (a tool call with the attack, a harmless call, an answer)."""

    version = 0

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns = tokenizer, turns

    def load_weights(self, version, named_tensors) -> None:
        raise AssertionError("not used")

    def generate(self, requests, params, *, on_finished=None, weight_poll=None):
        results = []
        for request in requests:
            text = self.turns[int(request.request_id.rsplit("/t", 1)[1])]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            results.append(
                GenerationResult(request.request_id, ids, [-0.1] * len(ids), [0] * len(ids), "stop")
            )
        if on_finished is not None:
            on_finished(results)
        return results


ATTACKS = {
    "read:/etc/shadow": ("PermissionError", "FileNotFoundError"),
    f"write:{Path(sys.prefix) / 'written.txt'}": ("Read-only file system",),
    "env:STREAMRL_WEIGHT_TOKEN": ("is in no environment",),
    "fork:500": ("BlockingIOError", "Resource temporarily unavailable"),
    f"alloc:{4 * 2**30}": ("MemoryError",),
    "loop:": ("ran longer than 2 s and was killed",),
    "kill_parent:": ("PermissionError",),
}


def test_hostile_code_written_in_an_episode_is_contained(jail, monkeypatch) -> None:
    """Each attack runs through the `python` tool inside an episode of the real `AgentRunner`
    (tool loop, streamrl chat format): the model is shown a failure, the episode goes on to its
    next call and its answer, and the runner keeps running episodes after it."""
    from streamrl.agents.runner import AgentRunner
    from streamrl.config.agent_schema import AgentConfig
    from streamrl.models.tokenizer import build_tokenizer

    monkeypatch.setenv("STREAMRL_WEIGHT_TOKEN", "s3cret-token")
    tok = build_tokenizer()
    prompt = tok("<|user|>go<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    cfg = AgentConfig(enabled=True, tools=[], max_turns=3, max_total_tokens=50_000)
    params = SamplingParams(max_new_tokens=50_000)
    for n, (response, needles) in enumerate([*ATTACKS.items(), ("sum:1,2", ("3",))]):
        code = f"{SOURCE}\nprint(hostile({response!r}, ''))\n"
        turns = [f"<call>python({code!r})</call><|end|>", "<call>python('print(7)')</call><|end|>"]
        runner = AgentRunner(ScriptedModel(tok, [*turns, "done<|end|>"]), tok, cfg)
        runner.toolbox = ToolBox([jail])
        (done,) = runner.run([Task(f"s{n}", prompt)], params)
        seg = done.client.ledger.current
        shown = tok.decode([t for t, m in zip(seg.ids, seg.mask, strict=True) if not m])
        first, second = re.findall(r"<\|tool\|>(.*?)<\|end\|>", shown, re.S)
        assert done.episode.status == "ok" and done.episode.final_text == "done", done.episode
        assert done.client.num_turns == 3 and done.client.tools.calls == 2
        assert "s3cret" not in first
        if response.startswith("sum:"):  # the control: a harmless program runs normally
            assert first.startswith("exit status 0\n"), first
            continue
        assert not first.startswith("exit status 0\n") and any(x in first for x in needles), (
            response,
            first,
        )
        assert second == "exit status 0\nstdout:\n7\nstderr:\n", second
