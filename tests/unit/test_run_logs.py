"""Run logs in one place: file naming, the role handler's batching, and the `status` / `logs`
commands over a run directory laid out as a Ray-mode run leaves it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest

from streamrl.cli import format_logs, format_status, main
from streamrl.runtime.logs import (
    RoleLogHandler,
    attach_controller_log,
    detach,
    log_path,
    tail,
)


class _Remote:
    def __init__(self, calls):
        self.calls = calls

    def remote(self, name, lines):
        self.calls.append((name, list(lines)))


class FakeSink:
    """Stands in for the sink actor: records `write.remote(name, lines)` calls."""

    def __init__(self):
        self.calls = []
        self.write = _Remote(self.calls)


def test_replicas_get_their_own_file(tmp_path):
    assert log_path(tmp_path, "rollout") == tmp_path / "logs" / "rollout.log"
    assert log_path(tmp_path, "rollout#1") == tmp_path / "logs" / "rollout-1.log"


def test_role_handler_ships_formatted_records_in_batches():
    sink = FakeSink()
    handler = RoleLogHandler(sink, "reward#2", flush_s=3600)  # flushed by hand below
    logger = logging.getLogger("streamrl.test_run_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        logger.info("first %d", 1)
        logger.warning("second")
        logger.debug("not recorded")
        assert sink.calls == []  # buffered until the next flush
        handler.flush()
        handler.flush()  # nothing new: no call
    finally:
        logger.removeHandler(handler)
        handler._closed.set()
    assert len(sink.calls) == 1
    name, lines = sink.calls[0]
    assert name == "reward#2"
    assert [line.split(": ", 1)[1] for line in lines] == ["first 1", "second"]
    assert "INFO" in lines[0] and "WARNING" in lines[1] and "streamrl.test_run_logs" in lines[0]


def test_controller_log_records_streamrl_info(tmp_path):
    handler = attach_controller_log(tmp_path)
    try:
        logging.getLogger("streamrl.runtime.test").info("resuming from step-000010")
    finally:
        detach(handler)
    assert "resuming from step-000010" in (tmp_path / "logs" / "controller.log").read_text()


def _fake_run(run_dir):
    (run_dir / "logs").mkdir(parents=True)
    for name, count in (("controller", 3), ("rollout", 30), ("rollout#1", 5)):
        lines = [f"{name} line {i}" for i in range(count)]
        log_path(run_dir, name).write_text("".join(line + "\n" for line in lines))
    roles = {
        name: {"node": "10.0.0.1", "pid": pid, "healthy": True, "restarts": 0, "log": f"logs/{f}"}
        for name, pid, f in (("rollout", 11, "rollout.log"), ("rollout#1", 12, "rollout-1.log"))
    }
    status = {"updated": time.time(), "running": True, "roles": roles}
    (run_dir / "roles.json").write_text(json.dumps(status))
    (run_dir / "config.yaml").write_text("trainer:\n  steps: 50\n")
    records = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "train/loss": 0.5}]
    records += [
        {"step": 2, "train/loss": 0.4, "eval/accuracy": 0.5},
        {"step": 3, "train/loss": 0.3},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


HOLDER = (
    "import sys, time; from pathlib import Path; from streamrl.control import "
    "hold_run_dir; lock = hold_run_dir(Path(sys.argv[1])); print('held', flush=True); "
    "time.sleep(60)"
)


def test_status_points_to_the_logs_and_knows_whether_the_job_lives(tmp_path):
    _fake_run(tmp_path)
    job = subprocess.Popen(  # the run's driver, holding its directory
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert job.stdout.readline() == "held\n"
        status = format_status(tmp_path)
        assert status.splitlines()[0] == (
            f"{tmp_path}: running (pid {job.pid}); step 3/50, held-out accuracy 0.500 at step 2 "
            "(0.250 at step 0)"
        )
        assert "logs/rollout-1.log" in status
        assert f"{tmp_path}/logs" in status and "events.jsonl" in status
        assert "stop requested" not in status
        assert main(["stop", str(tmp_path)]) == 0
        assert f"running (pid {job.pid}), stop requested" in format_status(tmp_path)
    finally:
        job.kill()
        job.wait()
    # Killed: roles.json still says running; the lock knows better.
    assert main(["stop", str(tmp_path)]) == 1  # nothing to stop
    status = format_status(tmp_path)
    assert status.startswith(f"{tmp_path}: not running, and it did not finish (it failed or was")
    assert "roles (as last recorded" in status
    (tmp_path / "summary.json").write_text('{"stopped_early": false}')
    assert format_status(tmp_path).startswith(f"{tmp_path}: finished; step 3/50")


def test_logs_command_tails_one_role_or_all(tmp_path, capsys):
    _fake_run(tmp_path)
    assert tail(log_path(tmp_path, "rollout"), 2) == ["rollout line 28", "rollout line 29"]
    assert format_logs(tmp_path, "rollout#1", 1) == "rollout#1 line 4"
    assert format_logs(tmp_path, "rollout-1", 1) == "rollout#1 line 4"
    everything = format_logs(tmp_path, None, 2)
    assert everything.count("==>") == 3 and "controller line 2" in everything

    assert main(["logs", str(tmp_path), "rollout", "-n", "3"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"rollout line {i}" for i in (27, 28, 29)]
    assert main(["logs", str(tmp_path), "critic"]) == 2
    assert "rollout-1" in capsys.readouterr().err


def test_logs_of_a_directory_without_logs_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no log files"):
        format_logs(tmp_path, None, 5)


def test_a_failure_goes_to_the_controller_log_with_its_traceback(tmp_path):
    from streamrl.runtime.logs import log_failure

    handler = attach_controller_log(tmp_path)
    try:
        raise ValueError("bad thing")
    except ValueError:
        log_failure(handler, "the run failed")
    finally:
        detach(handler)
    text = (tmp_path / "logs" / "controller.log").read_text()
    assert "ERROR" in text and "the run failed" in text and "ValueError: bad thing" in text


def test_a_failure_the_run_cannot_restart_ends_in_one_line_with_the_resume_command(
    tmp_path, monkeypatch, capsys
):
    """A bus shard or the weight store lost (here: the mode's loop raising ConnectionError) is
    not a role's failure: the console gets the cause and the exact resume command, not a raw
    traceback; the traceback goes to logs/controller.log."""
    from streamrl.models.tiny import build_tiny_model_dir
    from streamrl.runtime import controller

    def lose_the_bus(*_args, **_kwargs):
        raise ConnectionError("bus shard 0 died unexpectedly")

    monkeypatch.setattr(controller, "_run_mode", lose_the_bus)
    model = build_tiny_model_dir(
        tmp_path / "model", hidden_size=32, num_layers=1, num_heads=2, seed=0
    )
    run_dir = tmp_path / "run"
    code = main(
        [
            "train",
            f"model.path={model}",
            "runtime.mode=inline",
            "run.progress=false",
            "run.tensorboard=false",
            f"run.run_dir={run_dir}",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback" not in err
    assert "the run failed: ConnectionError: bus shard 0 died unexpectedly" in err
    assert f"`streamrl train --resume {run_dir}` continues it" in err
    log = (run_dir / "logs" / "controller.log").read_text()
    assert "Traceback" in log and "bus shard 0 died unexpectedly" in log


def test_rays_token_auth_notice_is_dropped_and_its_warning_kept():
    from streamrl.runtime.ray_runtime import _QuietTokenNotice

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("ray", logging.WARNING, __file__, 1, message, None, None)

    quiet = _QuietTokenNotice()
    assert not quiet.filter(record("Token authentication is enabled for this Ray cluster. Set"))
    assert quiet.filter(record("Token authentication is disabled for this Ray cluster. Anyone"))


def test_live_pid_reads_roles_and_services_while_healthy(tmp_path) -> None:
    from streamrl.runtime.status import STATUS_FILE, live_pid

    assert live_pid(tmp_path, "trainer") is None  # before the run wrote roles.json
    status = {
        "roles": {"trainer": {"pid": 5, "healthy": True}, "reward": {"pid": 6, "healthy": False}},
        "services": {"bus#0": {"pid": 7, "healthy": True}, "weights": {"pid": 8, "healthy": False}},
    }
    (tmp_path / STATUS_FILE).write_text(json.dumps(status))
    assert [live_pid(tmp_path, n) for n in ("trainer", "reward", "bus#0", "weights", "x")] == [
        5,
        None,
        7,
        None,
        None,
    ]
