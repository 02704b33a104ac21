"""Every algorithm preset on the built-in task: held-out accuracy before and after RL.

Each preset runs the demo's default job (same model, warm start, data, steps and seed; only
`algorithm.preset` differs) and the table printed at the end is the one in docs/algorithms.md.

    python benchmarks/presets.py [preset ...] [-- extra key=value overrides]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from streamrl.config.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]


def run(preset: str, run_dir: Path, extra: list[str]) -> dict:
    args = [f"algorithm.preset={preset}", f"run.run_dir={run_dir}", "run.progress=false", *extra]
    cmd = [sys.executable, "-m", "streamrl.cli", "train", *args]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    names = [a for a in (argv[: argv.index("--")] if "--" in argv else argv)] or list(PRESETS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            s = run(name, Path(tmp) / name, extra)
            rows.append((name, s))
            print(
                f"{name}: {s['initial_eval_accuracy']:.3f} -> {s['final_eval_accuracy']:.3f}",
                flush=True,
            )
    print("| preset | accuracy before | accuracy after | RL wall s | steps | dropped samples |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, s in rows:
        dropped = ", ".join(f"{k} {v}" for k, v in s["num_samples_dropped"].items()) or "0"
        print(
            f"| {name} | {s['initial_eval_accuracy']:.3f} | {s['final_eval_accuracy']:.3f} "
            f"| {s['rl_wall_time_s']:.0f} | {s['num_steps']} | {dropped} |"
        )
    worst = min(s["final_eval_accuracy"] - s["initial_eval_accuracy"] for _, s in rows)
    print(f"smallest accuracy gain over the presets: {worst:+.3f}")


if __name__ == "__main__":
    main()
