"""Set-up shared by the benchmark scripts: a `streamrl train` command line, model sizes, and the
demo's model and prompts for engine benchmarks (a fresh built-in tiny model directory of the
default config's size with random weights, and batches of the built-in task's prompts)."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Model sizes of the engine and trainer benchmarks: the demo's tiny Qwen3 (about 0.8 M
# parameters) and a larger one of the same family (about 32 M).
SIZES = {
    "default": {"hidden_size": 128, "num_layers": 4, "num_heads": 4},
    "large": {"hidden_size": 512, "num_layers": 10, "num_heads": 8},
}


def train_command(run_dir: Path, overrides: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of a quiet `streamrl train` run into `run_dir`, with its own Ray
    instance even when another job on the machine runs one."""
    cmd = [sys.executable, "-m", "streamrl.cli", "train", *overrides]
    cmd += [f"run.run_dir={run_dir}", "run.progress=false", "run.log_every=0"]
    return cmd, {**os.environ, "RAY_ADDRESS": "local"}


def demo_model_and_feeder(prefix: str, *, prompts: int, group_size: int):
    """(model directory, tokenizer, feeder): `feeder.batch(i)` gives batch i's bus rows."""
    from streamrl.config.schema import Config
    from streamrl.data.dataset import builtin_rows
    from streamrl.data.feeder import PromptFeeder
    from streamrl.models.loading import load_tokenizer
    from streamrl.models.tiny import build_tiny_model_dir

    cfg = Config().model
    model_dir = build_tiny_model_dir(
        Path(tempfile.mkdtemp(prefix=prefix)),
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        seed=0,
    )
    tokenizer = load_tokenizer(model_dir)
    feeder = PromptFeeder(
        builtin_rows(1_000, digits=2, seed=0, split="train"),
        tokenizer,
        batch_prompts=prompts,
        group_size=group_size,
        seed=0,
    )
    return model_dir, tokenizer, feeder
