"""Weights & Biases beside TensorBoard: the same per-step metrics, the run's config and summary.

The controller opens one `WandbRun` per run directory when `run.wandb=true` and hands it to
each `MetricsTracker`, which mirrors every `log(step, metrics)` to it; at the end the controller
adds the summary and finishes it. W&B keeps its files in run_dir/wandb:

    run_dir/wandb/offline-run-<time>-<id>/run-<id>.wandb   offline (the default): everything
    run_dir/wandb/run-<time>-<id>/...                      online: a local copy of the same
    run_dir/wandb/streamrl-run-id                          the W&B run id of this run directory

`streamrl train --resume RUN_DIR` continues the same W&B run (the id file), so the resumed
steps land on the same curves (`wandb sync --id ID` uploads several offline pieces in order).

Differences from TensorBoard, each for a reason:
- The x axis is the metric `step` (the policy version), not W&B's own `_step` counter, which
  only grows: after a resume or trainer restart the steps from the checkpoint on are logged
  again, and W&B cannot delete the first attempt's points (metrics.jsonl keeps only the last).
- W&B's system metadata (command line, host, git state) is not collected: the command line may
  carry a secret (`runtime.weights.token=...`). The config is config.yaml's, secrets left out.
  The API key stays where W&B keeps it (~/.netrc or $WANDB_API_KEY), never in run_dir.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from streamrl.config import ConfigError
from streamrl.metrics.tracker import MetricValue, histogram_buckets

WANDB_DIRNAME = "wandb"
RUN_ID_FILENAME = "streamrl-run-id"
STEP_KEY = "step"


class WandbRun:
    """One W&B run for one run directory, written from the driver process only.

    Opening it starts W&B's background service (about 2 s) and fails at once, before any
    training, when `wandb` is missing or (online) the login is. Use it as a context manager:
    leaving the block with an exception marks the W&B run failed.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        project: str,
        mode: Literal["offline", "online"],
        config: Mapping[str, Any],
        name: str | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError(
                "run.wandb=true needs the wandb package: pip install -e '.[wandb]' "
                "(or set run.wandb=false)"
            ) from err
        self._wandb = wandb
        run_dir = Path(run_dir)
        (run_dir / WANDB_DIRNAME).mkdir(parents=True, exist_ok=True)
        self.run_id = _run_id(run_dir / WANDB_DIRNAME / RUN_ID_FILENAME)
        self._run = wandb.init(
            project=project,
            dir=run_dir,
            id=self.run_id,
            resume="allow",
            name=name or run_dir.name,
            config=dict(config),
            # $WANDB_MODE wins over the config: a job script can force offline on an air-gapped node.
            mode=None if os.environ.get("WANDB_MODE") else mode,
            reinit="create_new",  # several runs of one process (tests) stay apart
            settings=wandb.Settings(
                console="off",  # the roles' own logs are in run_dir/logs
                silent=True,
                disable_git=True,
                x_disable_meta=True,  # the command line may hold a secret
            ),
        )
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)
        self._finished = False

    @property
    def dir(self) -> Path:
        """This process's W&B folder (run_dir/wandb/offline-run-<time>-<id> offline)."""
        return Path(self._run.dir).parent

    def log(self, step: int, metrics: Mapping[str, MetricValue]) -> None:
        """Log one step: numbers as they are, lists as histograms (TensorBoard's buckets),
        None skipped. Called by `MetricsTracker.log`, after the JSONL line is written."""
        row: dict[str, Any] = {STEP_KEY: step}
        for key, value in metrics.items():
            if isinstance(value, list):
                buckets = histogram_buckets(value)
                if buckets is not None:
                    row[key] = self._wandb.Histogram(np_histogram=buckets)
            elif value is not None:
                row[key] = value
        self._run.log(row)

    def finish(self, summary: Mapping[str, Any] | None = None, *, failed: bool = False) -> None:
        """Add `summary` (summary.json's keys) to the run's summary and close it; calling it
        again does nothing."""
        if self._finished:
            return
        self._finished = True
        if summary is not None:
            self._run.summary.update(dict(summary))
        self._run.finish(exit_code=1 if failed else 0)

    def __enter__(self) -> WandbRun:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish(failed=exc_type is not None)


def _run_id(path: Path) -> str:
    """The W&B run id kept in `path`, made on first use: a resumed run continues its W&B run."""
    if path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)
    path.write_text(run_id + "\n")
    return run_id
