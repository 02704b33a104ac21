"""Checkpoints read back no code and survive bad files: a crafted `trainer.pt` or DCP folder is
refused without running anything, the RNG states round-trip without pickle, and
`latest_checkpoint` skips a newest checkpoint that is cut short, changed or unfinished (naming
the file) for the one before, which cleanup never removes in favour of a bad one."""

from __future__ import annotations

import logging
import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from streamrl.trainer.checkpoint import (
    MANIFEST,
    STATE_FILE,
    TRAINER_FILE,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from streamrl.trainer.safe_dcp import SafeLoadPlanner, SafeReader
from tests.unit.test_checkpoint import make_learner


class WritesMarker:
    """Unpickling this creates the file `marker`: what a crafted checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def learner(model_dir):
    return make_learner(model_dir)


def run_with_checkpoints(tmp_path: Path, learner, model_dir: Path, *steps: int) -> Path:
    run_dir = tmp_path / "run"
    for step in steps:
        save_checkpoint(run_dir, step, learner, model_dir, {"bus": {}})
    return run_dir


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step-{step:06d}"


# -- no code from data ----------------------------------------------------------------------------


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_crafted_trainer_file_is_refused_without_running_it(tmp_path, learner, model_dir, writer):
    run_dir = run_with_checkpoints(tmp_path, learner, model_dir, 1)
    marker = tmp_path / "pwned"
    crafted = {"optimizer": WritesMarker(marker)}
    with (step_dir(run_dir, 1) / TRAINER_FILE).open("wb") as f:
        torch.save(crafted, f) if writer == "torch.save" else pickle.dump(crafted, f)
    with pytest.raises(ValueError, match=f"{TRAINER_FILE} holds objects other than tensors"):
        load_checkpoint(step_dir(run_dir, 1), make_learner(model_dir))
    assert not marker.exists()
    # Nor is it chosen to resume from: it no longer matches the manifest.
    assert latest_checkpoint(run_dir) is None


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.normal()), torch.rand(3).tolist()


def test_rng_states_round_trip_without_pickle(tmp_path, learner, model_dir):
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    draws()  # numpy's cached Gaussian is set now: that part of its state round-trips too
    run_dir = run_with_checkpoints(tmp_path, learner, model_dir, 1)
    expected = draws()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    load_checkpoint(step_dir(run_dir, 1), make_learner(model_dir))
    assert draws() == expected
    blob = torch.load(step_dir(run_dir, 1) / TRAINER_FILE, weights_only=True)
    assert set(blob) == {"optimizer", "torch_rng", "numpy_rng", "python_rng"}


def test_a_crafted_dcp_folder_is_refused_without_running_it(tmp_path):
    def load(folder: str) -> dict:
        state = {"w": torch.zeros(4), "version": 0}
        dcp.load(state, storage_reader=SafeReader(tmp_path / folder), planner=SafeLoadPlanner())
        return state

    dcp.save({"w": torch.arange(4.0), "version": 3}, checkpoint_id=str(tmp_path / "good"))
    loaded = load("good")
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["version"] == 3

    marker = tmp_path / "pwned"
    # A value that is not a tensor (DCP stores it with torch.save and reads it back unpickled).
    crafted = {"w": torch.arange(4.0), "version": WritesMarker(marker)}
    dcp.save(crafted, checkpoint_id=str(tmp_path / "value"))
    # DCP reports each rank's error inside its own exception.
    with pytest.raises(CheckpointException, match="'version' holds objects other than tensors"):
        load("value")
    # The metadata file, which DCP reads with pickle.load.
    (tmp_path / "good" / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    with pytest.raises(
        (ValueError, CheckpointException),
        match=r"\.metadata is not loaded.*open is not part of DCP",
    ):
        load("good")
    assert not marker.exists()


# -- bad checkpoints are skipped ------------------------------------------------------------------


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "name", "why"),
    [
        (truncate, "model/model.safetensors", "bytes, .* were written"),
        (truncate, TRAINER_FILE, "bytes, .* were written"),
        (truncate, STATE_FILE, "bytes, .* were written"),
        (flip_last_byte, TRAINER_FILE, "changed since it was written"),
        (Path.unlink, MANIFEST, "never finished"),
        (Path.unlink, "model/config.json", "is missing"),
    ],
)
def test_a_bad_newest_checkpoint_is_skipped_for_the_one_before(
    tmp_path, learner, model_dir, caplog, damage, name, why
):
    run_dir = run_with_checkpoints(tmp_path, learner, model_dir, 1, 2)
    assert latest_checkpoint(run_dir) == step_dir(run_dir, 2)
    damage(step_dir(run_dir, 2) / name)
    with caplog.at_level(logging.WARNING, logger="streamrl.trainer.checkpoint"):
        assert latest_checkpoint(run_dir) == step_dir(run_dir, 1)
    [warning] = [r.getMessage() for r in caplog.records]
    assert str(step_dir(run_dir, 2) / name) in warning and re.search(why, warning)
    assert load_checkpoint(step_dir(run_dir, 1), make_learner(model_dir))["next_step"] == 1


def test_cleanup_never_keeps_a_bad_checkpoint_in_place_of_a_good_one(tmp_path, learner, model_dir):
    run_dir = run_with_checkpoints(tmp_path, learner, model_dir, 1, 3)
    truncate(step_dir(run_dir, 3) / TRAINER_FILE)
    # The run resumed from step 1 and writes step 2: both good ones stay, the bad one goes.
    save_checkpoint(run_dir, 2, learner, model_dir, {})
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step-000001", "step-000002"]
    assert latest_checkpoint(run_dir) == step_dir(run_dir, 2)
    save_checkpoint(run_dir, 3, learner, model_dir, {})
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step-000002", "step-000003"]  # KEEP_LAST whole ones, no temporary folder
