"""`run.wandb=true` with WANDB_MODE=offline: the real CLI trains three steps and the W&B offline
run inside the run directory holds what metrics.jsonl, config.yaml and summary.json hold, with
neither the W&B API key nor the weight-channel token passed on the command line anywhere in the
run directory. Nothing contacts the network: the mode is offline and W&B's home is tmp_path."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from tests.integration.conftest import QUICK, read_jsonl, run_cli, tiny_model
from tests.wandb_offline import read_offline_run

pytestmark = pytest.mark.integration

API_KEY = "0123456789abcdef-not-a-real-wandb-key"
TOKEN = "weight-token-that-must-stay-secret"


def test_an_offline_wandb_run_holds_the_runs_metrics_config_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    wandb_home = tmp_path / "wandb-home"
    run_cli(
        [
            "train",
            *QUICK,
            f"model.path={tiny_model(tmp_path)}",  # no warm start: only the mechanics matter
            "reward.function=tests.integration.digit_reward:digit_share",  # some signal
            "runtime.mode=inline",
            "trainer.steps=3",
            "trainer.checkpoint_every=0",
            "run.wandb=true",
            "run.wandb_project=streamrl-test",
            f"runtime.weights.token={TOKEN}",
            f"run.run_dir={run_dir}",
        ],
        extra_env={
            "WANDB_MODE": "offline",
            "WANDB_API_KEY": API_KEY,
            "WANDB_CONFIG_DIR": str(wandb_home / "config"),
            "WANDB_CACHE_DIR": str(wandb_home / "cache"),
            "WANDB_DATA_DIR": str(wandb_home / "data"),
        },
    )

    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    run = read_offline_run(wandb_file)
    assert run.exit_code == 0

    # Every step of metrics.jsonl, every value: numbers equal, lists as histograms.
    records = read_jsonl(run_dir / "metrics.jsonl")
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in run.history]
    assert [row["step"] for row in rows] == [r["step"] for r in records]
    assert sum("train/loss" in row for row in rows) == 3
    for record, row in zip(records, rows, strict=True):
        logged = {k: v for k, v in record.items() if k != "time" and v is not None and v != []}
        assert set(row) == set(logged), (sorted(row), sorted(logged))
        for key, value in logged.items():
            if isinstance(value, list):
                assert row[key]["_type"] == "histogram"
                assert sum(row[key]["values"]) == sum(map(math.isfinite, value))
            else:
                assert row[key] == pytest.approx(value, nan_ok=True), key

    # The config is config.yaml's, the secret left out; the summary holds summary.json's.
    config = {k: v for k, v in run.config.items() if k != "_wandb"}
    assert config == yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["run"]["wandb"] is True and config["runtime"]["weights"]["token"] is None
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("num_steps", "initial_eval_accuracy", "final_eval_accuracy", "run_dir"):
        assert run.summary[key] == summary[key], key

    for path in run_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            assert API_KEY.encode() not in data and TOKEN.encode() not in data, path
