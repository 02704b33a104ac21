"""`streamrl replay`: train recorded steps again from a run's sample record (`record.py`), without
engines, and check that each step's loss and gradient norm equal the recorded ones exactly.

The learner is built as the trainer role builds it (`role.make_batch_trainer`: the run's saved
config, so the same dtype, loss, optimizer, oneDNN and compile settings), with the torch threads
the trainer trained with (kept in each step's record), and restored from checkpoint K (weights,
AdamW state, RNG states and version; the learning rate is a function of the version). Step K+1..
then go through the same `BatchTrainer` code as in the run: each recorded micro-batch in its
order, then the optimizer step. Equal means `==` on the floats (NaN equals NaN).

`inspect_step` prints one step's samples: decoded prompt and response, reward, advantage,
versions, whether and why a row was not trained, and per token the behaviour log-prob, version and
loss mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.api import fields as F
from streamrl.api.run import RunContext
from streamrl.config import load_config
from streamrl.trainer.checkpoint import (
    checkpoint_problem,
    checkpoint_root,
    latest_checkpoint,
    read_state,
)
from streamrl.trainer.record import StepRecord, read_step, recorded_steps


@dataclass
class ReplayedStep:
    step: int
    recorded_loss: float
    replayed_loss: float
    recorded_grad_norm: float
    replayed_grad_norm: float

    @property
    def equal(self) -> bool:
        return same(self.recorded_loss, self.replayed_loss) and same(
            self.recorded_grad_norm, self.replayed_grad_norm
        )


def same(a: float, b: float) -> bool:
    """Bit for bit as floats: `==`, or both NaN."""
    return a == b or (math.isnan(a) and math.isnan(b))


def checkpoint_at(run_dir: Path, step: int) -> Path:
    """Checkpoint `step` of the run (the one whose `next_step` is `step`), checked whole."""
    path = checkpoint_root(run_dir) / f"step-{step:06d}"
    have = sorted(
        int(p.name.removeprefix("step-"))
        for p in checkpoint_root(run_dir).glob("step-*")
        if p.is_dir()
    )
    if not path.is_dir():
        raise FileNotFoundError(
            f"{run_dir} has no checkpoint of step {step}; it has "
            + (", ".join(map(str, have)) if have else "none")
            + " (a run keeps its newest two)"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} cannot be replayed from: {problem}")
    if int(read_state(path)["next_step"]) != step:
        raise ValueError(f"checkpoint {path} says next_step {read_state(path)['next_step']}")
    return path


def replay(
    run_dir: Path, from_step: int, steps: int | None = None, on_step=None
) -> list[ReplayedStep]:
    """Restore checkpoint `from_step` and train the recorded steps `from_step + 1` ..
    `from_step + steps` (all recorded ones after it when `steps` is None) again; `on_step`
    is called with each `ReplayedStep` as it is done."""
    import torch

    from streamrl.models.loading import base_model_dir
    from streamrl.trainer.checkpoint import load_checkpoint
    from streamrl.trainer.role import make_batch_trainer

    run_dir = Path(run_dir)
    checkpoint = checkpoint_at(run_dir, from_step)
    if steps is None:
        steps = max((s for s in recorded_steps(run_dir) if s > from_step), default=from_step)
        steps -= from_step
        if steps == 0:
            raise FileNotFoundError(f"{run_dir} has no sample record after step {from_step}")
    records = [read_step(run_dir, s) for s in range(from_step + 1, from_step + steps + 1)]
    cfg = load_config([str(run_dir / "config.yaml")])
    torch.set_num_threads(int(records[0].meta["num_threads"]))
    # The checkpoint's model folder is the policy's architecture and tokenizer; its weights, and
    # the optimizer's and RNG states, are then restored as a resumed trainer restores them.
    ctx = RunContext(
        cfg=cfg,
        policy_dir=base_model_dir(checkpoint / "model"),  # a LoRA run's: the base's
        run_dir=run_dir,
        train_rows=None,
        eval_rows=[],
        checkpoint=checkpoint,
    )
    trainer = make_batch_trainer(ctx)
    learner = trainer.learner
    try:
        load_checkpoint(checkpoint, learner)
        out: list[ReplayedStep] = []
        for record in records:
            if learner.version != record.step - 1:
                raise ValueError(
                    f"the learner is at version {learner.version}, step {record.step}'s record "
                    f"was trained at {record.step - 1}"
                )
            meta = record.meta
            torch.set_num_threads(int(meta["num_threads"]))
            if meta.get("total_steps") is not None and hasattr(learner, "total_steps"):
                learner.total_steps = int(meta["total_steps"])  # the schedule the step ran under
            trainer.max_staleness = meta.get("max_staleness", trainer.max_staleness)
            for kind, reason, lo, hi in record.events:
                if kind == "train":
                    trainer.train_microbatch(record.rows[lo:hi])
                else:
                    trainer.drop_rows(record.rows[lo:hi], str(reason))
            metrics = trainer.finish()["metrics"]
            step = ReplayedStep(
                step=record.step,
                recorded_loss=record.loss,
                replayed_loss=float(metrics["train/loss"]),
                recorded_grad_norm=record.grad_norm,
                replayed_grad_norm=float(metrics["train/grad_norm"]),
            )
            out.append(step)
            if on_step is not None:
                on_step(step)
        return out
    finally:
        learner.close()


def replay_table(results: list[ReplayedStep]):
    """A rich table: step, recorded and replayed loss and gradient norm, equal or not."""
    from rich.table import Table

    table = Table(title="replay")
    for column in ("step", "loss recorded", "loss replayed", "grad_norm recorded"):
        table.add_column(column, justify="right")
    table.add_column("grad_norm replayed", justify="right")
    table.add_column("equal")
    for r in results:
        table.add_row(
            str(r.step),
            repr(r.recorded_loss),
            repr(r.replayed_loss),
            repr(r.recorded_grad_norm),
            repr(r.replayed_grad_norm),
            "yes" if r.equal else "[bold red]NO[/]",
        )
    return table


# -- inspect ---------------------------------------------------------------------------------------


def _tokenizer(run_dir: Path):
    from streamrl.models.loading import load_tokenizer

    checkpoint = latest_checkpoint(run_dir, checksums=False)
    if checkpoint is None:
        return None
    return load_tokenizer(checkpoint / "model")


def _short(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if np.ndim(value) == 0:
        return str(value)
    array = np.asarray(value, dtype=np.float64)
    return f"per token, mean {array.mean():.4g}" if array.size else "per token, none"


def inspect_step(run_dir: Path, step: int, *, console=None, tokens: bool = True) -> StepRecord:
    """Print step `step`'s recorded samples and per-token figures."""
    from rich.console import Console
    from rich.table import Table

    from streamrl.trainer.service import drop_reason

    run_dir = Path(run_dir)
    console = console or Console(highlight=False, soft_wrap=True)
    record = read_step(run_dir, step)
    cfg = load_config([str(run_dir / "config.yaml")])
    tokenizer = _tokenizer(run_dir)
    meta = record.meta

    def text(ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return repr(tokenizer.decode(ids)) if tokenizer is not None else str(ids)

    console.print(
        f"[bold]step {step}[/] (trained at version {step - 1}): {len(record.rows)} samples in "
        f"{len(record.micro_batches())} micro-batches; loss {meta['loss']!r}, grad_norm "
        f"{meta['grad_norm']!r}, lr {meta.get('lr')!r}, {meta.get('num_threads')} threads"
    )
    micro = 0
    for kind, reason, lo, hi in record.events:
        label = f"micro-batch {micro}" if kind == "train" else f"dropped ({reason})"
        micro += kind == "train"
        for index in range(lo, hi):
            row = record.rows[index]
            status = (
                reason
                if kind == "drop"
                else drop_reason(
                    row, step - 1, meta.get("max_staleness"), cfg.algorithm.shaping.mask_truncated
                )
            )
            versions = np.asarray(row.get(F.VERSIONS, []), dtype=np.int64)
            span = f"{versions.min()}..{versions.max()}" if versions.size else "-"
            console.print(
                f"\n[bold]#{index}[/] {label} {row.get('sample_id')} reward "
                f"{_short(row.get(F.REWARD))} ({row.get(F.REWARD_STATUS)}) advantage "
                f"{_short(row.get(F.ADVANTAGES))} versions {span} finish "
                f"{row.get(F.FINISH_REASON)} "
                + ("trained" if status is None else f"[yellow]not trained: {status}[/]")
            )
            console.print(f"  prompt:   {text(row.get(F.PROMPT_IDS, []))}")
            console.print(f"  response: {text(row.get(F.RESPONSE_IDS, []))}")
            if not tokens:
                continue
            table = Table(box=None, pad_edge=False, show_edge=False, padding=(0, 1))
            per_token = [("token", None), ("id", None), ("logprob", F.ROLLOUT_LOGPROBS)]
            per_token += [
                (name, key)
                for name, key in (
                    ("old_logprob", F.OLD_LOGPROBS),
                    ("ref_logprob", F.REF_LOGPROBS),
                    ("value", F.VALUES),
                    ("advantage", F.ADVANTAGES),
                )
                if key in row and row[key] is not None and np.ndim(row[key]) == 1
            ]
            per_token += [("version", F.VERSIONS), ("mask", None)]
            for name, _ in per_token:
                table.add_column(name, justify="left" if name == "token" else "right")
            response = [int(i) for i in np.asarray(row.get(F.RESPONSE_IDS, [])).reshape(-1)]
            for t, token in enumerate(response):
                cells = []
                for name, key in per_token:
                    if name == "token":
                        cells.append(
                            repr(tokenizer.decode([token])) if tokenizer is not None else ""
                        )
                    elif name == "id":
                        cells.append(str(token))
                    elif name == "mask":
                        cells.append("1" if status is None else "0")
                    else:
                        values = np.asarray(row[key]).reshape(-1)
                        value = values[t] if t < values.size else None
                        cells.append(
                            "-"
                            if value is None
                            else str(int(value))
                            if key == F.VERSIONS
                            else f"{float(value):.5f}"
                        )
                table.add_row(*cells)
            console.print(table)
    return record
