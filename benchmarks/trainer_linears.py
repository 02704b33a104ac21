"""The trainer's forward and backward with oneDNN linears against PyTorch's default (MKL).

`model.onednn_linears` ("auto" by default: on for AVX-512 CPUs not made by Intel) routes the fp32 CPU linear layers of the models that
train and score through oneDNN (`streamrl.models.onednn`). This script times the trainer's unit
of work, the forward and backward of one micro-batch through `response_logprobs` (the function
the trainer, reference and pi_old roles share), with both, side by side in one run:

- the micro-batch is the default job's: 8 groups x 8 samples of the built-in task's prompts
  through the chat template, responses of 8-24 tokens (seeded random ids; the cost does not
  depend on which tokens they are);
- two copies of the same model (the built-in Qwen3 at two sizes, random seeded weights), one
  switched to oneDNN; the two alternate, `--repeats` times after a warm-up, and the medians are
  compared;
- one torch thread by default, as in every role process of the default job (`--threads`).

It also prints the largest log-prob and gradient differences between the two (fp32 rounding).
The last line is the speed-up at each size.

    python benchmarks/trainer_linears.py [--repeats 20] [--threads 1] [--sizes default large]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import SIZES

from streamrl.data.arith import sample_problems
from streamrl.data.prompts import encode_prompt
from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.models.onednn import use_onednn_linears
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.trainer.logprobs import pack, response_logprobs

GROUPS, GROUP_SIZE = 8, 8  # trainer.micro_batch_groups and the group size of the default job


def micro_batch(tokenizer, vocab: int):
    rng = random.Random(0)
    problems = sample_problems(GROUPS, digits=2, seed=0, split="train")
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems for _ in range(GROUP_SIZE)]
    responses = [[rng.randrange(5, vocab) for _ in range(rng.randint(8, 24))] for _ in prompts]
    return pack(prompts, responses, tokenizer.pad_token_id)


def forward_backward(model, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    logprobs = response_logprobs(model, batch)
    logprobs.sum().backward()
    return logprobs.detach()


def parse_args(doc: str) -> argparse.Namespace:
    """The command line of the trainer benchmarks (`--repeats`, `--threads`, `--sizes`); sets
    the torch threads and prints them, the unit of work and the machine's load."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{args.threads} torch thread(s), torch {torch.__version__}; one micro-batch of "
        f"{GROUPS} x {GROUP_SIZE} samples, forward + backward, median of {args.repeats}"
    )
    print("load average before (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    return args


def side_by_side(
    models: dict[str, torch.nn.Module], batch, repeats: int
) -> tuple[dict[str, float], float, float]:
    """Two models' `forward_backward` of `batch`, alternating, `repeats` times after one warm-up
    round: the median seconds of each, then the largest log-prob difference and the largest
    gradient difference (relative to the parameter's largest gradient) between them."""
    (name_a, a), (name_b, b) = models.items()
    times: dict[str, list[float]] = {name_a: [], name_b: []}
    for repeat in range(repeats + 1):
        for name, model in models.items():
            start = time.perf_counter()
            forward_backward(model, batch)
            if repeat:  # the first round is the warm-up
                times[name].append(time.perf_counter() - start)
    diff_lp = (forward_backward(a, batch) - forward_backward(b, batch)).abs().max().item()
    diff_grad = max(
        ((pa.grad - pb.grad).abs().max() / pa.grad.abs().max()).item()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )
    return {name: statistics.median(t) for name, t in times.items()}, diff_lp, diff_grad


def main() -> None:
    args = parse_args(__doc__)
    speedups = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = build_tiny_model_dir(Path(tmp) / size, seed=0, **SIZES[size])
            plain = load_causal_lm(model_dir).train()
            fast = copy.deepcopy(plain)
            if not use_onednn_linears(fast):
                raise SystemExit("oneDNN linears are not usable in this PyTorch build")
            batch = micro_batch(load_tokenizer(model_dir), plain.config.vocab_size)
            models = {"mkl": plain, "onednn": fast}
            median, diff_lp, diff_grad = side_by_side(models, batch, args.repeats)
            speedups[size] = median["mkl"] / median["onednn"]
            tokens = int(batch.attention_mask_bt.numel())
            print(f"\n{size} model ({sum(p.numel() for p in plain.parameters()) / 1e6:.1f} M)")
            for name, seconds in median.items():
                print(f"  {name:7} {seconds * 1e3:8.1f} ms  ({tokens / seconds:8.0f} tokens/s)")
            print(f"  max |delta|: log-prob {diff_lp:.1e}, gradient {diff_grad:.1e} (relative)")
    print(
        "oneDNN / default linears, trainer forward+backward: "
        + ", ".join(f"{s} {r:.2f}x" for s, r in speedups.items())
    )


if __name__ == "__main__":
    main()
