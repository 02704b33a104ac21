"""Async (max_staleness=1, every role its own Ray process) vs the synchronous loop, side by side.

All runs use the demo's own default config: same task, model, warm start (shared cache), steps
and seed; only `runtime.mode` and `rollout.max_staleness` differ. The figure compared is the RL
phase's wall time (from starting the roles to the last optimizer step; the warm start and Ray's
own start-up are excluded). Three runs:

- `sync`: the synchronous loop, one process using every core (the baseline of the target);
- `ray s=0`: the multi-process deployment held to strict on-policy (rollout and trainer take
  turns, each on its own core): isolates what overlapping them buys;
- `ray s=1`: the default asynchronous run.

With `--with-threads`, a fourth: `threads s=1`, the same asynchronous job with every role a
thread of one process (`runtime.mode=threads`), and its speed-up is printed before the last line.
Prints the speed-up ratio of the default asynchronous run against the synchronous loop
(sync / async) last.

    python benchmarks/async_vs_sync.py [--with-threads] [extra key=value overrides]
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
    cmd = [sys.executable, "-m", "streamrl.cli", "train", *args, *extra]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return
    with_threads = "--with-threads" in sys.argv[1:]
    extra = [arg for arg in sys.argv[1:] if arg != "--with-threads"]
    with tempfile.TemporaryDirectory() as tmp:
        # The first run warm-starts (if not cached yet) outside its timed span; the others reuse it.
        results = {
            "sync": run("sync", Path(tmp) / "sync", extra),
            "ray s=0": run("ray", Path(tmp) / "ray0", [*extra, "rollout.max_staleness=0"]),
            "ray s=1": run("ray", Path(tmp) / "ray1", extra),
        }
        if with_threads:
            results["threads s=1"] = run("threads", Path(tmp) / "threads1", extra)
    print(
        f"{'mode':11} {'rl wall s':>10} {'steps':>6} {'acc before':>11} {'acc after':>10} {'tokens/s':>9}"
    )
    for mode, s in results.items():
        print(
            f"{mode:11} {s['rl_wall_time_s']:10.1f} {s['num_steps']:6d} {s['initial_eval_accuracy']:11.3f}"
            f" {s['final_eval_accuracy']:10.3f} {s['tokens_per_s']:9.0f}"
        )
    wall = {mode: s["rl_wall_time_s"] for mode, s in results.items()}
    acc_gap = results["ray s=1"]["final_eval_accuracy"] - results["sync"]["final_eval_accuracy"]
    print(f"final accuracy, async - sync: {acc_gap:+.3f}")
    print(
        f"overlap gain in the same deployment (ray s=0 / ray s=1): {wall['ray s=0'] / wall['ray s=1']:.2f}"
    )
    if with_threads:
        print(
            f"threads mode: speed-up (sync wall / threads wall): {wall['sync'] / wall['threads s=1']:.2f}"
        )
    print(f"speed-up (sync wall / async wall): {wall['sync'] / wall['ray s=1']:.2f}")


if __name__ == "__main__":
    main()
