"""Rollout routing replay (R3) on the built-in Qwen3-MoE in bf16: log-prob mismatch and cost.

Two measurements, side by side in one invocation, on `examples/moe.yaml`'s model (the built-in
tiny model as a Qwen3-MoE, 8 experts a layer, 2 per token, warm-started; built once and cached
like the demo's warm start):

1. Mismatch. The builtin engine in bf16 samples `--samples` responses to the task's prompts and
   records its routing; the trainer's forward (transformers, bf16, the same weights) scores
   them without replay and with the engine's experts replayed. Printed: mean and max
   |engine log-prob - trainer log-prob| over the response tokens for each, the share of routing
   decisions that flip between the two, and the reductions replay brings.
2. Overhead. `--pairs` pairs of end-to-end runs of the example in bf16 (`trainer.steps` steps,
   no evaluation), replay off and on, alternated so that the machine's drift hits both; per
   run the seconds per step of its RL phase. The overhead is the median over pairs of
   (on - off) / off, printed last as `overhead 0.0xx`.

    python benchmarks/routing_replay.py [--samples 512] [--pairs 3] [--steps 30] [key=value ...]

`--random` scores a random-weight model of the same shape instead of the warm start;
`--attention math` makes the in-process attention (the trainer's, and the builtin engine's)
run PyTorch's math path, which computes in fp32 inside, instead of its fused bf16 kernel: what
is left of the gap then shows how much of it was attention's rounding (docs/moe.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import REPO, train_command

EXAMPLE = REPO / "examples" / "moe.yaml"


def moe_config(overrides: list[str]):
    from streamrl.config.loader import load_config

    return load_config([str(EXAMPLE), *overrides])


def make_engine(name: str, policy, tokenizer):
    """The engine `name` (builtin or vllm) over `policy` in bf16, recording its routing."""
    if name == "vllm":
        from streamrl.config.schema import VllmConfig
        from streamrl.rollout.vllm_engine import VllmEngine

        return VllmEngine(
            policy,
            eos_token_id=tokenizer.eos_token_id,
            config=VllmConfig(),
            model_dtype="bfloat16",
            max_num_seqs=512,
            capture_routes=True,
        )
    from streamrl.models.loading import load_causal_lm
    from streamrl.rollout.builtin_engine import BuiltinEngine

    return BuiltinEngine(
        load_causal_lm(policy, dtype="bfloat16"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
        capture_routes=True,
    )


def mismatch(
    samples: int, engine_name: str, *, random_weights: bool = False, overrides: list[str]
) -> dict[str, float]:
    import numpy as np
    import torch

    from streamrl.api import fields as F
    from streamrl.data.dataset import builtin_rows
    from streamrl.data.feeder import PromptFeeder
    from streamrl.models import moe
    from streamrl.models.loading import load_causal_lm, load_tokenizer
    from streamrl.rollout.engines import sampling_params
    from streamrl.rollout.service import result_fields, to_requests
    from streamrl.trainer.learner import detached_logprobs
    from streamrl.trainer.sft import ensure_policy_dir

    cfg = moe_config([f"run.cache_dir={REPO / '.cache' / 'streamrl'}", *overrides])
    if random_weights:
        from streamrl.models.tiny import build_tiny_model_dir

        m = cfg.model
        policy = build_tiny_model_dir(
            Path(tempfile.mkdtemp(prefix="tiny-moe-")),
            hidden_size=m.hidden_size,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            seed=cfg.run.seed,
            num_experts=m.num_experts,
            experts_per_token=m.experts_per_token,
        )
    else:
        policy = ensure_policy_dir(cfg)
    tokenizer = load_tokenizer(policy)
    group = cfg.rollout.group_size
    feeder = PromptFeeder(
        builtin_rows(1_000, digits=cfg.data.digits, seed=cfg.run.seed, split="train"),
        tokenizer,
        batch_prompts=max(1, samples // group),
        group_size=group,
        seed=0,
    )
    rows = [{"sample_id": row["sample_id"], **row["fields"]} for row in feeder.batch(0)]
    torch.manual_seed(0)
    engine = make_engine(engine_name, policy, tokenizer)
    results = engine.generate(to_requests(rows), sampling_params(cfg))
    if hasattr(engine, "close"):
        engine.close()
    scored = [{**row, **result_fields(r)} for row, r in zip(rows, results, strict=True)]
    trainer = load_causal_lm(policy, dtype="bfloat16")
    kwargs = dict(pad_token_id=tokenizer.pad_token_id, temperature=cfg.rollout.temperature)
    kwargs["padding_free"] = False
    out: dict[str, float] = {}
    for name, batch in (
        ("native", [{k: v for k, v in r.items() if k != F.ROUTED_EXPERTS} for r in scored]),
        ("replay", scored),
    ):
        gaps, agreed, compared = [], 0, 0
        for lo in range(0, len(batch), 64):
            chunk = batch[lo : lo + 64]
            with moe.recording(trainer) as record:
                logprobs = detached_logprobs(trainer, chunk, **kwargs)
            gaps += [
                np.abs(lp - r[F.ROLLOUT_LOGPROBS]) for r, lp in zip(chunk, logprobs, strict=True)
            ]
            if name == "native":  # the trainer's own choices against the engine's
                agreed, compared = _agreement(record, scored[lo : lo + 64], agreed, compared)
        gap = np.concatenate(gaps)
        out[f"{name}_mean"], out[f"{name}_max"] = float(gap.mean()), float(gap.max())
        if name == "native":
            out["flipped"] = 1.0 - agreed / max(compared, 1)
    out["tokens"] = float(len(gap))
    return out


def _agreement(record, rows, agreed: int, compared: int) -> tuple[int, int]:
    """Add the (token, layer) routing decisions of `rows` where the trainer's own experts equal
    the engine's (as sets) to `agreed`, and all of them to `compared`."""
    import torch

    from streamrl.api import fields as F

    valid = record.valid_tokens()
    for layer, per_call in enumerate(record.experts):
        used = torch.cat(per_call)[valid].sort(-1).values
        offset = 0
        for r in rows:
            routes = torch.from_numpy(r[F.ROUTED_EXPERTS][:, layer].astype("int64"))
            n = len(routes)
            agreed += int((used[offset : offset + n] == routes.sort(-1).values).all(-1).sum())
            compared += n
            offset += n + 1  # the last token's position ran nowhere in the engine
    return agreed, compared


def seconds_per_step(replay: str, steps: int, out: Path, overrides: list[str]) -> float:
    cmd, env = train_command(
        out,
        [
            str(EXAMPLE),
            "model.dtype=bfloat16",
            f"algorithm.routing_replay={replay}",
            f"trainer.steps={steps}",
            "trainer.eval_every=0",
            *overrides,
        ],
    )
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)  # noqa: S603
    summary = json.loads((out / "summary.json").read_text())
    return summary["rl_wall_time_s"] / steps


def report(engine: str, m: dict[str, float]) -> None:
    print(f"{engine}: bf16 engine vs trainer over {int(m['tokens'])} response tokens")
    for name, label in (("native", "without replay"), ("replay", "with replay   ")):
        print(
            f"  {label}: mean |delta log-prob| {m[name + '_mean']:.3g}  max {m[name + '_max']:.3g}"
        )
    print(f"  routing decisions that flip without replay: {m['flipped']:.4f}")
    print(f"{engine}: mean reduction {1 - m['replay_mean'] / m['native_mean']:.3f}")
    print(f"{engine}: max reduction {1 - m['replay_max'] / m['native_max']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--engines", default="builtin,vllm", help="engines of the mismatch part")
    parser.add_argument(
        "--random", action="store_true", help="a random-weight tiny MoE instead of the warm start"
    )
    parser.add_argument(
        "--attention",
        choices=("fused", "math"),
        default="fused",
        help="math: in-process attention through PyTorch's math path (fp32 inside)",
    )
    parser.add_argument("--pairs", type=int, default=2, help="0: no overhead runs")
    parser.add_argument("--steps", type=int, default=8, help="steps of each overhead run")
    parser.add_argument(
        "overrides",
        nargs="*",
        help="config overrides of the example (key=value), e.g. model.num_experts=32",
    )
    args = parser.parse_args()

    from torch.nn.attention import SDPBackend, sdpa_kernel

    fp32 = args.attention == "math"
    with sdpa_kernel([SDPBackend.MATH]) if fp32 else contextlib.nullcontext():
        for engine in filter(None, args.engines.split(",")):
            report(
                engine,
                mismatch(
                    args.samples, engine, random_weights=args.random, overrides=args.overrides
                ),
            )
    if not args.pairs:
        return
    ratios = []
    with tempfile.TemporaryDirectory(prefix="routing-replay-") as tmp:
        for k in range(args.pairs):
            off = seconds_per_step("off", args.steps, Path(tmp) / f"off-{k}", args.overrides)
            on = seconds_per_step("rollout", args.steps, Path(tmp) / f"on-{k}", args.overrides)
            ratios.append((on - off) / off)
            print(f"pair {k}: s/step off {off:.3f}  on {on:.3f}  ({ratios[-1]:+.3f})", flush=True)
    print(f"overhead {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
