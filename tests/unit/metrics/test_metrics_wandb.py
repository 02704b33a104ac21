"""WandbRun: an offline W&B run beside metrics.jsonl, read back from its `.wandb` file."""

import sys
from pathlib import Path

import pytest

from streamrl.config import ConfigError
from streamrl.metrics import MetricsTracker, WandbRun, read_metrics
from streamrl.metrics.tracker import histogram_buckets
from tests.wandb_offline import read_offline_run

API_KEY = "0123456789abcdef-not-a-real-wandb-key"


@pytest.fixture(autouse=True)
def _wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network, W&B's own caches in tmp_path, and a key that must not reach the run."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the config's offline applies
    monkeypatch.setenv("WANDB_API_KEY", API_KEY)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name))


def _open(run_dir: Path) -> WandbRun:
    config = {"trainer": {"steps": 2}, "runtime": {"weights": {"token": None}}}
    return WandbRun(run_dir, project="streamrl-test", mode="offline", config=config)


def _wandb_file(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_tracker_mirrors_each_step_the_config_and_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with _open(run_dir) as wandb_run, MetricsTracker(run_dir, wandb=wandb_run) as tracker:
        tracker.log(0, {"eval/accuracy": 0.25, "reward/mean": None})
        tracker.log(1, {"reward/mean": 0.5, "staleness/hist": [0, 1, 1, 2], "empty/hist": []})
        tracker.log(2, {"reward/mean": 0.75, "train/loss": -0.125})
        wandb_run.finish({"final_eval_accuracy": 0.75, "slower_side": "trainer 1-2 (90%)"})

    (wandb_file,) = _wandb_file(run_dir)
    run = read_offline_run(wandb_file)
    assert run.config["trainer"] == {"steps": 2}
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in run.history]
    records = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [r["step"] for r in records] == [0, 1, 2]
    assert rows[0] == {"step": 0, "eval/accuracy": 0.25}  # None is left out
    assert rows[2] == {"step": 2, "reward/mean": 0.75, "train/loss": -0.125}
    counts, edges = histogram_buckets([0, 1, 1, 2])  # TensorBoard's buckets
    histogram = rows[1]["staleness/hist"]
    assert histogram["values"] == counts.tolist() and histogram["bins"] == edges.tolist()
    assert "empty/hist" not in rows[1]
    assert run.summary["final_eval_accuracy"] == 0.75
    assert run.summary["slower_side"] == "trainer 1-2 (90%)"
    assert run.exit_code == 0
    # W&B's own files hold neither the API key nor anything outside the run directory.
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert API_KEY.encode() not in path.read_bytes(), path


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with _open(run_dir) as first:
        first.log(1, {"reward/mean": 0.5})
    with _open(run_dir) as second:  # `streamrl train --resume`: steps from the checkpoint again
        second.log(1, {"reward/mean": 0.25})
    assert first.run_id == second.run_id
    pieces = [read_offline_run(path) for path in _wandb_file(run_dir)]
    assert len(pieces) == 2 and {Path(p).name for p in _wandb_file(run_dir)} == {
        f"run-{first.run_id}.wandb"
    }
    # W&B's own step counter only grows; the x axis is `step`, so the repeat is not dropped.
    values = [row["reward/mean"] for piece in pieces for row in piece.history if row["step"] == 1]
    assert sorted(values) == [0.25, 0.5]


def test_a_failing_block_marks_the_wandb_run_failed(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(KeyError), _open(run_dir):
        raise KeyError("boom")
    (wandb_file,) = _wandb_file(run_dir)
    assert read_offline_run(wandb_file).exit_code == 1


def test_missing_wandb_package_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[wandb\]'"):
        _open(tmp_path / "run")
