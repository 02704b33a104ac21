"""Resumable checkpoints: model, optimizer, RNG, data cursor and the bus's consumption state.

A checkpoint is written after optimizer step k, before that step's rows are acknowledged, into
`run_dir/checkpoints/step-<k>`:

    step-<k>/
      model/               a normal HF directory (safetensors weights, config, tokenizer files)
      trainer.pt           optimizer state and RNG states: tensors and plain Python values only
      sharded/             sharded trainer ranks only: each rank's model and optimizer (DCP)
      trainer_state.json   next_step, version, the bus's consumption state
      manifest.json        every other file's size and sha256; written last

It is written into a temporary folder; every file is flushed to disk (fsync), the manifest is
written and flushed, then the folder is renamed into place and its parent flushed, so that a
crash at any point leaves either the whole checkpoint or none. Everything trained is exactly
batches 0..k-1, so `next_step` is also the feeder's cursor: a resumed run regenerates in-flight
batches with the same sample ids and trains each sample exactly once.

Nothing read back can run code: weights are safetensors, the state is JSON, and `trainer.pt` is
read with `torch.load(weights_only=True)` (a file holding anything but tensors and plain values
is refused), and `sharded/` through `safe_dcp.py`. `latest_checkpoint` picks the newest checkpoint whose files match its manifest and
skips, with a warning naming the file, one that is cut short, changed or unfinished: the run
resumes from the one before. Cleanup keeps the newest `KEEP_LAST` whole checkpoints and removes
the rest, so a bad checkpoint never displaces a good one. The checksums cost one read of the
checkpoint when it is written and one when it is chosen; reports (`streamrl status`, the final
model's folder) check sizes only. torch is imported by the functions that write and read
tensors, so that the CLI's `status` finds checkpoints without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.models.loading import THINKER_PREFIX, is_omni_dir, save_model

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

KEEP_LAST = 2
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt")
TRAINER_FILE = "trainer.pt"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(
    run_dir: Path, next_step: int, learner, policy_dir: Path, extra: dict[str, Any]
) -> Path:
    import torch

    root = checkpoint_root(run_dir)
    final = root / f"step-{next_step:06d}"
    tmp = root / f".tmp-step-{next_step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(learner.model, tmp / "model")
    copy_model_files(policy_dir, tmp / "model")
    torch.save(
        {"optimizer": learner.optimizer_state_dict(tmp), **_rng_states()}, tmp / TRAINER_FILE
    )
    state = {"next_step": next_step, "version": learner.version, **extra}
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True))
    seal(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(root)
    _remove_old(root)
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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            weights.update(load_file(str(path)))
        except SafetensorError as e:
            raise ValueError(f"{path} is not a readable safetensors file: {e}") from e
    return weights


def model_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The weights `save_model` wrote, under the names of the model's own parameters (an Omni
    directory's `thinker.` prefix taken off)."""
    weights = read_weights(model_dir)
    if is_omni_dir(model_dir):
        weights = {name.removeprefix(THINKER_PREFIX): t for name, t in weights.items()}
    return weights


def latest_checkpoint(run_dir: Path, *, checksums: bool = True) -> Path | None:
    """The newest checkpoint in `run_dir` that is whole (`checkpoint_problem`), or None. A newer
    one that is not is skipped with a warning that names the bad file: the run resumes from the
    one before. `checksums=False` checks sizes only (for callers that only report)."""
    for checkpoint in reversed(_step_dirs(checkpoint_root(run_dir))):
        problem = checkpoint_problem(checkpoint, checksums=checksums)
        if problem is None:
            return checkpoint
        log.warning("skipping checkpoint %s: %s; looking at the one before it", checkpoint, problem)
    return None


def latest_model_dir(run_dir: Path) -> Path | None:
    """The latest checkpoint's HF model folder: the trained policy so far."""
    checkpoint = latest_checkpoint(run_dir, checksums=False)
    return checkpoint / "model" if checkpoint is not None else None


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


def load_checkpoint(checkpoint: Path, learner) -> dict[str, Any]:
    """Restore `learner` (weights, optimizer, RNG) in place; return the trainer state."""
    import pickle

    import numpy as np
    import torch

    weights = model_weights(checkpoint / "model")
    path = checkpoint / TRAINER_FILE
    try:
        blob = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path} holds objects other than tensors and plain Python values, so it is not "
            "loaded (nothing in it was run): streamrl writes no such file, so it comes from "
            "elsewhere or was altered. Resume from another checkpoint or start a new run "
            f"({refusal_reason(e)})"
        ) from e
    learner.load_weights_and_optimizer(weights, blob["optimizer"], checkpoint)
    torch.set_rng_state(blob["torch_rng"])
    numpy_rng = blob["numpy_rng"]
    np.random.set_state(
        (
            numpy_rng["kind"],
            numpy_rng["keys"].numpy().astype(np.uint32),
            numpy_rng["pos"],
            numpy_rng["has_gauss"],
            numpy_rng["cached_gaussian"],
        )
    )
    python_rng = blob["python_rng"]
    random.setstate((python_rng["version"], tuple(python_rng["state"]), python_rng["gauss_next"]))
    state = read_state(checkpoint)
    learner.version = int(state["version"])
    return state


def refusal_reason(error: Exception) -> str:
    """The line of a `torch.load(weights_only=True)` refusal that says what it refused."""
    text = str(error)
    _, found, reason = text.partition("WeightsUnpickler error: ")
    return reason.split(". ")[0] if found else text.splitlines()[0]


def _rng_states() -> dict[str, Any]:
    """torch's, numpy's and Python's global RNG states as tensors and plain Python values, which
    is all that `torch.load(weights_only=True)` reads back (numpy arrays are not)."""
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    version, python_state, gauss_next = random.getstate()
    return {
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python_rng": {"version": version, "state": list(python_state), "gauss_next": gauss_next},
    }


# -- integrity ------------------------------------------------------------------------------------


def checkpoint_problem(checkpoint: Path, *, checksums: bool = True) -> str | None:
    """Why `checkpoint` cannot be resumed from, naming the file, or None when it is whole.

    Checked: the manifest is there (it is written last), every file it lists is there with the
    size it was written with, and the trainer state parses; with `checksums`, every file's sha256
    too (this reads every byte, as loading does)."""
    manifest_path = checkpoint / MANIFEST
    try:
        files = json.loads(manifest_path.read_text())["files"]
        written = {name: (int(e["bytes"]), str(e["sha256"])) for name, e in files.items()}
    except FileNotFoundError:
        return f"{manifest_path} is missing (the checkpoint was never finished)"
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{manifest_path} does not parse: {e!r}"
    for required in (STATE_FILE, TRAINER_FILE):
        if required not in written:
            return f"{manifest_path} lists no {required}"
    for name, (size, _) in written.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} were written"
    try:
        int(read_state(checkpoint)["next_step"])
    except (ValueError, KeyError, TypeError) as e:
        return f"{checkpoint / STATE_FILE} does not parse: {e!r}"
    if not checksums:
        return None
    for name, (_, sha256) in sorted(written.items()):
        if _sha256(checkpoint / name) != sha256:
            return f"{checkpoint / name} changed since it was written (its sha256 differs)"
    return None


def _sha256(path: Path, *, sync: bool = False) -> str:
    """`path`'s sha256; with `sync`, also flush the file to disk (fsync)."""
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if sync:
            os.fsync(f.fileno())
    return digest


def seal(folder: Path) -> None:
    """Flush every file under `folder` to disk, then write the manifest of their sizes and
    checksums (flushed too), then flush the folders themselves: after this the folder is whole
    on disk and may be renamed into place."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest = _sha256(path, sync=True)
        files[path.relative_to(folder).as_posix()] = {
            "bytes": path.stat().st_size,
            "sha256": digest,
        }
    with (folder / MANIFEST).open("w") as f:
        json.dump({"files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for directory in sorted(p for p in folder.rglob("*") if p.is_dir()):
        fsync_dir(directory)
    fsync_dir(folder)


def fsync_dir(directory: Path) -> None:
    """Flush `directory`'s entries (a file created or renamed in it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if p.is_dir())


def _remove_old(root: Path) -> None:
    """Keep the newest `KEEP_LAST` whole checkpoints; remove older ones and any that is not
    whole (a bad checkpoint never counts towards the ones kept)."""
    steps = _step_dirs(root)
    problems = {p: checkpoint_problem(p, checksums=False) for p in steps}
    keep = [p for p in steps if problems[p] is None][-KEEP_LAST:]
    for path in steps:
        if path in keep:
            continue
        if problems[path] is not None:
            log.warning("removing checkpoint %s: %s", path, problems[path])
        shutil.rmtree(path, ignore_errors=True)
