"""Rollout throughput with one vs several vLLM engines behind one rollout service.

Each layout (`--layouts`, default: one engine in process, one engine in its own process, two
engines in their own processes, two engines in process) generates the same rounds of a training
batch through `VllmEngine.generate` (every group routed to the least-loaded engine), with the
per-engine request counts and the tokens per second of the whole batch. Every layout must sample
the same tokens (per-request seeds: where a request runs does not change it), which the script
checks. Engine start time is reported separately and not counted.

On CPU, engines in their own processes split this process's torch threads (`--threads`) between
them; in-process engines share one thread and take turns. The model is the demo's architecture
(built-in tiny Qwen3, default sizes) with random weights, so most responses run to
`--max-new-tokens`.

    .venv/bin/python benchmarks/vllm_engines.py [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import demo_model_and_feeder

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LAYOUTS = {
    "1-inproc": (1, True),
    "1-proc": (1, False),
    "2-proc": (2, False),
    "2-inproc": (2, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="from " + ",".join(LAYOUTS))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from streamrl.api.engine import SamplingParams
    from streamrl.config.schema import Config, VllmConfig
    from streamrl.rollout.service import to_requests
    from streamrl.rollout.vllm_engine import VllmEngine

    cfg = Config().model
    model_dir, tokenizer, feeder = demo_model_and_feeder(
        "vllm-engines-", prompts=args.prompts, group_size=args.group_size
    )
    num_rows = args.prompts * args.group_size
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)

    def batch(index: int):
        return to_requests(
            [{"sample_id": r["sample_id"], **r["fields"]} for r in feeder.batch(index)]
        )

    print(
        f"model: built-in tiny Qwen3 (hidden {cfg.hidden_size}, {cfg.num_layers} layers), "
        f"{cfg.dtype}; {num_rows} requests per round ({args.prompts} prompts x "
        f"{args.group_size}), up to {args.max_new_tokens} new tokens, {args.threads} threads, "
        f"median of {args.rounds} rounds after one warm-up"
    )
    print(f"{'layout':<10} {'start s':>8} {'wall s':>7} {'tokens/s':>9} {'per engine':>12}")
    reference: list[list[int]] | None = None
    for name in args.layouts.split(","):
        num_engines, in_process = LAYOUTS[name]
        started = time.perf_counter()
        engine = VllmEngine(
            model_dir,
            eos_token_id=tokenizer.eos_token_id,
            config=VllmConfig(kv_cache_gib=0.25, in_process=in_process, engines=num_engines),
            model_dtype=cfg.dtype,
            max_num_seqs=num_rows,
        )
        start_s = time.perf_counter() - started
        try:
            engine.generate(batch(0), params)  # warm-up: kernels for new shapes
            walls, num_tokens = [], 0
            before = engine.requests_per_engine
            for round_index in range(1, args.rounds + 1):
                requests = batch(round_index)
                t0 = time.perf_counter()
                results = engine.generate(requests, params)
                walls.append(time.perf_counter() - t0)
                num_tokens = sum(len(r.response_ids) for r in results)
                if round_index == 1:
                    tokens = [r.response_ids for r in results]
                    if reference is None:
                        reference = tokens
                    elif tokens != reference:
                        raise AssertionError(f"{name} sampled other tokens than the first layout")
            routed = [a - b for a, b in zip(engine.requests_per_engine, before, strict=True)]
        finally:
            engine.close()
        wall = statistics.median(walls)
        print(
            f"{name:<10} {start_s:>8.1f} {wall:>7.3f} {num_tokens / wall:>9.0f} "
            f"{'/'.join(str(n) for n in routed):>12}"
        )


if __name__ == "__main__":
    main()
