"""streamrl against TRL's `GRPOTrainer` on the same work, side by side: seconds per step,
completion tokens per second and held-out accuracy after the same number of steps.

The systems train the same policy on the same prompts, one after the other in child processes
(each gets the machine to itself and its own torch threads: TRL and streamrl's synchronous loop
use every core, as a user would run them; async mode gives each role process one thread):

- `trl`: TRL 1.13 `GRPOTrainer` on CPU, generation with `model.generate` (no vLLM);
- `sync`: `streamrl train runtime.mode=sync` (generate, score, train in turn, in one process);
- `async`: `streamrl train` as shipped (every role its own Ray process, max_staleness=1);
- `async-threads`: the same asynchronous job in `runtime.mode=threads` (every role a thread of
  one process: no Ray calls between the roles; the mode docs/architecture.md suggests for small
  models on a few cores). Not in the default `--systems`;
- `async-noskip`: the async run with `algorithm.skip_zero_advantage=false`. streamrl by
  default skips the forward and backward of samples whose advantage is 0 (groups whose rewards
  are all equal: the gradient is the same without them); TRL computes them. This run shows
  how much of the difference is that shortcut and how much is the rest of the system.

What is held equal, and how:

- model: the same Hugging Face directory, streamrl's warm-started built-in model, found (or
  built once and cached in .cache/streamrl) with `streamrl.trainer.sft.ensure_policy_dir`. Two
  sizes: `tiny` (the demo's 0.8 M-parameter Qwen3) and `large` (the same builder with
  `model.hidden_size`, `model.num_layers`, `model.num_heads` raised: 19 M parameters by default),
  warm-started by the same code with fewer, smaller warm-start steps (`--large-warm-steps`,
  `--large-warm-batch`: 200 steps of 32 instead of 800 of 64) so that building it takes minutes,
  not hours, on two cores (about 6 minutes once, then cached); it starts RL at the same
  held-out accuracy as the tiny one (0.285 vs 0.281);
- prompts: streamrl's feeder order of the built-in training set. TRL gets, for step k, exactly the
  prompts streamrl trains at step k (`shuffle_dataset=False`), as the chat-templated text that the
  tokenizer turns back into the very token ids streamrl's engine receives (checked);
- reward: streamrl's `arith_exact_match`, wrapped for TRL's `reward_funcs` signature; an
  unscorable answer gets `reward.invalid_output_penalty` (0.0) on both sides;
- algorithm: GRPO with group-std advantages (unbiased std + 1e-4 on both), PPO clip 0.2, one
  optimizer step per generated batch, loss averaged over every completion token of the step
  (streamrl `loss_agg=token_mean`; TRL `loss_type="dapo"` with the whole step in one micro-batch,
  `steps_per_generation=1`, `gradient_accumulation_steps=1`, where dapo is exactly that mean, see
  tests/unit/test_trl_crosscheck.py), KL off (beta=0), gradient clip 1.0, AdamW betas
  (0.9, 0.99) without weight decay, constant learning rate (streamrl's default cosine decay is
  switched off; TRL gets `lr_scheduler_type="constant"` and no warm-up): 3e-4, streamrl's
  default, on the tiny model, 1e-4 on the large one (`--tiny-lr`, `--large-lr`);
- sampling: group size, prompts per step, max new tokens, temperature (pure temperature sampling:
  top-k 0, top-p 1), number of steps.

Not equal, by design of each system: streamrl's async run trains on samples up to one policy
version old (truncated importance sampling corrects them); TRL is strictly on-policy. streamrl
scores in a sandboxed worker process; TRL calls the reward in-process.

OpenMP: every child runs with `OMP_WAIT_POLICY=PASSIVE` unless `--omp-spin`. On a machine shared
with other jobs, OpenMP's default spin-waiting makes a two-thread torch process 4-30x slower
(measured here: 4 forward/backward passes of the tiny model, 0.6-2.2 s on one thread, 7-17 s on
two; with PASSIVE 0.6-0.9 s on either). That would penalise TRL and the sync loop (two threads)
and not the async roles (one thread each); on an idle machine the setting changes little.

Figures (the first `--warmup-steps` steps of every run are left out; `--rounds N` runs every
system N times, each round starting with the next system, and pools the remaining steps):

- s/step: median step time. streamrl: the trainer's `time/step_s` from metrics.jsonl (sync:
  generate + score + train + weight update of the step; async: time between two consecutive
  optimizer steps). Evaluation is kept out of the steps (`trainer.eval_every=0`: accuracy is
  measured before the first and after the last step). TRL: the time between consecutive
  `on_step_end` callbacks (generation, reward, loss, optimizer step).
- tokens/s: completion tokens (up to and including EOS) of those steps / their summed time.
- zero-adv: share of samples whose group's rewards were all equal (advantage 0).
- accuracy: greedy held-out accuracy on streamrl's held-out split (`data.num_eval` problems whose
  operand pairs never occur in training), by streamrl's own evaluator: for TRL,
  `streamrl.trainer.evaluate.Evaluator` over the model object TRL trained, before and after.

The last line gives, per model size, the median s/step of TRL over that of streamrl's async run:
"TRL time / streamrl async time = X.XX (tiny), Y.YY (large)" (> 1: streamrl is faster).

    python benchmarks/vs_trl.py [--models tiny large]
        [--systems trl sync async async-threads async-noskip]
        [--tiny-steps 30] [--large-steps 8] [--warmup-steps 3] [--rounds 1] ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common import train_command

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = ("trl", "sync", "async", "async-threads", "async-noskip")
STREAMRL_SYSTEMS = {  # system -> its overrides on top of the workload's
    "sync": ["runtime.mode=sync"],
    "async": ["runtime.mode=ray"],
    "async-threads": ["runtime.mode=threads"],
    "async-noskip": ["runtime.mode=ray", "algorithm.skip_zero_advantage=false"],
}


@dataclass
class Workload:
    """One model size and the RL job every system runs on it."""

    name: str
    steps: int
    batch_prompts: int
    lr: float
    model: dict[str, int] = field(default_factory=dict)  # model.* overrides ({}: the demo's)
    warm_start_steps: int | None = None  # None: streamrl's default
    warm_start_batch: int | None = None
    group_size: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    seed: int = 0

    def overrides(self) -> list[str]:
        """streamrl config overrides shared by every system (TRL's worker reads them too)."""
        out = [f"model.{key}={value}" for key, value in self.model.items()]
        if self.warm_start_steps is not None:
            out.append(f"warm_start.steps={self.warm_start_steps}")
        if self.warm_start_batch is not None:
            out.append(f"warm_start.batch_size={self.warm_start_batch}")
        return out + [
            f"rollout.batch_prompts={self.batch_prompts}",
            f"rollout.group_size={self.group_size}",
            f"rollout.max_new_tokens={self.max_new_tokens}",
            f"rollout.temperature={self.temperature}",
            f"algorithm.lr={self.lr}",
            "algorithm.lr_schedule=constant",
            "algorithm.kl.coef=0",
            f"trainer.steps={self.steps}",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=0",
            f"run.seed={self.seed}",
        ]


# -- streamrl ------------------------------------------------------------------------------------


def run_streamrl(work: Workload, system: str, run_dir: Path) -> dict[str, Any]:
    """One `streamrl train` run; per-step figures from its metrics.jsonl."""
    cmd, env = train_command(run_dir, [*work.overrides(), *STREAMRL_SYSTEMS[system]])
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = [r for r in records if "response/tokens" in r]  # not the initial evaluation
    return {
        "step_s": [r["time/step_s"] for r in steps],
        "tokens": [r["response/tokens"] for r in steps],
        "zero_adv": [r["samples/zero_advantage_frac"] for r in steps],
        "acc_before": summary["initial_eval_accuracy"],
        "acc_after": summary["final_eval_accuracy"],
    }


# -- TRL (runs in a child process: `vs_trl.py --trl-worker SPEC OUT`) -----------------------------


def run_trl(work: Workload, run_dir: Path) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    spec, out = run_dir / "spec.json", run_dir / "result.json"
    spec.write_text(json.dumps(asdict(work)))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(spec), str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def trl_worker(spec_path: Path, out_path: Path) -> None:
    """Train with TRL's GRPOTrainer on the workload in `spec_path`; write the figures."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach a hub
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from streamrl.api import fields as F
    from streamrl.config import load_config
    from streamrl.data.role import make_feeder
    from streamrl.models.loading import load_causal_lm, load_tokenizer
    from streamrl.reward.scoring import resolve_callable, score_text
    from streamrl.runtime.context import prepare
    from streamrl.trainer.evaluate import Evaluator
    from streamrl.trainer.sft import ensure_policy_dir

    work = Workload(**json.loads(spec_path.read_text()))
    cfg = load_config(work.overrides())
    policy_dir = ensure_policy_dir(cfg)
    ctx = prepare(cfg, policy_dir, out_path.parent)
    tokenizer = load_tokenizer(policy_dir)

    # Step k's prompts, in streamrl's feeder order, as text that re-encodes to the same ids.
    feeder = make_feeder(ctx)
    rows = []
    for step in range(work.steps):
        for sample in feeder.batch(step)[:: work.group_size]:  # one row per group
            ids = [int(i) for i in sample["fields"][F.PROMPT_IDS]]
            text = tokenizer.decode(ids, skip_special_tokens=False)
            if tokenizer(text)["input_ids"] != ids:
                raise RuntimeError(f"prompt {text!r} does not re-encode to streamrl's ids {ids}")
            rows.append({"prompt": text, "answer": sample["fields"][F.ANSWER]})

    reward_fn = resolve_callable(cfg.reward.function)
    penalty = cfg.reward.invalid_output_penalty
    tokens: list[int] = []
    zero_adv: list[float] = []

    def arith_reward(completions, answer, completion_ids, **_):
        """streamrl's reward rule in TRL's reward_funcs signature (called once per step)."""
        rewards = []
        for text, ans in zip(completions, answer, strict=True):
            result = score_text(reward_fn, text, _Row(ans))
            rewards.append(result.value if result.status == "ok" else penalty)
        # TRL lays a step's completions out group by group (each prompt's G in a row).
        groups = [rewards[i : i + work.group_size] for i in range(0, len(rewards), work.group_size)]
        tokens.append(sum(len(ids) for ids in completion_ids))
        zero_adv.append(sum(len(g) for g in groups if len(set(g)) == 1) / len(rewards))
        return rewards

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append(time.perf_counter())

    args = GRPOConfig(
        output_dir=str(out_path.parent / "trl_out"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        seed=work.seed,
        # One generation of all the step's completions, one micro-batch, one optimizer step.
        per_device_train_batch_size=work.batch_prompts * work.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=work.group_size,
        num_iterations=1,
        shuffle_dataset=False,
        max_steps=work.steps,
        max_completion_length=work.max_new_tokens,
        temperature=work.temperature,
        top_k=0,
        top_p=1.0,
        learning_rate=work.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=cfg.algorithm.grad_clip,
        beta=0.0,
        epsilon=cfg.algorithm.loss.clip_eps_low,
        epsilon_high=cfg.algorithm.loss.clip_eps_high,
        loss_type="dapo",
        scale_rewards="group",
        use_vllm=False,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = load_causal_lm(policy_dir)
    accuracy_before = Evaluator(ctx, model).accuracy()  # the same figure as streamrl's first eval
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arith_reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    result = {
        "step_s": [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)],
        "tokens": tokens,
        "zero_adv": zero_adv,
        "acc_before": accuracy_before,
        "acc_after": Evaluator(ctx, trainer.model).accuracy(),
    }
    out_path.write_text(json.dumps(result))


@dataclass(frozen=True)
class _Row:
    """What `score_text` reads of a dataset row."""

    answer: str
    extra: dict[str, Any] = field(default_factory=dict)


# -- the comparison ------------------------------------------------------------------------------


@dataclass
class Figures:
    """A system's figures on one workload, pooled over rounds (warm-up steps left out)."""

    step_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    zero_adv: list[float] = field(default_factory=list)
    acc_before: list[float] = field(default_factory=list)
    acc_after: list[float] = field(default_factory=list)

    def add(self, run: dict[str, Any], warmup: int) -> None:
        if len(run["step_s"]) <= warmup:
            raise ValueError(f"no step left after {warmup} warm-up steps; run more steps")
        self.step_s += run["step_s"][warmup:]
        self.tokens += run["tokens"][warmup:]
        self.zero_adv += run["zero_adv"][warmup:]
        self.acc_before.append(run["acc_before"])
        self.acc_after.append(run["acc_after"])

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)


def prepare_policy(work: Workload) -> int:
    """Find or build the workload's warm-started policy (outside every timing); its size."""
    from streamrl.config import load_config
    from streamrl.trainer.sft import ensure_policy_dir

    started = time.perf_counter()
    policy_dir = ensure_policy_dir(load_config(work.overrides()))
    params = num_parameters(policy_dir)
    print(
        f"[{work.name}] policy {policy_dir} ({params / 1e6:.1f} M parameters, "
        f"{time.perf_counter() - started:.0f} s to find or build)",
        flush=True,
    )
    return params


def num_parameters(policy_dir: Path) -> int:
    from streamrl.models.loading import load_causal_lm

    return sum(p.numel() for p in load_causal_lm(policy_dir).parameters())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=("tiny", "large"), default=["tiny", "large"])
    default_systems = [s for s in SYSTEMS if s != "async-threads"]
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=default_systems)
    add_workload_args(p)
    p.add_argument("--trl-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args()


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload and timing options every side-by-side benchmark shares (`workloads`)."""
    p.add_argument("--rounds", type=int, default=1, help="runs per system, in rotating order")
    p.add_argument("--warmup-steps", type=int, default=3, help="first steps of a run left out")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed of every system (run.seed)")
    p.add_argument("--tiny-steps", type=int, default=30)
    p.add_argument("--tiny-batch-prompts", type=int, default=32)
    p.add_argument("--tiny-lr", type=float, default=3e-4, help="streamrl's default lr")
    p.add_argument("--large-steps", type=int, default=8)
    p.add_argument("--large-batch-prompts", type=int, default=8)
    p.add_argument("--large-lr", type=float, default=1e-4)
    p.add_argument("--large-hidden", type=int, default=512)
    p.add_argument("--large-layers", type=int, default=6)
    p.add_argument("--large-heads", type=int, default=8)
    p.add_argument(
        "--large-warm-steps",
        type=int,
        default=200,
        help="warm-start steps of the large model (built once, then cached)",
    )
    p.add_argument("--large-warm-batch", type=int, default=32)
    p.add_argument(
        "--omp-spin",
        action="store_true",
        help="keep OpenMP's default spin-waiting instead of OMP_WAIT_POLICY=PASSIVE (see above)",
    )


def workloads(a: argparse.Namespace) -> list[Workload]:
    common = {
        "group_size": a.group_size,
        "max_new_tokens": a.max_new_tokens,
        "temperature": a.temperature,
        "seed": a.seed,
    }
    sizes = {
        "tiny": Workload("tiny", a.tiny_steps, a.tiny_batch_prompts, a.tiny_lr, **common),
        "large": Workload(
            "large",
            a.large_steps,
            a.large_batch_prompts,
            a.large_lr,
            model={
                "hidden_size": a.large_hidden,
                "num_layers": a.large_layers,
                "num_heads": a.large_heads,
            },
            warm_start_steps=a.large_warm_steps,
            warm_start_batch=a.large_warm_batch,
            **common,
        ),
    }
    return [sizes[name] for name in a.models]


def main() -> None:
    a = parse_args()
    if a.trl_worker:
        trl_worker(Path(a.trl_worker[0]), Path(a.trl_worker[1]))
        return
    if not a.omp_spin:  # before torch loads here; every child process inherits it
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

    print(f"machine: {os.cpu_count()} CPUs, {platform.machine()}, {load_average()}", flush=True)
    table: list[tuple[Workload, int, dict[str, Figures]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for work in workloads(a):
            params = prepare_policy(work)
            figures = {system: Figures() for system in a.systems}
            for round_ in range(a.rounds):
                shift = round_ % len(a.systems)  # each round starts with the next system
                for system in a.systems[shift:] + a.systems[:shift]:
                    started = time.perf_counter()
                    run_dir = Path(tmp) / f"{work.name}-{system}-{round_}"
                    if system == "trl":
                        run = run_trl(work, run_dir)
                    else:
                        run = run_streamrl(work, system, run_dir)
                    figures[system].add(run, a.warmup_steps)
                    median_s = statistics.median(run["step_s"][a.warmup_steps :])
                    print(
                        f"[{work.name}] round {round_ + 1} {system}: {median_s:.2f} s/step, "
                        f"run {time.perf_counter() - started:.0f} s, {load_average()}",
                        flush=True,
                    )
            table.append((work, params, figures))
    print_table(table)


def load_average() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def print_table(
    table: list[tuple[Workload, int, dict[str, Figures]]],
    baseline: str = "trl",
    label: str = "TRL",
    note: Callable[[Workload], None] | None = None,
) -> None:
    """The figures of every system per workload, then `label`'s time over streamrl's (the
    ratio against async last). `note(work)` may print more about the baseline's run."""
    print(
        f"\n{'model':6} {'params':>6} {'compl/step':>10} {'steps':>5} {'system':13}"
        f" {'s/step':>7} {'tokens/s':>8} {'zero-adv':>8} {'acc before':>10} {'acc after':>9}"
    )
    ratios: list[str] = []
    for work, params, figures in table:
        for system, f in figures.items():
            print(
                f"{work.name:6} {params / 1e6:5.1f}M {work.batch_prompts * work.group_size:10d}"
                f" {work.steps:5d} {system:13} {f.median_step_s:7.2f}"
                f" {sum(f.tokens) / sum(f.step_s):8.0f} {statistics.mean(f.zero_adv):8.2f}"
                f" {statistics.mean(f.acc_before):10.3f} {statistics.mean(f.acc_after):9.3f}"
            )
        if baseline not in figures:
            continue
        if note is not None:
            note(work)
        for system in ("sync", "async-threads", "async-noskip"):
            if system in figures:
                ratio = figures[baseline].median_step_s / figures[system].median_step_s
                print(f"{work.name}: {label} time / streamrl {system} time = {ratio:.2f}")
        if "async" in figures:
            ratio = figures[baseline].median_step_s / figures["async"].median_step_s
            ratios.append(f"{ratio:.2f} ({work.name})")
    if ratios:
        print(f"{label} time / streamrl async time = {', '.join(ratios)}")


if __name__ == "__main__":
    main()
