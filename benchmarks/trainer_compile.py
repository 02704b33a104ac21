"""The trainer's forward and backward compiled (`trainer.compile`) against eager, side by side.

The unit of work is `benchmarks/trainer_linears.py`'s: the forward and backward of one
micro-batch of the default job (8 groups x 8 samples of the built-in task, responses of 8-24
tokens) through `response_logprobs`, at two model sizes (random seeded weights), on one torch
thread by default as in the default job's trainer process. Two copies of the same model, one
wrapped the way the trainer wraps it (`streamrl.trainer.learner.compile_for_training`:
`torch.compile`, inductor, dynamic shapes), alternate `--repeats` times after the compilation,
and the medians are compared. Both keep PyTorch's own linears (a compiled trainer does).

Printed per size: the time of the first compiled call (the compilation: longer the first time
on a machine, shorter once inductor's on-disk cache holds the kernels), each median, the largest
log-prob and gradient differences, and last the speed-up at each size.

    python benchmarks/trainer_compile.py [--repeats 20] [--threads 1] [--sizes default large]
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path

from common import SIZES
from trainer_linears import forward_backward, micro_batch, parse_args, side_by_side

from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.trainer.learner import compile_for_training


def main() -> None:
    args = parse_args(__doc__)
    speedups = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = build_tiny_model_dir(Path(tmp) / size, seed=0, **SIZES[size])
            eager = load_causal_lm(model_dir).train()
            compiled = compile_for_training(copy.deepcopy(eager))  # shares the copy's parameters
            batch = micro_batch(load_tokenizer(model_dir), eager.config.vocab_size)
            start = time.perf_counter()
            forward_backward(compiled, batch)
            compile_s = time.perf_counter() - start
            models = {"eager": eager, "compiled": compiled}
            median, diff_lp, diff_grad = side_by_side(models, batch, args.repeats)
            speedups[size] = median["eager"] / median["compiled"]
            print(f"\n{size} model ({sum(p.numel() for p in eager.parameters()) / 1e6:.1f} M)")
            print(f"  first compiled call (compilation): {compile_s:.1f} s")
            for name, seconds in median.items():
                print(f"  {name:8} {seconds * 1e3:8.1f} ms")
            print(f"  max |delta|: log-prob {diff_lp:.1e}, gradient {diff_grad:.1e} (relative)")
    print(
        "compiled / eager, trainer forward+backward: "
        + ", ".join(f"{s} {r:.2f}x" for s, r in speedups.items())
    )


if __name__ == "__main__":
    main()
