"""The default job and `async_vs_sync.py`, for this checkout and an earlier commit, side by side.

For a change that must not change behaviour (a refactor): both trees run the same work in one
session, alternating, with one shared warm-start cache, so machine noise hits both alike. The
earlier commit is checked out as a git worktree under a temporary folder and run with this
checkout's Python environment (the dependencies must not differ).

    python benchmarks/side_by_side.py BASE_COMMIT [--rounds N] [--no-async-vs-sync]

Prints, per tree, the default job's held-out accuracy before and after, its RL wall time, its
whole wall time and peak memory (medians over the rounds), then each tree's async_vs_sync
figures; the last line is the ratio of the default job's RL wall time, this checkout / base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def default_job(tree: Path, run_dir: Path, cache: Path) -> dict:
    """The embedded default job (`streamrl train`), with the shared warm-start cache."""
    cmd = [
        sys.executable,
        "-m",
        "streamrl.cli",
        "train",
        f"run.run_dir={run_dir}",
        f"run.cache_dir={cache}",
        "run.progress=false",
    ]
    started = time.perf_counter()
    subprocess.run(cmd, cwd=tree, env=_env(tree), check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["whole_wall_s"] = time.perf_counter() - started
    return summary


def async_vs_sync(tree: Path, cache: Path) -> str:
    cmd = [sys.executable, "benchmarks/async_vs_sync.py", f"run.cache_dir={cache}"]
    out = subprocess.run(cmd, cwd=tree, env=_env(tree), check=True, capture_output=True, text=True)
    return out.stdout.strip()


def _env(tree: Path) -> dict[str, str]:
    """This tree's package first on the path, in every process the job starts (Ray's too)."""
    return {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="the earlier commit")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-async-vs-sync", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = tmp / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base), args.base],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        try:
            trees = {"base": base, "this": REPO}
            cache = tmp / "cache"
            # One untimed run builds the shared warm start, so that no timed run includes it.
            default_job(REPO, tmp / "warm", cache)
            jobs: dict[str, list[dict]] = {name: [] for name in trees}
            for i in range(args.rounds):
                for name, tree in trees.items():
                    jobs[name].append(default_job(tree, tmp / f"{name}-{i}", cache))
            figures = {}
            if not args.no_async_vs_sync:
                figures = {name: async_vs_sync(tree, cache) for name, tree in trees.items()}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO)
    print(f"default job, median of {args.rounds} round(s) each, alternating:")
    print(
        f"{'tree':5} {'acc before':>10} {'acc after':>9} {'rl wall s':>9} {'wall s':>7} {'peak GiB':>8}"
    )
    rl_wall = {}
    for name, runs in jobs.items():

        def med(key: str, runs=runs) -> float:
            return statistics.median(float(r[key]) for r in runs)

        rl_wall[name] = med("rl_wall_time_s")
        peak = med("peak_memory_bytes") / 2**30 if "peak_memory_bytes" in runs[0] else float("nan")
        print(
            f"{name:5} {med('initial_eval_accuracy'):10.3f} {med('final_eval_accuracy'):9.3f}"
            f" {rl_wall[name]:9.1f} {med('whole_wall_s'):7.1f} {peak:8.2f}"
        )
    for name, text in figures.items():
        print(f"\nasync_vs_sync.py, {name}:\n{text}")
    print(f"default job RL wall time, this / base: {rl_wall['this'] / rl_wall['base']:.2f}")


if __name__ == "__main__":
    main()
