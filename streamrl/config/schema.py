"""Typed configuration of a streamrl run: pydantic models, every field with a default and a docstring.

`streamrl config show` prints the resolved config; `streamrl.config.loader` reads YAML files and
dotted command-line overrides into these models. Imports no torch or Ray.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, values are checked on assignment."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class ModelConfig(Section):
    path: str | None = None
    """Local Hugging Face model directory. None builds (once, cached) the built-in tiny Qwen3."""
    hidden_size: int = Field(128, ge=16)
    """Built-in tiny model: hidden width (ignored when `path` is set)."""
    num_layers: int = Field(4, ge=1)
    """Built-in tiny model: number of transformer layers."""
    num_heads: int = Field(4, ge=1)
    """Built-in tiny model: attention heads (key/value heads are half of these)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype for training and the builtin engine."""


class WarmStartConfig(Section):
    enabled: bool = True
    """Run a short supervised warm start (cached by its settings) before RL."""
    steps: int = Field(800, ge=0)
    """Optimizer steps of the warm start."""
    batch_size: int = Field(64, ge=1)
    """Examples per warm-start step."""
    lr: float = Field(3e-3, gt=0)
    """Warm-start learning rate (AdamW, cosine decay)."""
    teacher_forget_carry: float = Field(0.7, ge=0, le=1)
    """Fraction of warm-start answers in which the noisy teacher forgets every carry."""


class DataConfig(Section):
    task: Literal["arith"] = "arith"
    """Built-in task (used when `train_file` is not set)."""
    digits: int = Field(2, ge=1, le=6)
    """Built-in task: operands have up to this many digits."""
    train_file: str | None = None
    """JSONL file of {"prompt", "answer"} rows; None uses the built-in task."""
    eval_file: str | None = None
    """JSONL file of held-out rows; None uses the built-in task's held-out split."""
    num_eval: int = Field(256, ge=1)
    """Held-out prompts scored by greedy decoding at each evaluation."""
    seed: int = 0
    """Seed of prompt order and of the built-in task's problems."""


class RolloutConfig(Section):
    engine: Literal["builtin"] = "builtin"
    """Generation engine (vLLM and SGLang arrive with their own issue)."""
    batch_prompts: int = Field(32, ge=1)
    """Prompts per training step (each sampled `group_size` times)."""
    group_size: int = Field(8, ge=2)
    """Samples per prompt (GRPO's G)."""
    max_new_tokens: int = Field(24, ge=1)
    """Longest response, in tokens; longer ones are cut and marked truncated."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (log-probs are taken at this temperature too)."""
    max_staleness: int = Field(1, ge=0)
    """0 = strict on-policy (identical to the synchronous loop); s > 0 lets rollout run s policy
    versions ahead of the trainer."""
    max_batch_size: int = Field(512, ge=1)
    """Most sequences the builtin engine decodes at once."""
    inflight_weight_updates: bool = True
    """Load newer weights between decode steps instead of only between batches."""


class RewardConfig(Section):
    function: str = "streamrl.reward.rule:arith_exact_match"
    """Reward function as `module:function`, called as fn(response_text, answer, **extra)."""
    timeout_s: float = Field(5.0, gt=0)
    """A reward call running longer than this is stopped and the sample dropped (status timeout)."""
    invalid_output_penalty: float | None = 0.0
    """Reward given to an `invalid_output` result (it then enters the baseline); None drops it."""


class AlgorithmConfig(Section):
    name: Literal["grpo"] = "grpo"
    """Algorithm; the full library (DAPO, RLOO, PPO, ...) is its own issue."""
    lr: float = Field(3e-4, gt=0)
    """Policy learning rate (AdamW)."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """Learning-rate schedule over `trainer.steps`: constant, or cosine decay to
    `min_lr_ratio * lr` (settles the policy as it converges)."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate of the cosine schedule, as a fraction of `lr`."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    clip_eps_low: float = Field(0.2, ge=0)
    """PPO clip: ratio floor is 1 - clip_eps_low."""
    clip_eps_high: float = Field(0.28, ge=0)
    """PPO clip: ratio ceiling is 1 + clip_eps_high."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty to the reference model in the loss; > 0 starts the reference role."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap on pi_trainer / pi_rollout per token; None disables."""
    std_eps: float = Field(1e-4, ge=0)
    """Epsilon added to the group reward std when normalising advantages."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    """How per-token losses are averaged over the global batch."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping)."""
    micro_batch_groups: int = Field(8, ge=1)
    """Groups per trainer micro-batch (gradients accumulate over a step's micro-batches)."""
    skip_zero_advantage: bool = True
    """Skip the forward/backward of samples whose advantage is 0 (the gradient is unchanged when
    kl_coef is 0; they still count in the loss normaliser)."""


class TrainerConfig(Section):
    steps: int = Field(100, ge=1)
    """Optimizer steps (policy versions) to train."""
    eval_every: int = Field(20, ge=0)
    """Evaluate held-out greedy accuracy every this many steps (0: only at start and end)."""
    checkpoint_every: int = Field(20, ge=0)
    """Save a resumable checkpoint every this many steps (0: only at the end)."""
    threads: int = Field(1, ge=1)
    """torch threads of the trainer process in async mode."""


class RuntimeConfig(Section):
    mode: Literal["ray", "inline", "sync"] = "ray"
    """ray: every role its own process on Ray; inline: every role an asyncio task in one process
    (debugging, tests); sync: generate then train, in turn, in one process (the baseline)."""
    ray_address: str | None = None
    """Address of an existing Ray cluster; None starts a local instance."""
    num_cpus: int | None = None
    """Logical CPUs of the local Ray instance (None: Ray's default)."""
    sync_threads: int | None = None
    """torch threads in sync mode (None: every core, as a synchronous loop would use)."""
    lease_s: float = Field(120.0, gt=0)
    """How long a role holds claimed rows before they are handed out again."""
    poll_s: float = Field(0.002, gt=0)
    """How long an idle role first waits before looking for work again (doubling while idle,
    up to 16x)."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """Stop the run with a diagnosis when no training step finishes for this long."""
    claim_wait_s: float = Field(0.05, ge=0)
    """Ray mode: an empty claim waits up to this long inside the bus for matching rows (long
    poll), instead of polling across processes."""


class RunConfig(Section):
    run_dir: str | None = None
    """Run directory; None makes runs/<timestamp>."""
    cache_dir: str = ".cache/streamrl"
    """Where the built-in model and warm start are cached."""
    seed: int = 0
    """Seed of model init, warm start and sampling."""
    tensorboard: bool = True
    """Write TensorBoard event files under run_dir/tb."""
    progress: bool = True
    """Show a progress bar."""
    log_every: int = Field(0, ge=0)
    """Also print every metric on one line every this many steps (0: never; the progress bar
    already shows reward, staleness, tokens/s and accuracy)."""


class Config(Section):
    """A whole run."""

    model: ModelConfig = ModelConfig()
    """The policy model."""
    warm_start: WarmStartConfig = WarmStartConfig()
    """Supervised warm start before RL."""
    data: DataConfig = DataConfig()
    """Prompts and held-out evaluation."""
    rollout: RolloutConfig = RolloutConfig()
    """Generation and staleness."""
    reward: RewardConfig = RewardConfig()
    """Scoring."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantages and loss."""
    trainer: TrainerConfig = TrainerConfig()
    """Training schedule."""
    runtime: RuntimeConfig = RuntimeConfig()
    """Where and how roles run."""
    run: RunConfig = RunConfig()
    """Outputs and seeds."""

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.model.hidden_size % self.model.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.model.hidden_size}) must be a multiple of "
                f"model.num_heads ({self.model.num_heads})"
            )
        return self
