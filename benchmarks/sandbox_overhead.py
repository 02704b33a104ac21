"""What the reward sandbox costs: one call through a sandboxed worker against the same call in
this process.

The reward is the built-in `streamrl.reward.rule:arith_exact_match` (microseconds of work), so
the figures are the sandbox's own: the task and its result crossing the private channel as JSON,
the per-call CPU budget and, under `namespaces`, the sweep for processes a call left behind.
For each level (`none`, `process`, `namespaces`):

- start: seconds from the scorer's construction to its worker's first result (the sandbox and
  the interpreter start once per worker, not per call);
- per call: median over `--calls` single-task `score` calls;
- batched: per task, median over `--batches` calls of `--batch` tasks on one worker.

The last line, `overhead_ms`, is the `namespaces` per-call median minus the in-process median.

    python benchmarks/sandbox_overhead.py [--calls 2000] [--batch 256] [--batches 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

from streamrl.reward.rule import arith_exact_match
from streamrl.reward.sandbox import SandboxedScorer, ScoreTask
from streamrl.reward.scoring import to_result

FUNCTION = "streamrl.reward.rule:arith_exact_match"
TASK = ScoreTask("7+5=12,3+8+1=12:122", "122")


def in_process_ms(calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        to_result(arith_exact_match(TASK.response, TASK.answer, **TASK.extra))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def sandboxed(level: str, calls: int, batch: int, batches: int) -> dict[str, float]:
    start = time.perf_counter()
    scorer = SandboxedScorer(FUNCTION, timeout_s=10.0, sandbox=level)
    try:
        assert scorer.score([TASK])[0].value == 1.0
        start_s = time.perf_counter() - start
        single = []
        for _ in range(calls):
            start = time.perf_counter()
            scorer.score([TASK])
            single.append(time.perf_counter() - start)
        per_task = []
        for _ in range(batches):
            start = time.perf_counter()
            scorer.score([TASK] * batch)
            per_task.append((time.perf_counter() - start) / batch)
        assert scorer.num_restarts == 0
    finally:
        scorer.close()
    return {
        "start_s": start_s,
        "call_ms": statistics.median(single) * 1e3,
        "batched_ms": statistics.median(per_task) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()

    baseline = in_process_ms(args.calls)
    print(f"in process: {baseline * 1e3:.1f} us per call")
    figures = {}
    for level in ("none", "process", "namespaces"):
        figures[level] = sandboxed(level, args.calls, args.batch, args.batches)
        f = figures[level]
        print(
            f"{level:>10}: start {f['start_s']:.2f} s, per call {f['call_ms']:.3f} ms, "
            f"batched {f['batched_ms']:.3f} ms per task"
        )
    print(f"overhead_ms {figures['namespaces']['call_ms'] - baseline:.3f}")


if __name__ == "__main__":
    main()
