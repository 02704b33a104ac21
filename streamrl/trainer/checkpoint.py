"""Resumable checkpoints: model, optimizer, RNG, data cursor and the bus's consumption state.

A checkpoint is written after optimizer step k, before that step's rows are acknowledged, into
`run_dir/checkpoints/step-<k>` (a temporary folder renamed into place, so a crash never leaves a
half-written one). Everything trained is exactly batches 0..k-1, so `trainer_state.json`'s
`next_step` is also the feeder's cursor: a resumed run regenerates in-flight batches with the
same sample ids and trains each sample exactly once. The model folder is a normal HF directory.
torch is imported by the functions that write and read tensors, so that the CLI's `status`
finds checkpoints without it.
"""

from __future__ import annotations

import json
import random
import shutil
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KEEP_LAST = 2
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt")


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(
    run_dir: Path, next_step: int, learner, policy_dir: Path, extra: dict[str, Any]
) -> Path:
    import numpy as np
    import torch

    root = checkpoint_root(run_dir)
    final = root / f"step-{next_step:06d}"
    tmp = root / f".tmp-step-{next_step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    learner.model.save_pretrained(str(tmp / "model"))
    copy_model_files(policy_dir, tmp / "model")
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


def copy_model_files(policy_dir: Path, model_dir: Path) -> None:
    """Copy into `model_dir` every file of the policy's directory that is not a weight file and
    that `save_pretrained` did not write: the tokenizer in whatever form it came (`tokenizer.json`,
    `vocab.json` and `merges.txt`, a SentencePiece `tokenizer.model`, ...), its chat template and a
    processor's config, so that a checkpoint's model folder loads on its own anywhere."""
    written = {p.name for p in model_dir.iterdir()}
    for src in sorted(policy_dir.iterdir()):
        if src.is_file() and src.name not in written and not _is_weights(src.name):
            shutil.copy(src, model_dir / src.name)


def _is_weights(name: str) -> bool:
    return any(fnmatch(name, pattern) for pattern in WEIGHT_FILES)


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors `save_pretrained` wrote into `model_dir`, in one file or in shards."""
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        weights.update(load_file(str(path)))
    return weights


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted(
        p for p in checkpoint_root(run_dir).glob("step-*") if (p / "trainer_state.json").is_file()
    )
    return found[-1] if found else None


def latest_model_dir(run_dir: Path) -> Path | None:
    """The latest checkpoint's HF model folder: the trained policy so far."""
    checkpoint = latest_checkpoint(run_dir)
    return checkpoint / "model" if checkpoint is not None else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "trainer_state.json").read_text())


def load_checkpoint(checkpoint: Path, learner) -> dict[str, Any]:
    """Restore `learner` (weights, optimizer, RNG) in place; return the trainer state."""
    import numpy as np
    import torch

    weights = read_weights(checkpoint / "model")
    blob = torch.load(checkpoint / "trainer.pt", weights_only=False)
    learner.load_weights_and_optimizer(weights, blob["optimizer"], checkpoint)
    torch.set_rng_state(blob["torch_rng"])
    np.random.set_state(blob["numpy_rng"])
    random.setstate(blob["python_rng"])
    state = read_state(checkpoint)
    learner.version = int(state["version"])
    return state
