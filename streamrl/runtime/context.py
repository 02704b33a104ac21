"""What every role needs to know about a run, prepared once by the controller.

`prepare` resolves the policy directory (building and warm-starting the built-in model on first
use), loads the datasets, and fixes the run directory. The result is small and plain, so it can
be passed to Ray actors, which rebuild their heavy objects (model, tokenizer) from it.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from streamrl.config.schema import Config
from streamrl.data.dataset import PromptRow, builtin_rows, load_jsonl

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    cfg: Config
    policy_dir: Path
    run_dir: Path
    train_rows: list[PromptRow]
    eval_rows: list[PromptRow]
    num_malformed_rows: int = 0
    checkpoint: Path | None = None
    """Checkpoint the trainer resumes from (None: a fresh start)."""


def make_run_dir(cfg: Config) -> Path:
    """`run.run_dir`, or a new `runs/<timestamp>` folder: created here, with a suffix when jobs
    started in the same second (a sweep) would otherwise share one."""
    if cfg.run.run_dir is not None:
        return Path(cfg.run.run_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    Path("runs").mkdir(exist_ok=True)
    for n in itertools.count():
        path = Path("runs") / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def load_datasets(cfg: Config) -> tuple[list[PromptRow], list[PromptRow], int]:
    d = cfg.data
    skipped = 0
    if d.train_file:
        report = load_jsonl(d.train_file)
        train, skipped = report.rows, report.num_skipped
    else:
        train = builtin_rows(5_000, digits=d.digits, seed=d.seed, split="train")
    if d.eval_file:
        report = load_jsonl(d.eval_file)
        evals, skipped = report.rows[: d.num_eval], skipped + report.num_skipped
    elif d.train_file:  # the built-in task's problems would say nothing about this data
        train, evals = hold_out(train, d.num_eval, d.seed)
        log.info(
            "data.eval_file not set: %d of the %d rows of %s held out for evaluation",
            len(evals),
            len(train) + len(evals),
            d.train_file,
        )
    else:
        evals = builtin_rows(d.num_eval, digits=d.digits, seed=d.seed, split="eval")
    return train, evals, skipped


def hold_out(
    rows: list[PromptRow], num_eval: int, seed: int
) -> tuple[list[PromptRow], list[PromptRow]]:
    """Split `rows` into training rows and held-out rows: min(num_eval, a tenth of them), at
    least one, picked by `seed`; each part keeps the file's order."""
    if len(rows) < 2:
        raise ValueError(
            f"data.train_file has {len(rows)} usable row(s): need two or more to hold some out "
            "for evaluation, or set data.eval_file"
        )
    num = max(1, min(num_eval, len(rows) // 10))
    held = set(random.Random(f"{seed}-eval").sample(range(len(rows)), num))
    train = [row for i, row in enumerate(rows) if i not in held]
    return train, [row for i, row in enumerate(rows) if i in held]


def prepare(
    cfg: Config, policy_dir: Path, run_dir: Path, checkpoint: Path | None = None
) -> RunContext:
    train, evals, skipped = load_datasets(cfg)
    return RunContext(cfg, policy_dir, run_dir, train, evals, skipped, checkpoint)
