"""How much of a second core the async run can use: each phase's speed alone and beside another.

The async run puts the rollout and the trainer on a core each; it beats the synchronous loop
only if each phase, run beside the other, keeps the speed it has alone on an idle machine. On a
virtual machine two vCPUs may share one physical core (SMT siblings the guest cannot see) or a
memory path, and then a busy neighbour slows each phase down. This script measures that
directly, with the default job's own units of work, each process on one torch thread pinned to
a core of its own (`os.sched_setaffinity`):

- `train`: the forward and backward of one micro-batch of the default job (8 groups x 8
  samples; `benchmarks/trainer_linears.py`'s unit);
- `generate`: the builtin engine generating one rollout batch of the default job (32 prompts x
  8 samples, 24 new tokens, temperature 1) with the demo's model (random seeded weights);
- `matmul`: an fp32 `[256 x 512] x [512 x 1536]` product, a pure compute kernel whose operands
  fit in a core's L2 cache (a reference point free of Python and of memory traffic).

Each unit is timed alone (the other core idle), then beside a second process that runs a unit
in a loop on the other core for the whole measurement: `train` beside `generate` (the async
run's pairing), and each unit beside a copy of itself. Reported: the median seconds of each, and
the slowdown (beside / alone). The last line is the compute the two cores deliver to the async
pairing, in units of one idle-machine core: `alone_train / beside_train + alone_generate /
beside_generate` (2.00 when the neighbours do not slow each other down).

    python benchmarks/two_cores.py [--repeats 15] [--units train generate matmul]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

UNITS = ("train", "generate", "matmul")


def make_unit(name: str) -> Callable[[], object]:
    """A function doing one unit of work `name` (built in the calling process)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if name == "matmul":
        a, b = torch.randn(256, 512), torch.randn(512, 1536)
        return lambda: torch.mm(a, b)
    from common import SIZES, demo_model_and_feeder
    from trainer_linears import forward_backward, micro_batch

    from streamrl.models.loading import load_causal_lm, load_tokenizer
    from streamrl.models.tiny import build_tiny_model_dir

    if name == "train":
        model_dir = build_tiny_model_dir(
            Path(tempfile.mkdtemp(prefix="two-cores-")), seed=0, **SIZES["default"]
        )
        model = load_causal_lm(model_dir).train()
        batch = micro_batch(load_tokenizer(model_dir), model.config.vocab_size)
        return lambda: forward_backward(model, batch)
    if name == "generate":
        from streamrl.api import fields as F
        from streamrl.api.engine import GenerationRequest, SamplingParams
        from streamrl.rollout.builtin_engine import BuiltinEngine

        model_dir, tokenizer, feeder = demo_model_and_feeder("two-cores-", prompts=32, group_size=8)
        engine = BuiltinEngine(
            load_causal_lm(model_dir).eval(),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        prompts = [row["fields"][F.PROMPT_IDS].tolist() for row in feeder.batch(0)]
        params = SamplingParams(max_new_tokens=24, temperature=1.0)

        def generate() -> object:
            requests = [GenerationRequest(f"r{i}", ids) for i, ids in enumerate(prompts)]
            return engine.generate(requests, params)

        return generate
    raise ValueError(f"unknown unit {name!r}; one of {UNITS}")


def _timed(core: int, name: str, repeats: int, ready, go, results) -> None:
    """Child: build `name` on `core`, say ready, wait for go, time `repeats` runs (after two
    untimed ones), put the times."""
    os.sched_setaffinity(0, {core})
    unit = make_unit(name)
    unit(), unit()
    ready.set()
    go.wait()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        unit()
        times.append(time.perf_counter() - start)
    results.put(times)


def _loop(core: int, name: str, ready, stop) -> None:
    """Child: build `name` on `core`, say ready, run it until told to stop."""
    os.sched_setaffinity(0, {core})
    unit = make_unit(name)
    unit()
    ready.set()
    while not stop.is_set():
        unit()


def measure(name: str, beside: str | None, repeats: int) -> float:
    """Median seconds of unit `name` on core 0, with unit `beside` looping on core 1 (or the
    other core idle when None)."""
    ctx = mp.get_context("spawn")
    go, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    ready = [ctx.Event(), ctx.Event()]
    timed = ctx.Process(target=_timed, args=(0, name, repeats, ready[0], go, results))
    timed.start()
    neighbour = None
    if beside is not None:
        neighbour = ctx.Process(target=_loop, args=(1, beside, ready[1], stop))
        neighbour.start()
    else:
        ready[1].set()
    for event in ready:
        if not event.wait(300):
            raise SystemExit(f"a child did not start (unit {name!r} beside {beside!r})")
    go.set()
    times = results.get(timeout=600)
    stop.set()
    for proc in (timed, neighbour):
        if proc is not None:
            proc.join(60)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--units", nargs="+", default=list(UNITS), choices=UNITS)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs two cores")
    print(f"cores {sorted(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.2f}")
    pairs = [(unit, None) for unit in args.units] + [(unit, unit) for unit in args.units]
    if {"train", "generate"} <= set(args.units):
        pairs += [("train", "generate"), ("generate", "train")]
    median = {}
    for name, beside in pairs:
        median[name, beside] = measure(name, beside, args.repeats)
        alone = median[name, None]
        where = f"beside {beside}" if beside else "alone"
        ratio = f"  slowdown {median[name, beside] / alone:.2f}x" if beside else ""
        print(f"{name:9} {where:16} {median[name, beside] * 1e3:8.1f} ms{ratio}", flush=True)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    if ("train", "generate") in median:
        delivered = sum(
            median[a, None] / median[a, b]
            for a, b in (("train", "generate"), ("generate", "train"))
        )
        print(f"two cores deliver to train + generate: {delivered:.2f} idle-machine cores")


if __name__ == "__main__":
    main()
