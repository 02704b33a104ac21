"""How close the async run comes to perfect overlap of rollout and training.

With rollout and trainer in two processes on two cores, the best an asynchronous run can do is
one step per max(generation time, training time) of that step: every other cost (scoring,
advantages, moving samples and weights between processes, waiting) is overhead of the
asynchrony. This script measures the three quantities for the same work and prints
`async_wall / max(rollout_alone, training_alone)` last (1.00 is perfect overlap; target <= 1.15).

The work is the demo's default job (built-in model and warm start, 32 prompts x 8 samples,
24 new tokens, GRPO) cut to `--steps` steps, with evaluation and checkpoints kept out of the
steps (`trainer.eval_every=0`, `trainer.checkpoint_every=0`). The first `--warmup-steps` steps
(role start-up, filling the pipeline) are left out of every sum. Two runs:

1. The phases alone: `streamrl train runtime.mode=sync runtime.sync_threads=1`, the synchronous
   loop on one torch thread, which runs each phase of a step by itself, one after the other,
   with the same engine and learner code and settings as the async roles. Per step it records
   (`streamrl/runtime/sync.py`):

   - rollout alone (`time/rollout_busy_s`): building the step's rows from the prompt feeder,
     `engine.generate` of all 256 samples (prefill, decode, sampling, per-token log-probs and
     versions) with the builtin engine, and converting the results to sample fields. Not
     included: loading the new weights into the engine, scoring, advantages.
   - training alone (`time/trainer_busy_s`): the trainer's work on the generated and scored
     batch: for every micro-batch, filtering, packing, forward and backward; then the optimizer
     step (gradient scaling, clipping, AdamW). Not included: getting the samples, and handing
     the new weights to the engine.

   The sync run's samples are strictly on-policy; the async run's are up to one version old.
   Prompts, model, settings and the kind of responses are the same.

2. The async run as shipped: `streamrl train` (Ray, every role its own process with one torch
   thread, max_staleness=1). async wall is the sum of the trainer's `time/step_s`, the time
   between two consecutive optimizer steps, over the same steps: everything that keeps the
   trainer from the next step counts (waiting for samples, the reward sandbox, advantages, the
   bus, weight publication, and the two busy processes sharing the cores with the light roles).
   `--async-modes threads` (or `ray threads`: both, side by side) runs the same job with
   `runtime.mode=threads` instead: every role a thread of one process, on one torch thread.

Also printed, as evidence of where the difference goes:

- the busy times the async run's roles report for the same steps (rollout busy there also
  includes streaming finished samples to the bus and loading newer weights between decode steps);
- CPU seconds per step of every process of each run (from /proc, sampled between the end of the
  warm-up steps and the end of the next-to-last step), grouped by role: the driver, each role's
  Ray process (pids from the run's roles.json) with its children (the reward sandbox), the bus
  shards, the weight store and Ray's own processes. The machine has two cores, so a run can
  use at most 2 CPU-seconds per second of wall time.

`--rounds N` makes N pairs of runs, alternating which of the two goes first, and pools the
measured steps of all of them (the machine's load from other jobs then hits both alike).

    python benchmarks/overlap.py [--steps 40] [--warmup-steps 5] [--rounds 1]
        [--async-modes ray|threads ...] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from common import train_command

REPO = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- CPU time of a process tree, from /proc --------------------------------------------------------


def process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far: user + system) for every process we can read."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # the process ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return table


def descendants(table: dict[int, tuple[int, float]], root: int) -> set[int]:
    children = defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    out, todo = set(), [root]
    while todo:
        pid = todo.pop()
        out.add(pid)
        todo.extend(children[pid])
    return out


def command(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def label(pid: int, root: int, parents: dict[int, int], roles: dict[int, str], cmd: str) -> str:
    """Which part of the run a process belongs to (a role's children count as the role)."""
    if pid == root:
        return "driver"
    ancestor: int | None = pid
    while ancestor is not None and ancestor != root:
        if ancestor in roles:
            return f"role: {roles[ancestor]}"
        ancestor = parents.get(ancestor)
    if "BusShard" in cmd:
        return "bus shards"
    if "WeightStore" in cmd:
        return "weight store"
    return "ray's own processes"


# -- one run -------------------------------------------------------------------------------------


def run(run_dir: Path, overrides: list[str], window: tuple[int, int]) -> tuple[list[dict], dict]:
    """One `streamrl train` run: the metrics records of its training steps, and CPU seconds per
    process group between the records of steps window[0] and window[1] (plus the wall time)."""
    cmd, env = train_command(run_dir, overrides)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, env=env)
    metrics = run_dir / "metrics.jsonl"
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    started = ended = 0.0
    while proc.poll() is None:
        done = metrics.read_text().count('"response/tokens"') if metrics.exists() else 0
        if window[0] <= done and not ended:
            table = process_table()
            tree = descendants(table, proc.pid)
            now = {pid: table[pid][1] for pid in tree}
            if not first:
                first, started = now, time.perf_counter()
            last.update(now)  # keeps processes that ended inside the window
            for pid in tree:
                parents[pid] = table[pid][0]
                names.setdefault(pid, command(pid))
            if done >= window[1]:
                ended = time.perf_counter()
        time.sleep(0.25)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    roles = {}
    if (run_dir / "roles.json").exists():
        status = json.loads((run_dir / "roles.json").read_text())
        roles = {info["pid"]: name for name, info in status["roles"].items() if "pid" in info}
    cpu: dict[str, float] = defaultdict(float)
    for pid, seconds in last.items():
        group = label(pid, proc.pid, parents, roles, names.get(pid, ""))
        cpu[group] += seconds - first.get(pid, 0.0)
    cpu["(wall)"] = ended - started
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r for r in records if "response/tokens" in r], dict(cpu)


def column(records: list[dict], key: str) -> list[float]:
    return [float(r.get(key, 0.0)) for r in records]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument(
        "--rounds", type=int, default=1, help="pairs of runs, alternating which is first"
    )
    p.add_argument(
        "--async-modes",
        nargs="+",
        choices=("ray", "threads"),
        default=["ray"],
        help="runtime.mode of the async run(s); with several, the ratio of the last is printed last",
    )
    p.add_argument("extra", nargs="*", help="streamrl key=value overrides for every run")
    a = p.parse_args()
    w = a.warmup_steps
    if a.steps < w + 3:
        raise SystemExit(f"--steps ({a.steps}) must be at least --warmup-steps + 3 ({w + 3})")
    common = [f"trainer.steps={a.steps}", "trainer.eval_every=0", "trainer.checkpoint_every=0"]
    common += a.extra
    kinds = {"alone": ["runtime.mode=sync", "runtime.sync_threads=1", *common]}
    for mode in a.async_modes:
        kinds[f"async {mode}"] = [f"runtime.mode={mode}", *common]
    print(f"machine: {os.cpu_count()} CPUs, {_load()}", flush=True)
    window = (w, a.steps - 1)  # CPU sampling: from step w's record to step (steps-1)'s
    steps: dict[str, list[dict]] = {kind: [] for kind in kinds}  # measured steps, all rounds
    cpu: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in kinds}
    accuracy: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(a.rounds):
            for kind in list(kinds)[:: 1 if round_ % 2 == 0 else -1]:
                records, used = run(Path(tmp) / f"{kind}-{round_}", kinds[kind], window)
                steps[kind] += records[w:]
                accuracy[kind].append(records[-1]["eval/accuracy"])
                for group, seconds in used.items():
                    cpu[kind][group] += seconds
                print(f"round {round_ + 1} {kind}: done, {_load()}", flush=True)

    rollout_alone = column(steps["alone"], "time/rollout_busy_s")
    training_alone = column(steps["alone"], "time/trainer_busy_s")
    runs = [kind for kind in kinds if kind != "alone"]
    measured = len(steps["alone"])
    print(f"\n{measured} steps ({a.rounds} x steps {w + 1}..{a.steps}): seconds, sum and median")
    print(f"{'figure':40} {'sum s':>8} {'median s':>9}")
    rows = [
        ("rollout alone (sync loop, 1 thread)", rollout_alone),
        ("training alone (sync loop, 1 thread)", training_alone),
    ]
    for kind in runs:
        rows.append((f"{kind}: wall (trainer step to step)", column(steps[kind], "time/step_s")))
        for role in ("rollout", "trainer", "reward", "advantage"):
            rows.append((f"  {kind}: {role} busy", column(steps[kind], f"time/{role}_busy_s")))
    for name, values in rows:
        print(f"{name:40} {sum(values):8.2f} {statistics.median(values):9.3f}")

    num_steps = a.rounds * (window[1] - window[0])
    print(f"\nCPU seconds per step, {a.rounds} x steps {window[0] + 1}..{window[1]} (2 cores)")
    for kind, title in (("alone", "phases alone (sync, 1 thread)"), *((k, k) for k in runs)):
        wall = cpu[kind].pop("(wall)")
        total = sum(cpu[kind].values())
        print(f"{title}: {total / num_steps:.3f} CPU-s/step, {total / wall:.2f} cores busy")
        for group, seconds in sorted(cpu[kind].items(), key=lambda kv: -kv[1]):
            print(f"  {group:38} {seconds / num_steps:8.3f}")

    print(
        "\nfinal held-out accuracy: "
        + "; ".join(
            f"{'sync' if kind == 'alone' else kind} "
            + ", ".join(f"{x:.3f}" for x in accuracy[kind])
            for kind in kinds
        )
    )
    bound = max(sum(rollout_alone), sum(training_alone))
    for kind in runs:
        ratio = sum(column(steps[kind], "time/step_s")) / bound
        print(f"{kind}: async_wall / max(rollout_alone, training_alone) = {ratio:.2f}")


def _load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
