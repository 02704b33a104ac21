"""How far the behaviour log-probs of truncated sampling lie from the trainer's full-distribution
log-probs, on the default task.

With top-p, top-k or min-p the engine records each token's log-prob under the truncated,
renormalised distribution it was drawn from; the trainer recomputes the log-prob under the full
temperature-scaled distribution. Their gap per token is -log(kept mass) >= 0, exactly 0 where
nothing was cut. This prints, per setting, over the warm-started policy's responses to the
default task's training prompts (its cached warm start, built on first use): the mean and
largest |rollout - trainer| gap per token, the share of tokens whose distribution was cut, and
the mean importance weight exp(trainer - rollout) that the off-policy correction would apply to
tokens of the current policy.

    .venv/bin/python benchmarks/sampling_controls.py [--prompts 64] [--group 8] [--engine vllm]
"""

from __future__ import annotations

import argparse
import time

import torch

SETTINGS = {
    "top_p=1.0 (default)": {},
    "top_p=0.9": {"top_p": 0.9},
    "top_p=0.7": {"top_p": 0.7},
    "top_k=5": {"top_k": 5},
    "min_p=0.1": {"min_p": 0.1},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--engine", choices=["builtin", "vllm"], default="builtin")
    args = parser.parse_args()

    from streamrl.api.engine import GenerationRequest, SamplingParams
    from streamrl.config.loader import load_config
    from streamrl.data.dataset import builtin_rows
    from streamrl.data.prompts import encode_prompt
    from streamrl.models.loading import load_causal_lm, load_tokenizer
    from streamrl.rollout.builtin_engine import BuiltinEngine
    from streamrl.trainer.logprobs import pack, response_logprobs
    from streamrl.trainer.sft import ensure_policy_dir

    cfg = load_config([])
    policy_dir = ensure_policy_dir(cfg)
    tokenizer = load_tokenizer(policy_dir)
    model = load_causal_lm(policy_dir).eval()
    if args.engine == "vllm":
        from streamrl.config.schema import VllmConfig
        from streamrl.rollout.vllm_engine import VllmEngine

        engine = VllmEngine(
            policy_dir,
            eos_token_id=tokenizer.eos_token_id,
            config=VllmConfig(kv_cache_gib=0.25),
        )
    else:
        engine = BuiltinEngine(
            load_causal_lm(policy_dir),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tokenizer=tokenizer,
        )
    rows = builtin_rows(args.prompts, digits=cfg.data.digits, seed=1, split="train")
    requests = [
        GenerationRequest(f"{i}/{k}", encode_prompt(tokenizer, row.prompt))
        for i, row in enumerate(rows)
        for k in range(args.group)
    ]
    temperature = cfg.rollout.temperature
    print(
        f"engine {args.engine}, {len(requests)} responses ({args.prompts} prompts x "
        f"{args.group}), temperature {temperature}, warm-started policy {policy_dir}"
    )
    print(f"{'setting':<22}{'mean |gap|':>12}{'max |gap|':>11}{'cut tokens':>12}{'mean IS w':>11}")
    for name, controls in SETTINGS.items():
        params = SamplingParams(cfg.rollout.max_new_tokens, temperature, seed=0, **controls)
        started = time.perf_counter()
        results = engine.generate(requests, params)
        seconds = time.perf_counter() - started
        batch = pack(
            [r.prompt_ids for r in requests],
            [r.response_ids for r in results],
            tokenizer.pad_token_id,
        )
        with torch.no_grad():
            trainer_br = response_logprobs(model, batch, temperature)
        gaps, weights = [], []
        for i, result in enumerate(results):
            rollout = torch.tensor(result.logprobs, dtype=torch.float64)
            trainer = trainer_br[i, : len(result.logprobs)].double()
            gaps.append(rollout - trainer)
            weights.append(torch.exp(trainer - rollout))
        gap = torch.cat(gaps)
        cut = float((gap > 1e-4).double().mean())
        print(
            f"{name:<22}{float(gap.abs().mean()):>12.5f}{float(gap.abs().max()):>11.4f}"
            f"{cut:>12.3f}{float(torch.cat(weights).mean()):>11.4f}   ({seconds:.1f} s)"
        )
    close = getattr(engine, "close", None)
    if close is not None:
        close()


if __name__ == "__main__":
    main()
