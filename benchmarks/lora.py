"""LoRA against full fine-tuning on the 19 M-parameter model (hidden 512, 6 layers), side by side.

Two parts, each run for both variants in one invocation:

1. **Trainer alone** (`--trainer-only`, one fresh process per variant, so each peak is its own):
   the trainer built as a run builds it (`trainer.role.make_learner`) on the 19 M model (not
   warm-started: the weights' values do not change a step's cost) trains `--trainer-steps`
   steps of one batch shaped like the job's (`--batch-prompts` x 8 samples, 12 prompt and 24
   response tokens, advantages +-1, every sample computed), each followed by `named_weights()`
   (what a step publishes; LoRA merges here). Printed: trainable parameters, wall and CPU
   seconds per step (CPU: `time.process_time`, this process's threads together), the bytes the
   trainer keeps between steps (weights and AdamW state; gradients are freed after each
   update), the process's peak RSS (`metrics.memory.process_peak_bytes`) and its growth over
   the RSS after loading the model (what training added: gradients, AdamW state, activations).
2. **The default task** (`streamrl train`, threads mode): held-out accuracy before and after
   `--steps` steps, seconds per step of the RL phase, the trainer's busy seconds per step and
   the run's peak memory (all roles: one process).

    python benchmarks/lora.py [--steps 20] [--trainer-steps 3] [--only full,lora] [overrides]

The 19 M model is warm-started once with 200 steps of 32 examples (cached; as
benchmarks/vs_trl.py does). Full fine-tuning uses lr 1e-4 (vs_trl's for this model); LoRA
rank 32, alpha 64 on every linear layer of the decoder with lr 2e-3 (LoRA wants a higher lr;
rank 16 with 1e-3 did not move the accuracy in 8 steps, 5e-3 collapsed it); both warm up the
lr over 5 steps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODEL = [
    "model.hidden_size=512",
    "model.num_layers=6",
    "model.num_heads=8",
    "warm_start.steps=200",
    "warm_start.batch_size=32",
]
VARIANTS = {
    "full": ["algorithm.lr=1e-4", "algorithm.lr_warmup_steps=5"],
    "lora": [
        "trainer.lora.rank=32",
        "trainer.lora.alpha=64",
        "algorithm.lr=2e-3",
        "algorithm.lr_warmup_steps=5",
    ],
}


def trainer_only(variant: str, steps: int, batch_prompts: int, overrides: list[str]) -> dict:
    """Train `steps` steps of one synthetic batch in this process; return the figures."""
    import numpy as np
    import torch

    from streamrl.api.run import RunContext
    from streamrl.config import load_config
    from streamrl.metrics.memory import process_peak_bytes, process_tree_rss
    from streamrl.trainer.lora import num_parameters
    from streamrl.trainer.role import make_learner
    from streamrl.trainer.sft import ensure_policy_dir

    # The weights' values do not change the cost of a step: the model untrained (no warm start).
    cfg = load_config(
        [*MODEL, *VARIANTS[variant], "algorithm.lr_schedule=constant", *overrides]
        + ["warm_start.enabled=false"]
    )
    policy_dir = ensure_policy_dir(cfg)
    with tempfile.TemporaryDirectory() as scratch:
        learner = make_learner(RunContext(cfg, policy_dir, Path(scratch), [], []))
    loaded_rss = process_tree_rss(__import__("os").getpid())
    rng = np.random.default_rng(0)
    rows = [
        {
            "prompt_ids": rng.integers(5, 60, size=12).tolist(),
            "response_ids": rng.integers(5, 60, size=24).tolist(),
            "rollout_logprobs": [-2.0] * 24,
            "advantages": 1.0 if i % 2 else -1.0,
        }
        for i in range(batch_prompts * 8)
    ]
    micro = cfg.algorithm.micro_batch_groups * 8
    times, cpus = [], []
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        for lo in range(0, len(rows), micro):
            learner.accumulate(rows[lo : lo + micro])
        learner.step()
        learner.named_weights()
        times.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    trainable, total = num_parameters(learner.model)
    # What the trainer keeps between steps: weights and AdamW state (and gradients, if kept).
    tensors = [p for p in learner.model.parameters()]
    tensors += [p.grad for p in learner.model.parameters() if p.grad is not None]
    tensors += [t for s in learner.optimizer.state.values() for t in s.values() if t.dim()]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    steady = times[1:] or times  # the first step also allocates gradients and AdamW state
    return {
        "trainable": trainable,
        "total": total,
        "s_per_step": sum(steady) / len(steady),
        "cpu_s_per_step": sum(cpus[1:] or cpus) / len(steady),
        "state_gib": state_bytes / 2**30,
        "peak_gib": process_peak_bytes() / 2**30,
        "added_gib": (process_peak_bytes() - loaded_rss) / 2**30,
        "threads": torch.get_num_threads(),
    }


def learning_run(run_dir: Path, variant: str, steps: int, overrides: list[str]) -> dict:
    args = [
        *MODEL,
        *VARIANTS[variant],
        "runtime.mode=threads",
        f"trainer.steps={steps}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        "run.progress=false",
        "run.log_every=0",
        "run.tensorboard=false",
        f"run.run_dir={run_dir}",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "streamrl.cli", "train", *args]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    trained = [m for m in map(json.loads, filter(None, lines)) if "train/loss" in m]
    summary["trainer_s_per_step"] = sum(m["time/trainer_busy_s"] for m in trained) / len(trained)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="RL steps of each learning run")
    parser.add_argument("--trainer-steps", type=int, default=3, help="steps of the trainer part")
    parser.add_argument("--batch-prompts", type=int, default=16)
    parser.add_argument("--only", default="full,lora")
    parser.add_argument("--skip-learning", action="store_true")
    parser.add_argument("--trainer-only", help=argparse.SUPPRESS)  # the child process's variant
    a, overrides = parser.parse_known_args()
    overrides = [*overrides, f"rollout.batch_prompts={a.batch_prompts}"]
    if a.trainer_only:
        figures = trainer_only(a.trainer_only, a.trainer_steps, a.batch_prompts, overrides)
        print(json.dumps(figures))
        return
    variants = a.only.split(",")
    print(
        f"trainer alone: {a.trainer_steps} steps of {a.batch_prompts} x 8 samples",
        flush=True,
    )
    print(
        f"{'variant':8} {'trainable':>11} {'s/step':>7} {'CPU-s/step':>10} {'state GiB':>9}"
        f" {'peak GiB':>8} {'added GiB':>9}",
        flush=True,
    )
    alone = {}
    for name in variants:
        cmd = [sys.executable, __file__, "--trainer-only", name]
        cmd += [f"--trainer-steps={a.trainer_steps}", f"--batch-prompts={a.batch_prompts}"]
        cmd += overrides[:-1]  # the user's (the last is --batch-prompts' own)
        out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
        f = alone[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{name:8} {f['trainable']:11,d} {f['s_per_step']:7.2f} {f['cpu_s_per_step']:10.2f}"
            f" {f['state_gib']:9.3f} {f['peak_gib']:8.3f} {f['added_gib']:9.3f}",
            flush=True,
        )
    if len(alone) == 2:
        full, lora = alone["full"], alone["lora"]
        print(
            f"lora / full: s/step {lora['s_per_step'] / full['s_per_step']:.2f}, CPU-s/step "
            f"{lora['cpu_s_per_step'] / full['cpu_s_per_step']:.2f}, state "
            f"{lora['state_gib'] / full['state_gib']:.2f}, peak "
            f"{lora['peak_gib'] / full['peak_gib']:.2f}, added "
            f"{lora['added_gib'] / full['added_gib']:.2f}",
            flush=True,
        )
    if a.skip_learning:
        return
    print(f"\nthe default task, threads mode, {a.steps} steps of {a.batch_prompts} prompts x 8")
    print(
        f"{'variant':8} {'acc before':>10} {'acc after':>9} {'s/step':>7} {'trainer s/step':>14}"
        f" {'run peak GiB':>12}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            s = learning_run(Path(tmp) / name, name, a.steps, overrides)
            print(
                f"{name:8} {s['initial_eval_accuracy']:10.3f} {s['final_eval_accuracy']:9.3f}"
                f" {s['rl_wall_time_s'] / s['num_steps']:7.2f} {s['trainer_s_per_step']:14.2f}"
                f" {s['peak_memory_bytes'] / 2**30:12.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
