"""Resumable checkpoints: model, optimizer, RNG, data cursor and the bus's consumption state.

A checkpoint is written after optimizer step k, before that step's rows are acknowledged, into
`run_dir/checkpoints/step-<k>` (a temporary folder renamed into place, so a crash never leaves a
half-written one). Everything trained is exactly batches 0..k-1, so `trainer_state.json`'s
`next_step` is also the feeder's cursor: a resumed run regenerates in-flight batches with the
same sample ids and trains each sample exactly once. The model folder is a normal HF directory.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

KEEP_LAST = 2


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(
    run_dir: Path, next_step: int, learner, policy_dir: Path, extra: dict[str, Any]
) -> Path:
    root = checkpoint_root(run_dir)
    final = root / f"step-{next_step:06d}"
    tmp = root / f".tmp-step-{next_step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    learner.model.save_pretrained(str(tmp / "model"))
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ):
        if (policy_dir / name).is_file():
            shutil.copy(policy_dir / name, tmp / "model" / name)
    torch.save(
        {
            "optimizer": learner.optimizer_state_dict(tmp),
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
        },
        tmp / "trainer.pt",
    )
    state = {"next_step": next_step, "version": learner.version, **extra}
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(root.glob("step-*"))[:-KEEP_LAST]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(
        p for p in checkpoint_root(run_dir).glob("step-*") if (p / "trainer_state.json").is_file()
    )
    return found[-1] if found else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def load_checkpoint(checkpoint: Path, learner) -> dict[str, Any]:
    """Restore `learner` (weights, optimizer, RNG) in place; return the trainer state."""
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "model" / "model.safetensors"))
    blob = torch.load(checkpoint / "trainer.pt", weights_only=False)
    learner.load_weights_and_optimizer(weights, blob["optimizer"], checkpoint)
    torch.set_rng_state(blob["torch_rng"])
    np.random.set_state(blob["numpy_rng"])
    random.setstate(blob["python_rng"])
    state = read_state(checkpoint)
    learner.version = int(state["version"])
    return state
