"""streamrl against ms-swift's GRPO on the same work, side by side: seconds per step, completion
tokens per second and held-out accuracy after the same number of steps.

The companion of benchmarks/vs_trl.py, which it imports: the same workloads (model sizes, task,
reward, group size, prompts per step, max new tokens, temperature, learning rate, steps, seed),
the same streamrl runs (`run_streamrl`: `sync`, `async`, `async-noskip`) and the same figures.
Only the peer differs:

- `swift`: ms-swift 4.6 `swift rlhf --rlhf_type grpo --use_vllm false` on CPU (generation with
  ms-swift's transformers engine, i.e. `model.generate`), run as a subprocess in ms-swift's own
  virtual environment (`.venv-swift`, `make install-swift`: ms-swift pins trl<1.0, which the
  streamrl environment's TRL 1.13 cannot share).

What is held equal, and how (as in vs_trl.py unless said):

- model: the same Hugging Face directory (`ensure_policy_dir`), loaded by ms-swift as a `qwen3`
  model in float32, full-parameter training (`--tuner_type full`), no gradient checkpointing;
- prompts: for step k, exactly the prompts streamrl trains at step k (streamrl's feeder order;
  `--dataset_shuffle false --train_dataloader_shuffle false`). ms-swift formats prompts with a
  template; benchmarks/swift_plugin.py registers one made of the policy's own chat template, and
  checks when training starts that ms-swift encodes every prompt to the ids streamrl's engine
  receives;
- reward: streamrl's reward function itself, called from an ms-swift ORM plugin
  (benchmarks/swift_plugin.py), on the response ids decoded as streamrl's reward role decodes
  them; an unscorable answer gets `reward.invalid_output_penalty` (0.0) on both sides;
- algorithm: GRPO, group-std advantages (ms-swift: unbiased std + 1e-4, as streamrl), PPO clip
  0.2 both sides (`--epsilon`, `--epsilon_high`), one optimizer step per generated batch
  (`--steps_per_generation 1 --num_iterations 1`, the whole step in one micro-batch), loss
  averaged over every completion token of the step (`--loss_type dapo`: the sum over the step's
  tokens divided by their number), KL off (`--beta 0`, no reference model), gradient clip 1.0,
  AdamW (0.9, 0.99) without weight decay, constant learning rate without warm-up;
- sampling: group size, prompts per step, max new tokens, temperature, top-p 1, number of steps,
  seed 0, and no top-k filtering. ms-swift cannot say "no top-k" to its transformers engine:
  it turns `--top_k -1` (or 0) into None, and `generate` then applies transformers' default
  top-k of 50 (checked: a `TopKLogitsWarper(50)` is built). So the run passes `--top_k` equal to
  the vocabulary size, which keeps every token (a top-k over all of them removes nothing).

Not equal, by design of each system (no ms-swift setting changes these):

- streamrl's async run trains on samples up to one policy version old; ms-swift is strictly
  on-policy (its `--async_generate` needs a vLLM server started by `swift rollout`);
- ms-swift always runs an extra no-grad forward pass for the old policy's log-probs, even with
  one optimizer step per generation where they equal the current ones (TRL skips it; streamrl
  takes the engine's log-probs), and encodes every prompt + completion again through its Python
  template before the loss;
- streamrl skips the forward and backward of zero-advantage samples (`async-noskip` turns that
  off, see vs_trl.py); ms-swift computes them;
- streamrl scores in a sandboxed worker process; ms-swift calls the reward in-process;
- ms-swift logs its metrics every step (`--logging_steps 1`, for its `step_time`): one JSON
  line per step, inside its step clock.

OpenMP: every child runs with `OMP_WAIT_POLICY=PASSIVE` unless `--omp-spin` (see vs_trl.py).

Figures (the first `--warmup-steps` steps of every run left out; `--rounds` as in vs_trl.py):

- s/step: median step time. streamrl: as in vs_trl.py. ms-swift: the time between consecutive
  `on_step_end` callbacks (generation, reward, old log-probs, loss, optimizer step), from the
  plugin's clock. Printed next to it as a cross-check: ms-swift's own `step_time` from its
  logging.jsonl (median, same steps), which times `training_step` (generation, reward, loss,
  backward) but not the gradient clip, the optimizer step or the callbacks.
- tokens/s, zero-adv: as in vs_trl.py (ms-swift: counted by the reward plugin).
- accuracy: streamrl's greedy held-out evaluator (`streamrl.trainer.evaluate.Evaluator`) over
  the policy before training and over the model ms-swift saved after its last step.

The last line gives, per model size, ms-swift's median s/step over that of streamrl's async run:
"ms-swift time / streamrl async time = X.XX (tiny), Y.YY (large)" (> 1: streamrl is faster).

    python benchmarks/vs_swift.py [--models tiny large] [--systems swift sync async async-noskip]
        [--swift-python .venv-swift/bin/python] [--tiny-steps 30] [--large-steps 8] ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from vs_trl import (
    Figures,
    Workload,
    add_workload_args,
    load_average,
    prepare_policy,
    print_table,
    run_streamrl,
    workloads,
)

REPO = Path(__file__).resolve().parents[1]
PLUGIN = Path(__file__).resolve().parent / "swift_plugin.py"
SYSTEMS = ("swift", "sync", "async", "async-noskip")


# -- ms-swift ------------------------------------------------------------------------------------


def swift_dataset(work: Workload, run_dir: Path) -> dict[str, Any]:
    """Write the workload's prompts in step order as an ms-swift dataset; return the plugin's spec."""
    from streamrl.api import fields as F
    from streamrl.config import load_config
    from streamrl.data.prompts import encode_prompt
    from streamrl.data.role import make_feeder
    from streamrl.models.loading import load_tokenizer
    from streamrl.runtime.context import prepare
    from streamrl.trainer.sft import ensure_policy_dir

    cfg = load_config(work.overrides())
    policy_dir = ensure_policy_dir(cfg).resolve()  # ms-swift takes a relative path for a hub id
    tokenizer = load_tokenizer(policy_dir)
    query = "{{QUERY}}"
    prompt_template = tokenizer.apply_chat_template(
        [{"role": "user", "content": query}], add_generation_prompt=True, tokenize=False
    )
    if prompt_template.count(query) != 1:
        raise RuntimeError(f"chat template renders {prompt_template!r}: no single query slot")
    feeder = make_feeder(prepare(cfg, policy_dir, run_dir))
    rows, prompts = [], {}
    for step in range(work.steps):
        for sample in feeder.batch(step)[:: work.group_size]:  # one row per group
            ids = [int(i) for i in sample["fields"][F.PROMPT_IDS]]
            text = tokenizer.decode(ids, skip_special_tokens=True)  # the user message alone
            if encode_prompt(tokenizer, text) != ids:
                raise RuntimeError(f"prompt {text!r} does not re-encode to streamrl's ids {ids}")
            prompts[text] = ids
            rows.append(
                {
                    "messages": [{"role": "user", "content": text}],
                    # not `answer`: ms-swift would take that column for the response
                    "streamrl_answer": sample["fields"][F.ANSWER],
                }
            )
    dataset = run_dir / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {
        "repo": str(REPO),
        "model_dir": str(policy_dir),
        "dataset": str(dataset),
        "prompt_template": prompt_template,
        "prompts": sorted(prompts.items()),
        "reward_function": cfg.reward.function,
        "invalid_output_penalty": cfg.reward.invalid_output_penalty,
        "group_size": work.group_size,
        "vocab_size": json.loads((policy_dir / "config.json").read_text())["vocab_size"],
        "grad_clip": cfg.algorithm.grad_clip,
        "clip_eps_low": cfg.algorithm.loss.clip_eps_low,
        "clip_eps_high": cfg.algorithm.loss.clip_eps_high,
        "steps_out": str(run_dir / "swift_steps.jsonl"),
        "clock_out": str(run_dir / "swift_clock.json"),
    }


def swift_command(work: Workload, spec: dict[str, Any], swift_python: Path, out: Path) -> list[str]:
    """`swift rlhf` with every setting vs_trl.py gives TRL, in ms-swift's spelling."""
    args = {
        "rlhf_type": "grpo",
        "use_vllm": "false",
        "model": spec["model_dir"],
        "model_type": "qwen3",
        "template": "streamrl_chat",
        "torch_dtype": "float32",
        "tuner_type": "full",
        "gradient_checkpointing": "false",
        "external_plugins": str(PLUGIN),
        "reward_funcs": "streamrl_reward",
        "callbacks": "streamrl_step_clock",
        "dataset": spec["dataset"],
        "dataset_shuffle": "false",
        "train_dataloader_shuffle": "false",
        "split_dataset_ratio": "0",
        "dataset_num_proc": "1",
        "dataloader_num_workers": "0",
        "seed": str(work.seed),
        "data_seed": str(work.seed),
        # One generation of all the step's completions, one micro-batch, one optimizer step.
        "per_device_train_batch_size": str(work.batch_prompts * work.group_size),
        "gradient_accumulation_steps": "1",
        "steps_per_generation": "1",
        "num_generations": str(work.group_size),
        "num_iterations": "1",
        "max_steps": str(work.steps),
        "max_completion_length": str(work.max_new_tokens),
        "temperature": str(work.temperature),
        "top_k": str(spec["vocab_size"]),  # not -1: see the module docstring
        "top_p": "1.0",
        "learning_rate": str(work.lr),
        "lr_scheduler_type": "constant",
        "warmup_ratio": "0",
        "warmup_steps": "0",
        "optim": "adamw_torch",
        "adam_beta1": "0.9",
        "adam_beta2": "0.99",
        "weight_decay": "0",
        "max_grad_norm": str(spec["grad_clip"]),
        "beta": "0",
        "epsilon": str(spec["clip_eps_low"]),
        "epsilon_high": str(spec["clip_eps_high"]),
        "loss_type": "dapo",
        "scale_rewards": "group",
        "eval_strategy": "no",
        "report_to": "none",
        "logging_steps": "1",
        "save_strategy": "steps",
        "save_steps": str(work.steps),
        "save_only_model": "true",
        "add_version": "false",
        "output_dir": str(out),
        "disable_tqdm": "true",
        "check_model": "false",  # else it asks the ModelScope hub whether the model is current
    }
    swift = swift_python.parent / "swift"
    return [str(swift), "rlhf", *(x for key, value in args.items() for x in (f"--{key}", value))]


def run_swift(work: Workload, run_dir: Path, swift_python: Path) -> dict[str, Any]:
    """One `swift rlhf` run; step times from the plugin's clock, accuracy by streamrl's evaluator."""
    from streamrl.config import load_config
    from streamrl.models.loading import load_causal_lm
    from streamrl.runtime.context import prepare
    from streamrl.trainer.evaluate import Evaluator

    run_dir.mkdir(parents=True, exist_ok=True)
    spec = swift_dataset(work, run_dir)
    spec_path = run_dir / "swift_spec.json"
    spec_path.write_text(json.dumps(spec))
    out = run_dir / "swift_out"
    env = {**os.environ, "STREAMRL_SWIFT_SPEC": str(spec_path), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the plugin adds this repository itself; nothing else leaks in
    log = run_dir / "swift.log"
    with log.open("w") as f:
        done = subprocess.run(
            swift_command(work, spec, swift_python, out), cwd=run_dir, env=env, stdout=f, stderr=f
        )
    if done.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise RuntimeError(f"swift rlhf failed (exit {done.returncode}); end of {log}:\n{tail}")
    clock = json.loads(Path(spec["clock_out"]).read_text())
    marks = clock["marks"]
    steps = [json.loads(line) for line in Path(spec["steps_out"]).read_text().splitlines()]
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    own_step_s = [r["step_time"] for r in logs if "step_time" in r]
    if not len(steps) == len(own_step_s) == len(marks) - 1 == work.steps:
        raise RuntimeError(
            f"expected {work.steps} steps, got {len(steps)} rewards, {len(marks) - 1} clock "
            f"marks, {len(own_step_s)} logged steps: see {log}"
        )
    if clock["num_prompts_checked"] != len(spec["prompts"]):
        raise RuntimeError("the plugin did not check every prompt's encoding")

    ctx = prepare(load_config(work.overrides()), Path(spec["model_dir"]), run_dir)
    model = load_causal_lm(out / f"checkpoint-{work.steps}")
    return {
        "step_s": [b - a for a, b in zip(marks, marks[1:], strict=False)],
        "tokens": [s["tokens"] for s in steps],
        "zero_adv": [s["zero_adv"] for s in steps],
        "acc_before": Evaluator(ctx, load_causal_lm(ctx.policy_dir)).accuracy(),
        "acc_after": Evaluator(ctx, model).accuracy(),
        "swift_own_step_s": own_step_s,
    }


# -- the comparison ------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=("tiny", "large"), default=["tiny", "large"])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument(
        "--swift-python",
        type=Path,
        default=REPO / ".venv-swift" / "bin" / "python",
        help="python of ms-swift's virtual environment (make install-swift)",
    )
    p.add_argument(
        "--work-dir", type=Path, help="keep every run's files here (default: a temporary folder)"
    )
    add_workload_args(p)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    # The runs start in their own folders: a relative path (`make bench-swift` passes one) would
    # not be found there. Absolute, not resolved: the venv's python is a symlink out of the venv.
    a.swift_python = a.swift_python.absolute()
    if "swift" in a.systems and not a.swift_python.exists():
        raise SystemExit(f"{a.swift_python} not found: run `make install-swift` first")
    if not a.omp_spin:  # before torch loads here; every child process inherits it
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local; never reach a hub

    print(f"machine: {os.cpu_count()} CPUs, {platform.machine()}, {load_average()}", flush=True)
    table: list[tuple[Workload, int, dict[str, Figures]]] = []
    own_step_s: dict[str, list[float]] = {}  # ms-swift's own step_time per workload
    with tempfile.TemporaryDirectory() as tmp:
        if a.work_dir is not None:  # kept: ms-swift's logs, dataset, spec and saved model
            tmp = str(a.work_dir.resolve())
        for work in workloads(a):
            params = prepare_policy(work)
            figures = {system: Figures() for system in a.systems}
            swift_own_step_s: list[float] = []  # ms-swift's own step_time, warm-up left out
            for round_ in range(a.rounds):
                shift = round_ % len(a.systems)  # each round starts with the next system
                for system in a.systems[shift:] + a.systems[:shift]:
                    started = time.perf_counter()
                    run_dir = Path(tmp) / f"{work.name}-{system}-{round_}"
                    extra = ""
                    if system == "swift":
                        run = run_swift(work, run_dir, a.swift_python)
                        own = run["swift_own_step_s"][a.warmup_steps :]
                        swift_own_step_s += own
                        extra = f" (its own step_time {statistics.median(own):.2f})"
                    else:
                        run = run_streamrl(work, system, run_dir)
                    figures[system].add(run, a.warmup_steps)
                    median_s = statistics.median(run["step_s"][a.warmup_steps :])
                    print(
                        f"[{work.name}] round {round_ + 1} {system}: {median_s:.2f} s/step{extra}, "
                        f"acc {run['acc_before']:.3f} -> {run['acc_after']:.3f}, "
                        f"run {time.perf_counter() - started:.0f} s, {load_average()}",
                        flush=True,
                    )
            table.append((work, params, figures))
            own_step_s[work.name] = swift_own_step_s

    def note(work: Workload) -> None:
        print(
            f"{work.name}: ms-swift's own step_time (training_step only: no optimizer step) "
            f"= {statistics.median(own_step_s[work.name]):.2f} s"
        )

    print_table(table, "swift", "ms-swift", note)


if __name__ == "__main__":
    main()
