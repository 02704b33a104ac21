"""Async (max_staleness=1, every role its own Ray process) vs the synchronous loop, side by side.

Both runs use the demo's own default config: same task, model, warm start (shared cache),
steps and seed; only `runtime.mode` and `rollout.max_staleness` differ. The figure compared is
the RL phase's wall time (from starting the roles to the last optimizer step; the warm start
and Ray's own start-up are excluded from both). Prints the speed-up ratio (sync / async) last.

    python benchmarks/async_vs_sync.py [extra key=value overrides]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(mode: str, run_dir: Path, extra: list[str]) -> dict:
    args = [
        f"runtime.mode={mode}",
        f"run.run_dir={run_dir}",
        "run.progress=false",
        "run.log_every=0",
    ]
    if mode == "sync":
        args.append("rollout.max_staleness=0")
    cmd = [sys.executable, "-m", "streamrl.cli", "train", *args, *extra]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    extra = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        # Warm start once, outside the timed runs (both runs then reuse the cached policy).
        results = {mode: run(mode, Path(tmp) / mode, extra) for mode in ("sync", "ray")}
    print(
        f"{'mode':6} {'rl wall s':>10} {'steps':>6} {'acc before':>11} {'acc after':>10} {'tokens/s':>9}"
    )
    for mode, s in results.items():
        print(
            f"{mode:6} {s['rl_wall_time_s']:10.1f} {s['num_steps']:6d} {s['initial_eval_accuracy']:11.3f}"
            f" {s['final_eval_accuracy']:10.3f} {s['tokens_per_s']:9.0f}"
        )
    acc_gap = results["ray"]["final_eval_accuracy"] - results["sync"]["final_eval_accuracy"]
    print(f"final accuracy, async - sync: {acc_gap:+.3f}")
    print(
        f"speed-up (sync wall / async wall): {results['sync']['rl_wall_time_s'] / results['ray']['rl_wall_time_s']:.2f}"
    )


if __name__ == "__main__":
    main()
