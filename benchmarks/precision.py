"""fp32, pure bf16 and mixed precision on the default task, side by side.

Three runs of the default job (Ray mode, object-store channel, the shared warm start), each
with the same seed, steps and task; only the precision differs:

- `fp32`: everything in fp32 (the default);
- `bf16`: `model.dtype=bfloat16`: trainer, AdamW state, engine and weight sync all in bf16;
- `mixed`: `model.dtype=bfloat16 trainer.mixed_precision=true`: the trainer computes in bf16
  over fp32 master weights and fp32 AdamW state; the engine runs in bf16 and rounds the
  published fp32 weights when it loads them.

Printed per run: held-out greedy accuracy before and after, the RL phase's seconds per step
(wall time from starting the roles to the last step, over the steps), the trainer's busy
seconds per step, the mean per-step log-prob mismatch between trainer and engine
(`train/logprob_mismatch`, which shows bf16 drift; with max_staleness=1 it also holds the
one-version lag) and the peak memory of the run.

    python benchmarks/precision.py [--only fp32,bf16,mixed] [extra key=value overrides]

e.g. `python benchmarks/precision.py trainer.steps=20 trainer.eval_every=0` for a short run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PRECISIONS = {
    "fp32": [],
    "bf16": ["model.dtype=bfloat16"],
    "mixed": ["model.dtype=bfloat16", "trainer.mixed_precision=true"],
}


def run(run_dir: Path, overrides: list[str]) -> dict:
    args = [f"run.run_dir={run_dir}", "run.progress=false", "run.log_every=0", *overrides]
    cmd = [sys.executable, "-m", "streamrl.cli", "train", *args]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, filter(None, lines)) if "train/loss" in m]
    summary["trainer_s_per_step"] = sum(m["time/trainer_busy_s"] for m in steps) / len(steps)
    summary["mismatch"] = sum(m["train/logprob_mismatch"] for m in steps) / len(steps)
    return summary


def main() -> None:
    args = sys.argv[1:]
    if {"-h", "--help"} & set(args):
        print(__doc__)
        return
    only = list(PRECISIONS)
    if "--only" in args:
        at = args.index("--only")
        only = args[at + 1].split(",")
        del args[at : at + 2]
    # Each row is printed as its run ends: a later run that fails keeps the earlier figures.
    print(
        f"{'precision':10} {'steps':>5} {'acc before':>10} {'acc after':>9} {'s/step':>7}"
        f" {'trainer s/step':>14} {'mismatch':>9} {'peak GiB':>8}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in only:
            s = run(Path(tmp) / name, [*PRECISIONS[name], *args])
            print(
                f"{name:10} {s['num_steps']:5d} {s['initial_eval_accuracy']:10.3f}"
                f" {s['final_eval_accuracy']:9.3f} {s['rl_wall_time_s'] / s['num_steps']:7.2f}"
                f" {s['trainer_s_per_step']:14.2f} {s['mismatch']:9.2e}"
                f" {s['peak_memory_bytes'] / 2**30:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
