"""The judge demo against the same job with the rule reward, side by side in one invocation.

Runs `streamrl train examples/judge.yaml` (the built-in judge is the only reward) and the same
config with the rule reward instead (`reward.function=arith_exact_match`, no judge), one after
the other, with the same seeds and steps, and prints for each: held-out accuracy before and
after (always measured by the rule), wall time (with the warm start and the judge's build when
`--cold`), seconds per RL step and the trainer's idle fraction; for the judge run also the
judge's held-out verdict accuracy, its throughput (samples judged a second of its busy time) and
the share of step time the policy waits on the judge:

    wait share = trainer idle fraction (judge run) - trainer idle fraction (rule run)

(the two runs differ only in who scores; the difference is the time the trainer sat idle
because verdicts were not ready yet, floored at 0). The last line is that share.

    python benchmarks/judge.py [--steps 100] [--cold] [overrides ...]

`--cold` builds everything in a fresh cache (warm start, judge), which is what a first run on a
new machine pays; without it the repository's cache is used.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from common import REPO, train_command

RULE = [
    "reward.judge.enabled=false",
    "reward.function=streamrl.reward.rule:arith_exact_match",
    "reward.eval_function=null",
]


def run(name: str, overrides: list[str], cache: Path | None) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"judge-bench-{name}-")) / "run"
    extra = [f"run.cache_dir={cache}"] if cache is not None else []
    cmd, env = train_command(run_dir, [str(REPO / "examples/judge.yaml"), *overrides, *extra])
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["command_wall_s"] = time.perf_counter() - started
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--cold", action="store_true", help="fresh cache: warm start and judge")
    args, overrides = parser.parse_known_args()
    overrides = [f"trainer.steps={args.steps}", *overrides]
    cache = Path(tempfile.mkdtemp(prefix="judge-bench-cache-")) if args.cold else None
    judge = run("judge", overrides, cache)
    rule = run("rule", [*overrides, *RULE], cache)
    for name, s in (("judge", judge), ("rule", rule)):
        steps = max(s["num_steps"] - s["resumed_from_step"], 1)
        print(
            f"{name:5s}: accuracy {s['initial_eval_accuracy']:.3f} -> "
            f"{s['final_eval_accuracy']:.3f}, wall {s['command_wall_s']:.0f} s "
            f"(RL {s['rl_wall_time_s']:.0f} s, {s['rl_wall_time_s'] / steps:.2f} s/step), "
            f"trainer idle {s['trainer_idle_fraction']:.3f}"
        )
    built = json.loads((Path(judge["judge_model_dir"]) / "judge_eval.json").read_text())
    print(
        f"judge: held-out verdict accuracy {judge['judge_verdict_accuracy']:.3f} "
        f"(on correct answers {built['accuracy_on_correct']:.3f}, on incorrect "
        f"{built['accuracy_on_incorrect']:.3f}), built in {built['build_s']:.0f} s, "
        f"throughput {judge['judge_samples_per_s']:.0f} samples/s of its busy time"
    )
    wait = max(0.0, judge["trainer_idle_fraction"] - rule["trainer_idle_fraction"])
    print(f"step time ratio judge/rule {judge['rl_wall_time_s'] / rule['rl_wall_time_s']:.2f}")
    print(f"policy wait on the judge, share of step time {wait:.3f}")


if __name__ == "__main__":
    main()
