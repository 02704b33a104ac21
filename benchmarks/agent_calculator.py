"""The calculator agent demo from a cold start: held-out episode success before and after RL,
and the wall time of the whole run, warm start included (an empty cache folder each round).

    python benchmarks/agent_calculator.py [--rounds N] [--example examples/agent_calculator.yaml]
        [-- extra key=value overrides]

Prints one line a round and the medians; the issue's bar: success <= 0.3 before RL, >= 0.7
after, within 15 minutes on 2 CPU cores (docs/agents.md, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(example: str, folder: Path, extra: list[str]) -> tuple[dict, float, dict]:
    """One cold run: its summary, its wall time (process start to exit) and its rollout stats."""
    run_dir = folder / "run"
    args = [example, f"run.run_dir={run_dir}", f"run.cache_dir={folder / 'cache'}"]
    cmd = [sys.executable, "-m", "streamrl.cli", "train", *args, "run.progress=false", *extra]
    started = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    log = (run_dir / "logs" / "rollout.log").read_text().splitlines()
    stopped = next(x for x in reversed(log) if "rollout: stopped;" in x)
    stats = ast.literal_eval(stopped.split("rollout: stopped;", 1)[1].strip())
    return json.loads((run_dir / "summary.json").read_text()), wall, stats


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--example", default="examples/agent_calculator.yaml")
    opts = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    walls, finals = [], []
    for k in range(opts.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            s, wall, stats = run(opts.example, Path(tmp), extra)
        walls.append(wall)
        finals.append(s["final_eval_accuracy"])
        print(
            f"round {k}: success {s['initial_eval_accuracy']:.3f} -> "
            f"{s['final_eval_accuracy']:.3f}; wall {wall:.0f} s (RL {s['rl_wall_time_s']:.0f} s); "
            f"peak memory {s['peak_memory_bytes'] / 2**30:.2f} GiB; tool calls per episode "
            f"{stats['episode_tool_calls_mean']:.2f}, turns {stats['episode_turns_mean']:.2f}; "
            f"episodes {stats['episodes']}",
            flush=True,
        )
    print(
        f"median of {opts.rounds}: final success {statistics.median(finals):.3f}, "
        f"wall {statistics.median(walls):.0f} s (target: >= 0.7 within 900 s)"
    )


if __name__ == "__main__":
    main()
