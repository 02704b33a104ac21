"""A run that cannot start says why in one line: a model, engine or environment it cannot use is
refused before any work where the CLI can tell, and otherwise when the role that needs it fails
to build (in every mode), with the traceback in the run's logs rather than on the console. So
does a run whose role keeps failing once it runs, when its restarts are spent."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.conftest import QUICK, run_cli, tiny_model

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["inline", "sync", "threads", "ray"])
def test_a_role_that_cannot_be_built_stops_the_run_with_its_reason(tmp_path, mode):
    model_dir = tiny_model(tmp_path)
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "train",
            *QUICK,
            f"model.path={model_dir}",
            f"runtime.mode={mode}",
            "rollout.engine=sglang",  # a server command that exits at once: the rollout's
            'rollout.sglang.launch_cmd=["/bin/false"]',  # engine cannot be built
            f"run.run_dir={run_dir}",
        ],
        check_ok=False,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    reason = proc.stderr[proc.stderr.index("streamrl: the rollout role could not be built") :]
    assert reason.startswith("streamrl: the rollout role could not be built: SglangError")
    assert "Traceback" not in proc.stderr  # it is in the logs
    assert "SIGABRT" not in proc.stderr  # Ray's abort of an actor whose constructor raised
    # Where the traceback is: the role's own log (its process), or the controller's (inline).
    log = run_dir / "logs" / ("rollout.log" if mode == "ray" else "controller.log")
    assert f"(traceback: {log})" in reason
    assert "Traceback" in log.read_text()
    assert "Traceback" in (run_dir / "logs" / "controller.log").read_text()
    assert not (run_dir / "summary.json").exists()


@pytest.mark.parametrize("mode", ["threads", "ray"])
def test_a_role_that_keeps_failing_stops_the_run_with_its_reason(tmp_path, mode):
    model_dir = tiny_model(tmp_path)
    server = Path(__file__).parents[1] / "fakes" / "sglang_server.py"
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "train",
            *QUICK,
            f"model.path={model_dir}",
            f"runtime.mode={mode}",
            "runtime.ray.max_restarts=1",
            "rollout.engine=sglang",  # a server that fails every generation
            f'rollout.sglang.launch_cmd=["{sys.executable}", "{server}", "--fail-generate", '
            '"CUDA out of memory (simulated)"]',
            f"run.run_dir={run_dir}",
        ],
        check_ok=False,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    failure = "HTTP 500: CUDA out of memory (simulated)"
    if mode == "ray":  # restarted once, then stopped
        log = run_dir / "logs" / "rollout.log"
        said = (
            "streamrl: role 'rollout' failed 2 times (runtime.ray.max_restarts=1); last failure: "
        )
    else:  # one failure domain: no restarts
        log = run_dir / "logs" / "controller.log"
        said = "streamrl: role rollout failed: "
    last = proc.stderr.rstrip().splitlines()[-1]  # the server's URL between the two
    assert last.startswith(f"{said}SglangError: "), proc.stderr[-3000:]
    resume = f"`streamrl train --resume {run_dir}` continues it from its latest checkpoint"
    assert last.endswith(f"{failure} (traceback: {log}); {resume}"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout  # it is in the logs
    assert "Traceback" in log.read_text()
