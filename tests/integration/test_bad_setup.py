"""A run that cannot start says why in one line: a model, engine or environment it cannot use is
refused before any work where the CLI can tell, and otherwise when the role that needs it fails
to build (in every mode), with the traceback in the run's logs rather than on the console."""

from __future__ import annotations

import pytest

from streamrl.models.tiny import build_tiny_model_dir
from tests.integration.conftest import QUICK, run_cli

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["inline", "sync", "threads", "ray"])
def test_a_role_that_cannot_be_built_stops_the_run_with_its_reason(tmp_path, mode):
    model_dir = build_tiny_model_dir(
        tmp_path / "model", hidden_size=32, num_layers=1, num_heads=2, seed=0
    )
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "train",
            *QUICK,
            f"model.path={model_dir}",
            f"runtime.mode={mode}",
            "rollout.engine=sglang",  # a server command that exits at once: the rollout's
            'rollout.sglang_launch_cmd=["/bin/false"]',  # engine cannot be built
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
