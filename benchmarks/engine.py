"""Generation throughput: the builtin engine vs Hugging Face `model.generate` (and vLLM if present).

Every engine gets the same model, the same prompts (the built-in arithmetic task's prompts
through the chat template, 7-11 tokens each), the same sampling (pure temperature sampling: no
top-k, no top-p) and the same `max_new_tokens`, in fp32 on CPU. Two model sizes, both built by
`streamrl.models.tiny` with random (seeded) weights:

- `default`: the demo's tiny Qwen3 (hidden 128, 4 layers, 4 heads, about 0.8 M parameters);
- `large`: hidden 512, 10 layers, 8 heads (about 32 M parameters).

`--group-size 1` (the default) makes every prompt distinct; `--group-size 8` is the shape of a
GRPO rollout batch (each prompt sampled 8 times in a row), where an engine that computes a shared
prompt once gains.

A figure is generated tokens per second: response tokens up to and including EOS (HF generate
keeps padding finished rows until the whole batch stops; those pads are not counted). Each
engine runs once for warm-up, then `--repeats` timed runs; builtin and HF generate alternate so
that a change of machine load hits both alike, and the medians are reported. vLLM, when
importable, is timed the same way in a child process of its own, just before the other two (see
`time_vllm`). The last line is the builtin / HF generate ratio at each size.

    python benchmarks/engine.py [--num-prompts 256] [--group-size 1] [--max-new-tokens 24]
        [--repeats 3] [--sizes default large] [--skip-vllm] [--also module:EngineClass]

`--also` times another engine class with the same constructor as `BuiltinEngine` alongside (for
example an earlier version of it, to measure a change in the same run: figures taken minutes
apart on a shared machine do not compare).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import SIZES

from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.data.arith import sample_problems
from streamrl.data.prompts import encode_prompt
from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.rollout.builtin_engine import BuiltinEngine

_VLLM_RESULT = "vllm tokens/s: "  # how the child process of `time_vllm` reports

# A timed run: returns the number of generated tokens.
Runner = Callable[[list[list[int]], SamplingParams], int]


def make_prompts(tokenizer, num: int, group_size: int) -> list[list[int]]:
    """`num` prompts: `num / group_size` distinct problems, each repeated `group_size` times in a
    row (a GRPO rollout batch, as the feeder builds it)."""
    if num % group_size:
        raise ValueError(f"--num-prompts ({num}) must be a multiple of --group-size ({group_size})")
    problems = sample_problems(num // group_size, digits=3, seed=0, split="train")
    return [encode_prompt(tokenizer, p.prompt) for p in problems for _ in range(group_size)]


def builtin_runner(engine_cls, model, tokenizer) -> Runner:
    engine = engine_cls(
        model, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )

    def run(prompts: list[list[int]], params: SamplingParams) -> int:
        requests = [GenerationRequest(f"p{i}", ids) for i, ids in enumerate(prompts)]
        return sum(len(r.response_ids) for r in engine.generate(requests, params))

    return run


def hf_runner(model, tokenizer) -> Runner:
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    @torch.no_grad()
    def run(prompts: list[list[int]], params: SamplingParams) -> int:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(prompts):  # left padding, as generate expects for decoder-only
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            attention_mask[i, width - len(ids) :] = 1
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=params.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=params.max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
        )
        responses = out[:, width:]
        is_eos = responses == eos
        # Tokens up to and including the first EOS; the pads after it are not generated work.
        first_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, responses.shape[1])
        return int(first_eos.sum())

    return run


def vllm_runner(model_dir: Path, num_prompts: int) -> Runner:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm

    llm = vllm.LLM(
        model=str(model_dir),
        dtype="float32",
        seed=0,
        enforce_eager=True,
        max_num_seqs=num_prompts,
        kv_cache_memory_bytes=1 << 30,
    )

    def run(prompts: list[list[int]], params: SamplingParams) -> int:
        # No per-request seed: identical prompts would then draw identical samples.
        sampling = vllm.SamplingParams(
            temperature=params.temperature, max_tokens=params.max_new_tokens
        )
        token_prompts = [{"prompt_token_ids": ids} for ids in prompts]
        outputs = llm.generate(token_prompts, sampling, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return run


def time_vllm(model_dir: Path, args: argparse.Namespace) -> float | None:
    """vLLM's median tokens/s, measured in a child process; None (with a note) if it fails.

    A child process because vLLM pins this process's threads and replaces
    `torch.set_num_threads`, and its engine process keeps spinning between calls: in the same
    process it would slow down every engine timed after it.
    """
    cmd = [sys.executable, __file__, "--vllm-only", str(model_dir), *_shared_args(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"note: vLLM failed (exit {proc.returncode}); last output:\n{proc.stderr[-2000:]}")
        return None
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith(_VLLM_RESULT)]
    return float(line.removeprefix(_VLLM_RESULT))


def _shared_args(args: argparse.Namespace) -> list[str]:
    return [
        f"--num-prompts={args.num_prompts}",
        f"--group-size={args.group_size}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--temperature={args.temperature}",
        f"--repeats={args.repeats}",
    ]


def time_runners(
    runners: dict[str, Runner], prompts: list[list[int]], params: SamplingParams, repeats: int
) -> dict[str, float]:
    """Median tokens/s of each runner over `repeats` interleaved runs, after one warm-up each."""
    for run in runners.values():
        run(prompts, params)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            num_tokens = run(prompts, params)
            rates[name].append(num_tokens / (time.perf_counter() - start))
    return {name: statistics.median(r) for name, r in rates.items()}


def import_engine(spec: str):
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument(
        "--group-size", type=int, default=1, help="samples per distinct prompt (8: GRPO-shaped)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--also", metavar="MODULE:CLASS", help="another engine class to time")
    parser.add_argument("--skip-vllm", action="store_true", help="do not time vLLM even if present")
    parser.add_argument("--vllm-only", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)

    if args.vllm_only:  # the child process of `time_vllm`: print vLLM's median tokens/s
        model_dir = Path(args.vllm_only)
        prompts = make_prompts(load_tokenizer(model_dir), args.num_prompts, args.group_size)
        run = vllm_runner(model_dir, len(prompts))
        print(
            _VLLM_RESULT + str(time_runners({"vllm": run}, prompts, params, args.repeats)["vllm"])
        )
        return

    has_vllm = not args.skip_vllm and importlib.util.find_spec("vllm") is not None
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}; {args.num_prompts} prompts "
        f"({args.num_prompts // args.group_size} distinct x {args.group_size}), "
        f"max_new_tokens={args.max_new_tokens}, temperature={args.temperature}, "
        f"median of {args.repeats} after a warm-up"
    )
    print("load average before (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    if not has_vllm:
        print("note: vllm is not importable (or --skip-vllm); not timing it")

    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = build_tiny_model_dir(Path(tmp) / size, seed=0, **SIZES[size])
            model = load_causal_lm(model_dir)
            tokenizer = load_tokenizer(model_dir)
            prompts = make_prompts(tokenizer, args.num_prompts, args.group_size)
            num_params = sum(p.numel() for p in model.parameters())
            runners = {
                "builtin": builtin_runner(BuiltinEngine, model, tokenizer),
                "hf generate": hf_runner(model, tokenizer),
            }
            if args.also:
                runners[args.also] = builtin_runner(import_engine(args.also), model, tokenizer)
            vllm_rate = time_vllm(model_dir, args) if has_vllm else None
            rates = time_runners(runners, prompts, params, args.repeats)
            if vllm_rate is not None:
                rates["vllm (own process)"] = vllm_rate
            print(f"\n{size} model ({num_params / 1e6:.1f} M parameters, {SIZES[size]})")
            # Other processes on the machine skew every figure: say how busy it was.
            print(
                "  load average after (1, 5, 15 min): {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
            )
            for name, rate in rates.items():
                print(f"  {name:24} {rate:10.0f} tokens/s")
            ratios[size] = rates["builtin"] / rates["hf generate"]
            print(f"  builtin / hf generate: {ratios[size]:.2f}")
    print(
        "builtin / HF generate tokens/s: " + ", ".join(f"{s} {r:.2f}x" for s, r in ratios.items())
    )


if __name__ == "__main__":
    main()
