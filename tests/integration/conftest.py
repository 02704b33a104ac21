"""Shared set-up for integration tests: run the real `streamrl` CLI in a subprocess.

Tests that only need *a* policy (not a good one) use a short warm start so the suite stays fast;
its cache lives in a per-session folder and is built once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Small, fast settings for tests that check mechanics rather than learning.
QUICK = [
    "warm_start.steps=60",
    "rollout.batch_prompts=4",
    "rollout.group_size=4",
    "data.num_eval=32",
    "run.progress=false",
    "run.log_every=0",
    "run.tensorboard=false",
]


# A learning run kept short: no evaluation between the first and the last, no checkpoints, quiet.
SHORT = [
    "trainer.eval_every=0",
    "trainer.checkpoint_every=0",
    "run.progress=false",
    "run.log_every=0",
    "run.tensorboard=false",
]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["RAY_DEDUP_LOGS"] = "0"
    return env


def run_cli(
    args: list[str],
    *,
    timeout: float = 600,
    check_ok: bool = True,
    extra_env: dict[str, str] | None = None,
    **kwargs,
) -> subprocess.CompletedProcess:
    """Run `python -m streamrl.cli ARGS` to completion; fail the test with its output if it fails
    (unless `check_ok` is False: then the caller checks the outcome). `extra_env` adds to the
    environment."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "streamrl.cli", *args],
            cwd=REPO,
            env={**cli_env(), **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            **kwargs,
        )
    except subprocess.TimeoutExpired as e:  # say where it was, not only that it ran out of time
        pytest.fail(
            f"streamrl {' '.join(args)} still ran after {timeout:.0f} s\n"
            f"{_text(e.stdout)[-4000:]}\n{_text(e.stderr)[-6000:]}"
        )
    if check_ok and proc.returncode != 0:
        pytest.fail(
            f"streamrl {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def _text(output: bytes | str | None) -> str:
    """A TimeoutExpired's captured output (bytes even with text=True), as text."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def learning_run(
    run_dir: Path, *overrides: str, steps: int, timeout: float = 1800
) -> tuple[dict, list[dict]]:
    """`streamrl train OVERRIDES` for `steps` steps (SHORT settings) into `run_dir`: its summary
    and each step's training metrics, once every step trained and the policy started at a
    held-out accuracy of at most 0.4 (each test sets its own bar for the end)."""
    run_cli(
        ["train", *overrides, f"trainer.steps={steps}", *SHORT, f"run.run_dir={run_dir}"],
        timeout=timeout,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    trained = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert len(trained) == steps == summary["num_steps"], summary
    assert summary["initial_eval_accuracy"] <= 0.4, summary
    return summary, trained


def tiny_model(folder: Path) -> Path:
    """The smallest model a run trains (hidden 32, one layer, random weights), as a local HF
    directory in `folder`/model: for tests of mechanics that start from `model.path` (no warm
    start)."""
    from streamrl.models.tiny import build_tiny_model_dir

    return build_tiny_model_dir(folder / "model", hidden_size=32, num_layers=1, num_heads=2, seed=0)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def quick_cache(tmp_path_factory) -> Path:
    """A cache folder whose warm-started policy for QUICK settings is built once per test run:
    the xdist workers of a run share it (about 25 CPU-s a build on a slow machine; a second
    worker that needs it while the first builds it waits on the warm start's own file lock)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    path = root / "quick-cache"
    path.mkdir(exist_ok=True)
    return path


def pytest_collection_modifyitems(items) -> None:
    """A run of the default job may also build the shared warm start (whichever test comes
    first on a fresh clone): give `slow` tests room beyond the suite's 600 s default."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(1800))
