"""Typed configuration of a streamrl run: pydantic models, every field with a default and a docstring.

`streamrl config show` prints the resolved config; `streamrl.config.loader` reads YAML files and
dotted command-line overrides into these models. Imports no torch or Ray.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from streamrl.config.agent_schema import AgentConfig
from streamrl.config.data_schema import (  # noqa: F401 - re-exported
    TASK_REWARDS,
    VISION_TASKS,
    DataConfig,
    MediaConfig,
    WarmStartConfig,
)
from streamrl.config.engine_schema import BUILTIN_ENGINES, SglangConfig, VllmConfig  # noqa: F401 - re-exported
from streamrl.config.presets import apply_preset
from streamrl.config.reward_schema import (  # noqa: F401 - re-exported
    JudgeBuildConfig,
    JudgeConfig,
    RemoteRewardConfig,
    VerdictConfig,
)
from streamrl.config.runtime_schema import (  # noqa: F401 - re-exported: config.schema names every section
    SCALABLE_ROLES,
    PlacementGroupConfig,
    RayConfig,
    RolePlacement,
    RolesConfig,
    RuntimeConfig,
    WeightsConfig,
)
from streamrl.config.section import Section


class ModelConfig(Section):
    path: str | None = None
    """Local Hugging Face model directory. None builds (once, cached) the built-in tiny Qwen3."""
    hidden_size: int = Field(128, ge=16)
    """Built-in tiny model: hidden width (ignored when `path` is set)."""
    num_layers: int = Field(4, ge=1)
    """Built-in tiny model: number of transformer layers."""
    num_heads: int = Field(4, ge=1)
    """Built-in tiny model: attention heads (key/value heads are half of these)."""
    num_experts: int = Field(0, ge=0, le=256)
    """Built-in tiny model: experts per layer. 0 builds the dense Qwen3; above 0 a Qwen3-MoE
    (a router and `num_experts` SiLU experts in every layer, each of half the dense MLP's
    width), docs/moe.md."""
    experts_per_token: int = Field(2, ge=1)
    """Built-in tiny MoE model: experts each token is routed to (top-k)."""
    vision_family: Literal["qwen2_5_vl", "qwen3_vl"] = "qwen2_5_vl"
    """Built-in model of a vision task (`data.task` shapes or motion): a tiny Qwen2.5-VL or a
    tiny Qwen3-VL (interleaved 3-D rotary positions, deepstack features, timestamped video
    steps; docs/multimodal.md). A model directory (`path`) says its own family."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype of the policy in every role: the trainer (unless
    `trainer.mixed_precision`), the builtin engine, the reference, pi_old and critic models;
    vLLM and SGLang follow it unless `rollout.vllm.dtype` / `rollout.sglang.dtype` say
    otherwise. Weights travel to the engines in the trainer's dtype, bit for bit, and an engine
    in another dtype rounds them when it loads them (docs/precision.md)."""
    onednn_linears: bool | Literal["auto"] = "auto"
    """In fp32 on a CPU, run the linear layers of the builtin engine and of the models that train
    and score (trainer, reference, pi_old, critic; forward and backward) through oneDNN instead
    of MKL; the same results to fp32 rounding. "auto": oneDNN on AVX-512 CPUs not made by Intel
    (there MKL runs its AVX2 kernels and oneDNN's products are about 2x faster), MKL elsewhere
    (on Intel CPUs MKL is the faster one)."""
    freeze_vision: bool = False
    """Keep a vision-language policy's vision tower (Qwen-VL `model.visual`: patch embedding,
    blocks, merger) fixed, and an Omni thinker's audio tower with it: only the language model
    trains, in one process and under FSDP2. The engines still receive every weight at each
    sync. A policy without a vision tower is refused (docs/multimodal.md)."""


class RolloutConfig(Section):
    engine: str = "builtin"
    """Generation engine: `builtin` (PyTorch only, runs wherever torch runs; Llama-family
    decoders: Qwen3, Qwen2, Llama), `vllm` (install it with `make install-vllm`) or `sglang` (an
    SGLang server, launched or attached; needs a GPU build of SGLang), or one a module of
    `run.plugins` registers. See docs/engines.md."""
    batch_prompts: int = Field(32, ge=1)
    """Prompts per training step (each sampled `group_size` times)."""
    group_size: int = Field(8, ge=2)
    """Samples per prompt (GRPO's G)."""
    max_new_tokens: int = Field(24, ge=1)
    """Longest response, in tokens; longer ones are cut and marked truncated."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (log-probs are taken at this temperature too)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: draw from the most likely tokens whose probability reaches top_p (1.0:
    off). The rollout log-probs are those of the truncated, renormalised distribution."""
    top_k: int = Field(0, ge=0)
    """Draw from the k most likely tokens only (0: off)."""
    min_p: float = Field(0.0, ge=0, le=1)
    """Drop tokens less likely than min_p times the most likely token (0: off)."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: a response ends with the token whose text completes one of them (the
    tokens are kept and trained; finish reason "stop"). The reward sees the text with them."""
    stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that end a response as EOS does (the token is kept, finish reason "stop")."""
    max_staleness: int = Field(1, ge=0)
    """0 = strict on-policy (identical to the synchronous loop); s > 0 lets rollout run s policy
    versions ahead of the trainer."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the builtin engine runs: `auto` is a GPU when torch sees one, else the CPU."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The builtin engine's weight and compute dtype; auto uses `model.dtype`. Another dtype
    than the trainer's rounds the weights on arrival (e.g. an fp32 trainer and a bf16 engine);
    vLLM and SGLang have their own (`rollout.vllm.dtype`, `rollout.sglang.dtype`)."""
    threads: int | None = Field(None, ge=1)
    """torch threads of each rollout process in ray mode (the builtin engine's kernels, an
    in-process vLLM's CPU work). None: the rollout replicas share half of the cores Ray was
    started with (`runtime.ray.num_cpus`, else this machine's), the trainer the other half (one
    each on two cores); a role that reserves CPUs (`runtime.ray.roles.rollout.num_cpus`) gets that
    many, and on an existing cluster (`runtime.ray.address`) one. Threads mode runs one per
    role."""
    max_batch_size: int = Field(512, ge=1)
    """Most sequences an engine decodes at once (vLLM's `max_num_seqs`; SGLang: requests in
    flight, and a launched server's `--max-running-requests`)."""
    inflight_weight_updates: bool = True
    """Load newer weights between decode steps instead of only between batches (vLLM, SGLang:
    abort the running requests and resume them as continuations under the new weights)."""
    vllm: VllmConfig = VllmConfig()
    """The vLLM engine's settings."""
    sglang: SglangConfig = SglangConfig()
    """The SGLang engine's settings."""

    @model_validator(mode="after")
    def _check_stops(self) -> RolloutConfig:
        if any(not s for s in self.stop):
            raise ValueError(f"stop: {self.stop!r} holds an empty string; give non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: {self.stop_token_ids!r}; token ids are >= 0")
        return self


class RewardConfig(Section):
    function: str | list[str] = "streamrl.reward.rule:arith_exact_match"
    """Reward function as `module:function`, or a list of them (their weighted sum is the
    reward). Each is called in the form its signature shows (`style`): fn(response_text,
    answer, **extra); TRL's batched fn(completions, **kwargs) -> list; veRL's
    compute_score(data_source, solution_str, ground_truth, extra_info=None). An empty list:
    no function (the judge or the remote reward alone)."""
    judge: JudgeConfig = JudgeConfig()
    """A generative reward model (LLM judge) as a role of its own (docs/rewards.md)."""
    remote: RemoteRewardConfig = RemoteRewardConfig()
    """A reward service reached over HTTP (docs/rewards.md)."""
    eval_function: str | list[str] | None = None
    """What held-out evaluation scores with; None: `function`. Set it when training on a judge
    or a remote reward alone: accuracy is then measured by a rule the policy never sees."""
    weights: list[float] | None = None
    """Weight of each function of `function` (TRL's reward_weights); None: 1.0 each."""
    style: Literal["auto", "streamrl", "trl", "verl"] = "auto"
    """How the functions are called: auto (told by their parameter names), streamrl, trl or
    verl (`streamrl.reward.forms`)."""
    conversational: bool = False
    """TRL-style functions get each completion as one assistant message
    (`[{"role": "assistant", "content": ...}]`, TRL's conversational format), not as text."""
    batch_size: int = Field(256, ge=1)
    """Most samples one call of a TRL-style (batched) or async reward scores."""
    timeout_s: float = Field(5.0, gt=0)
    """A reward call running longer than this is stopped and the sample dropped (status timeout)."""
    invalid_output_penalty: float | None = 0.0
    """Reward given to an `invalid_output` result (it then enters the baseline); None drops it."""
    sandbox: Literal["none", "process", "namespaces"] = "namespaces"
    """Isolation of the reward's worker processes (`streamrl.reward.isolation`): namespaces
    (bubblewrap: no network, own PID namespace, read-only filesystem, private /tmp, homes
    hidden, scrubbed environment, resource limits; as nobody when started by root), process
    (scrubbed environment and resource limits only, for a reward that needs the network), none
    (the caller's environment, no limits: debugging only)."""
    require_sandbox: bool = True
    """Refuse to start when `sandbox`'s level does not work on this machine (the error says what
    is missing and how to get it); False falls back to the strongest level that works."""
    num_workers: int = Field(1, ge=1)
    """Sandboxed worker processes scoring a batch concurrently (each started once, persistent)."""
    memory_limit_gb: float = Field(4.0, gt=0)
    """Address space of each process in the sandbox (RLIMIT_AS): past it an allocation fails."""
    cpu_limit_s: float | None = Field(None, gt=0)
    """CPU seconds one reward call may use (RLIMIT_CPU, reset per call); None: timeout_s."""
    max_processes: int = Field(256, ge=1)
    """Processes and threads of the sandbox's user (RLIMIT_NPROC): a fork bomb stops there."""
    max_file_size_mb: float = Field(64.0, gt=0)
    """Largest file a reward may write (RLIMIT_FSIZE)."""
    max_open_files: int = Field(256, ge=16)
    """Open file descriptors of each process in the sandbox (RLIMIT_NOFILE)."""

    @model_validator(mode="after")
    def _check_functions(self) -> RewardConfig:
        functions = self.functions
        if not functions and not (self.judge.enabled or self.remote.url):
            raise ValueError(
                "function: name at least one reward function (or turn on reward.judge or set "
                "reward.remote.url)"
            )
        if not functions and not self.eval_function:
            raise ValueError(
                "reward.function is empty, so held-out evaluation has nothing to score with: set "
                "reward.eval_function (e.g. streamrl.reward.rule:arith_exact_match)"
            )
        if self.weights is not None and len(self.weights) != len(functions):
            raise ValueError(
                f"weights: {len(self.weights)} weight(s) for {len(functions)} function(s); "
                "give one weight a function"
            )
        return self

    @property
    def functions(self) -> list[str]:
        """`function` as a list."""
        return [self.function] if isinstance(self.function, str) else list(self.function)

    def for_evaluation(self) -> RewardConfig:
        """This section as held-out evaluation scores with: `eval_function` in place of
        `function` (and its weights) when set."""
        if not self.eval_function:
            return self
        return self.model_copy(update={"function": self.eval_function, "weights": None})


class AdvantageConfig(Section):
    """How advantages are estimated from rewards (and values)."""

    estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = "grpo"
    """Advantage estimator: grpo (group z-score), rloo (leave-one-out), reinforce_pp
    (return-to-go, batch z-score), reinforce_pp_baseline (group mean, batch std), gae (critic)."""
    scale: Literal["group", "batch", "none"] = "group"
    """grpo: divide the centred reward by the group std, the batch std, or nothing (Dr. GRPO)."""
    std_unbiased: bool = True
    """grpo: Bessel-corrected (unbiased) std, as TRL and ms-swift; False for the population std."""
    std_eps: float = Field(1e-4, ge=0)
    """Epsilon added to the std when normalising advantages."""
    gamma: float = Field(1.0, ge=0, le=1)
    """gae: discount."""
    lam: float = Field(0.95, ge=0, le=1)
    """gae: lambda."""


class PolicyLossConfig(Section):
    """The policy loss: ratio, clipping, aggregation over tokens, entropy bonus."""

    type: Literal["ppo", "gspo", "gspo_token", "cispo"] = "ppo"
    """ppo (token ratio, clip; DAPO clip-higher when clip_eps_high > clip_eps_low), gspo
    (sequence ratio), gspo_token (sequence ratio, per-token gradient), cispo (clipped, detached
    IS weight on the log-prob)."""
    clip_eps_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip: ratio floor is 1 - clip_eps_low."""
    clip_eps_high: float = Field(0.2, ge=0)
    """PPO clip: ratio ceiling is 1 + clip_eps_high."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip PPO: bound the loss of a negative-advantage token by -dual_clip * A (None: off)."""
    cispo_max_ratio: float = Field(5.0, gt=0)
    """cispo: cap on the detached IS ratio."""
    agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"] = (
        "token_mean"
    )
    """How per-token losses are averaged over the global batch: over all tokens; per sequence
    then over sequences; token sums averaged over sequences; or summed and divided by
    (sequences x `agg_constant`) as Dr. GRPO."""
    agg_constant: float | None = Field(None, gt=0)
    """Normaliser per sequence for agg=constant (None: rollout.max_new_tokens)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus weight in the loss (0: off)."""


class KLConfig(Section):
    """The KL term to the reference model."""

    coef: float = Field(0.0, ge=0)
    """Weight of the KL to the reference model; > 0 starts the reference role."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1 = log(pi/pi_ref), k2 = k1^2/2, k3 = pi_ref/pi - log(pi_ref/pi) - 1."""
    in_reward: bool = False
    """Subtract coef x KL from the reward (RLOO, REINFORCE++) instead of adding it to the loss."""


class OffPolicyConfig(Section):
    """Correction for tokens sampled by an older policy than the one trained."""

    correction: Literal["tis", "mis", "none"] = "tis"
    """Off-policy correction between the proximal and the behaviour (rollout) policy: truncated
    IS, masked IS (zero outside [mis_low, mis_high]), or none."""
    level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or the product over the response."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap; None: untruncated."""
    mis_low: float = Field(0.5, ge=0)
    """Masked IS: lowest kept ratio."""
    mis_high: float = Field(2.0, gt=0)
    """Masked IS: highest kept ratio."""
    proximal: Literal["current", "pi_old"] = "current"
    """Policy the PPO ratio is clipped around (pi_old of PPO). `current`: the trainer's own
    weights as they were before the step's first optimizer update; with one update per batch
    that is the trained policy itself with its gradient stopped (ratio 1), with several
    (`algorithm.ppo_epochs`, `algorithm.mini_batch_groups`) the trainer computes these
    log-probs once per batch before updating. `pi_old`: decoupled PPO, the log-probs the pi_old
    role computed under the newest published weights, for every update of the batch."""
    max_token_staleness: int | None = Field(None, ge=0)
    """Leave out of the loss any token produced more than this many versions ago (None: keep)."""


class ShapingConfig(Section):
    """Reward shaping and response filtering before the advantage."""

    overlong_cache: int | None = Field(None, ge=0)
    """DAPO soft overlong penalty: ramp from 0 to -1 over the last this many tokens before
    rollout.max_new_tokens (None: off)."""
    mask_truncated: bool = False
    """DAPO overlong filtering: a response cut at rollout.max_new_tokens (finish reason
    "length") is left out of the loss and of its normaliser, so a reasoning chain cut short is
    not punished for being cut; its reward still counts in its group's advantages. Counted in
    `samples/dropped_truncated`. The critic (algorithm.advantage.estimator=gae) still learns values on such
    responses: the cut at max_new_tokens is part of the environment the values describe. TRL's
    `mask_truncated_completions`, ms-swift's `overlong_filter`."""
    reward_norm: bool = False
    """Normalise rewards online by an exponential moving mean and std before the advantage. Its
    statistics are saved in the run directory (`reward_norm.json`) and restored on resume."""
    reward_norm_momentum: float = Field(0.9, ge=0, lt=1)
    """Momentum of the online reward statistics."""
    reward_clip: float | None = Field(None, gt=0)
    """Clip rewards to [-reward_clip, reward_clip] (None: off)."""


class DynamicSamplingConfig(Section):
    """DAPO dynamic sampling: train only groups with signal, refilling the step."""

    enabled: bool = False
    """DAPO dynamic sampling: a group whose rewards are all equal has no signal and is dropped
    (not trained, not in the normaliser), and generation continues until the step holds exactly
    `rollout.batch_prompts` groups with signal: the trainer adds refill batches of prompts, up to
    `max_batches` per step. Informative groups beyond that number are not
    trained (surplus). Metrics: `dynamic_sampling/*`."""
    oversample: float = Field(1.5, ge=1)
    """With dynamic sampling: prompts per generation batch (the feeder's and each refill) =
    ceil(this x rollout.batch_prompts). Above 1 a step needs fewer refill rounds (less waiting)
    at the cost of more surplus groups generated and not trained."""
    max_batches: int = Field(4, ge=1)
    """With dynamic sampling: most generation batches per training step, the feeder's included;
    when they hold fewer groups with signal than `rollout.batch_prompts`, the step trains those
    and logs a warning (`dynamic_sampling/cap_hit`). 1: no refill."""


class AlgorithmConfig(Section):
    preset: Literal["grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "cispo", "ppo"] = (
        "grpo"
    )
    """Published recipe to start from (docs/algorithms.md); it fills in the fields below that
    are not set explicitly, so any of them can still be overridden."""
    lr: float = Field(3e-4, gt=0)
    """Policy learning rate (AdamW)."""
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    """Learning-rate schedule over `trainer.steps`: constant, or cosine decay to
    `min_lr_ratio * lr` (settles the policy as it converges)."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Steps of linear warm-up to `lr` before the schedule, which then runs over the steps
    left (a fresh AdamW's first updates are about `lr` per weight whatever the gradient's
    size). To continue from a trained model, lower `lr` too (README, "Your own model")."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate of the cosine schedule, as a fraction of `lr`."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping)."""
    micro_batch_groups: int = Field(8, ge=1)
    """Groups per trainer micro-batch (gradients accumulate over a step's micro-batches)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each generated batch; each pass makes one optimizer update per mini-batch
    (`mini_batch_groups`). Above 1 the PPO ratio moves away from 1 and the clip acts. The
    version (`trainer.steps`, staleness, the lr schedule) still counts generated batches."""
    mini_batch_groups: int | None = Field(None, ge=1)
    """Groups per optimizer update (PPO mini-batch); a step of `rollout.batch_prompts` groups
    makes ceil(batch_prompts / mini_batch_groups) updates per epoch. None (or at least
    batch_prompts): one update per epoch, on the whole batch."""
    skip_zero_advantage: bool = True
    """Skip the forward/backward of samples whose advantage is 0 (the gradient is unchanged when
    no KL or entropy term is in the loss; they still count in the loss normaliser)."""
    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage estimator."""
    loss: PolicyLossConfig = PolicyLossConfig()
    """Policy loss."""
    kl: KLConfig = KLConfig()
    """KL to the reference model."""
    off_policy: OffPolicyConfig = OffPolicyConfig()
    """Off-policy correction and the proximal policy."""
    shaping: ShapingConfig = ShapingConfig()
    """Reward shaping and filtering."""
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """DAPO dynamic sampling."""
    routing_replay: Literal["off", "rollout"] = "off"
    """Mixture-of-experts models: "rollout" records, per token and layer, the experts the
    rollout engine routed to (field `routed_experts`) and makes the trainer, reference and
    pi_old forwards use exactly those (the router still gets its gradient), so that a routing
    decision flipped by rounding cannot open a log-prob gap between engine and trainer
    (rollout routing replay, R3). "off": every forward routes by itself. docs/moe.md."""
    router_aux_loss_coef: float = Field(0.001, ge=0)
    """Mixture-of-experts models: weight of the router's load-balancing loss (Switch
    Transformer's, as Qwen3-MoE trains with) in the policy loss; always logged as
    `moe/aux_loss` (0: logged, not trained)."""

    _fill_preset = model_validator(mode="before")(apply_preset)

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _off_in_yaml(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false: `routing_replay: off` means "off"."""
        return "off" if value is False else value

    @model_validator(mode="after")
    def _check_combinations(self) -> AlgorithmConfig:
        o = self.off_policy
        if o.mis_low >= o.mis_high:
            raise ValueError(
                f"algorithm.off_policy.mis_low ({o.mis_low}) must be below mis_high ({o.mis_high})"
            )
        if self.kl.in_reward and self.kl.coef == 0:
            raise ValueError("algorithm.kl.in_reward=true needs algorithm.kl.coef > 0")
        return self


class CriticConfig(Section):
    lr: float = Field(1e-3, gt=0)
    """Critic (value model) learning rate; the critic runs only when algorithm.advantage.estimator=gae."""
    value_clip: float | None = Field(0.2, gt=0)
    """Clipped value loss: new values may move at most this far from the values used for the
    advantages (None: plain squared error)."""
    grad_clip: float | None = 1.0
    """Clip the critic's gradient norm to this (None: no clipping)."""


class LoraConfig(Section):
    rank: int = Field(0, ge=0)
    """LoRA rank r of the adapters (through `peft`); 0 trains every parameter (no LoRA). With
    LoRA only the adapters train: the base stays as loaded, the engines receive the merged
    weights, checkpoints hold the adapter, and the reference log-probs of a KL term come from the
    trainer's model with its adapters disabled (no reference model). docs/lora.md."""
    alpha: float = Field(16.0, gt=0)
    """LoRA alpha: the adapter's product B A is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in training (not in the merged weights)."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get adapters: `all-linear` (every linear layer of the decoder; not the
    embeddings, not the output layer), or module names as peft matches them (`q_proj`, ...)."""


class TrainerConfig(Section):
    steps: int = Field(100, ge=1)
    """Optimizer steps (policy versions) to train."""
    eval_every: int = Field(20, ge=0)
    """Evaluate held-out greedy accuracy every this many steps (0: only at start and end)."""
    eval_samples: int = Field(0, ge=0)
    """Also sample this many answers to each held-out prompt at every evaluation and log
    `eval/pass@k` for k = 1, 2, 4, ... up to it (pass@1 is the mean accuracy of one sample:
    veRL's mean@N). 0: greedy accuracy only. Costs this many more generations per evaluation."""
    eval_temperature: float | None = Field(None, gt=0)
    """Sampling temperature of `eval_samples` (None: `rollout.temperature`)."""
    eval_correct_at: float = 1.0
    """A held-out answer counts as correct when its reward is at least this; when the reward
    reports an `acc` component (veRL's rewards do, beside a score that may hold bonuses or
    penalties) that decides instead: correct when it is 1."""
    checkpoint_every: int = Field(20, ge=0)
    """Save a resumable checkpoint every this many steps (0: only at the end)."""
    threads: int | None = Field(None, ge=1)
    """torch threads of the trainer process in ray mode (FSDP ranks: of each rank). None: half
    of the cores, shared by the ranks (see `rollout.threads`)."""
    world_size: int = Field(1, ge=1)
    """Data-parallel ranks of the trainer on its node. 1 trains in the trainer's process; N > 1
    shards the model with FSDP2 over N processes (gloo on CPU, NCCL on GPUs; on GPUs give the
    trainer role N GPUs: `runtime.ray.roles.trainer.num_gpus`). See docs/architecture.md."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer's model lives (and the reference and pi_old models): `auto` is a GPU
    when torch sees one (in a Ray actor: when its placement gives it a GPU), else the CPU."""
    mixed_precision: bool = False
    """The trainer computes forward and backward in bf16 over fp32 master weights, so its
    gradients and AdamW state are fp32 too, whatever `model.dtype` (which then sets only the
    engines' and scoring models' dtype): one process under `torch.autocast`, FSDP2 ranks through
    their `MixedPrecisionPolicy` (gradients reduced in fp32). docs/precision.md."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, more compute)."""
    max_tokens_per_micro_batch: int | None = Field(None, ge=1)
    """FSDP2 ranks: token budget of one micro-batch (rows x padded length); None splits each
    claimed micro-batch into about one part per rank."""
    padding_free: bool = False
    """Compute log-probs on the rows laid end to end (no compute on padding); needs a model whose
    attention follows position-id restarts (standard transformers decoders do)."""
    compile: bool = False
    """Run the trainer's forward and backward through `torch.compile` (inductor, dynamic shapes),
    which fuses the element-wise work around the matmuls: on CPU with the built-in model about
    1.45x faster per micro-batch, after a one-time compilation in the first step (about 50 s on
    two cores, 13-18 s once inductor's on-disk cache holds it). Worth it for runs of hundreds of
    steps, not for the 100-step default job. The trainer's linears then stay PyTorch's own
    (`model.onednn_linears` does not apply to it); a one-process trainer only (world_size=1);
    needs a C++ compiler (without one, or where an op does not compile, it runs eagerly, with a
    warning). See docs/benchmarks-log.md."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters instead of full fine-tuning (`rank` > 0 turns it on)."""


class RunConfig(Section):
    run_dir: str | None = None
    """Run directory; None makes runs/<timestamp>."""
    cache_dir: str = ".cache/streamrl"
    """Where the built-in model and warm start are cached."""
    seed: int = 0
    """Seed of model init, warm start and sampling."""
    tensorboard: bool = True
    """Write TensorBoard event files under run_dir/tb."""
    wandb: bool = False
    """Also log to Weights & Biases: every step's metrics (as in metrics.jsonl and TensorBoard),
    the config (as in config.yaml, secrets left out) and the summary, in run_dir/wandb. Needs
    the `wandb` extra (pip install -e '.[wandb]'); docs/metrics.md."""
    wandb_project: str = "streamrl"
    """W&B project of the run (the entity: $WANDB_ENTITY, else the account's default)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: W&B writes the run under run_dir/wandb and never contacts the network
    (`wandb sync RUN_DIR/wandb/offline-run-*` uploads it later); online: it also streams to the
    W&B server (`wandb login` or $WANDB_API_KEY first). $WANDB_MODE, when set, wins."""
    progress: bool = True
    """Show a progress bar."""
    log_every: int = Field(0, ge=0)
    """Also print every metric on one line every this many steps (0: never; the progress bar
    already shows reward, staleness, tokens/s and accuracy)."""
    plugins: list[str] = Field(default_factory=list)
    """Python modules every process of the run imports before it builds anything: they register
    roles and engines of their own (`streamrl.api.registry`; CONTRIBUTING.md)."""
    record_samples: bool = False
    """Record what every optimizer step trained: each micro-batch's rows as the trainer received
    them (token ids, behaviour log-probs, versions, rewards, advantages, and pi_old / reference
    log-probs where the loss reads them), with the step's loss and gradient norm, compressed in
    run_dir/samples/step-<k>.npz (metric `record/bytes`; about 12 KiB a step, 1.2 MB a run, for
    the default job). `streamrl replay RUN_DIR --from-step K` trains the recorded steps after
    checkpoint K again, without engines, and checks their loss and gradient norm bit for bit;
    `--inspect STEP` prints a step's samples (docs/replay.md)."""


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
    agent: AgentConfig = AgentConfig()
    """Multi-turn agent episodes with tools (off: one response a prompt)."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Advantages and loss."""
    critic: CriticConfig = CriticConfig()
    """The value model of PPO (algorithm.advantage.estimator=gae)."""
    trainer: TrainerConfig = TrainerConfig()
    """Training schedule."""
    runtime: RuntimeConfig = RuntimeConfig()
    """Where and how roles run."""
    run: RunConfig = RunConfig()
    """Outputs and seeds."""

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.rollout.engine not in BUILTIN_ENGINES and not self.run.plugins:
            raise ValueError(
                f"rollout.engine={self.rollout.engine!r} is not an engine: use one of "
                f"{', '.join(BUILTIN_ENGINES)}, or register your own in a module named in "
                "run.plugins"
            )
        if self.trainer.compile and self.trainer.world_size > 1:
            raise ValueError(
                f"trainer.compile applies to a one-process trainer; trainer.world_size is "
                f"{self.trainer.world_size} (set trainer.compile=false or trainer.world_size=1)"
            )
        if self.trainer.lora.rank:
            _check_lora(self)
        if self.agent.enabled and self.algorithm.advantage.estimator == "gae":
            raise ValueError(
                "agent.enabled with algorithm.advantage.estimator=gae: the critic does not yet "
                "skip tool-output tokens; use a critic-free estimator (grpo, rloo, reinforce_pp)"
            )
        if self.agent.enabled and self.agent.workflow == "env_loop" and not self.agent.environment:
            raise ValueError(
                "agent.workflow=env_loop needs agent.environment, the environment's class as "
                "package.module:Name"
            )
        if self.agent.enabled and self.agent.workflow == "program" and not self.agent.program:
            raise ValueError(
                "agent.workflow=program needs agent.program, the command of the agent program "
                "(e.g. agent.program='[python, examples/agent_openai.py]')"
            )
        if (
            self.data.task in TASK_REWARDS
            and self.data.train_file is None
            and "function" not in self.reward.model_fields_set
        ):
            self.reward.function = TASK_REWARDS[self.data.task]
        judge = self.reward.judge
        if (
            judge.enabled
            and judge.model is None
            and (self.data.task != "arith" or self.data.train_file)
        ):
            raise ValueError(
                "reward.judge.model is unset, so the built-in judge would grade, and it knows only "
                "the built-in arithmetic task (data.task=arith, no data.train_file): set "
                "reward.judge.model to a judge model directory of your own"
            )
        m = self.model
        if self.algorithm.routing_replay != "off":
            if m.path is None and not m.num_experts:
                raise ValueError(
                    "algorithm.routing_replay needs a mixture-of-experts model: the built-in "
                    "model is dense unless model.num_experts > 0 (e.g. model.num_experts=8), "
                    "or set algorithm.routing_replay=off"
                )
            if self.rollout.engine not in BUILTIN_ENGINES:
                raise ValueError(
                    "algorithm.routing_replay=rollout: the builtin, vLLM and SGLang engines "
                    f"capture routing; rollout.engine={self.rollout.engine!r} is a plugin's, "
                    "which streamrl cannot ask for it; set algorithm.routing_replay=off "
                    "(docs/moe.md)"
                )
        if m.num_experts and not m.experts_per_token <= m.num_experts:
            raise ValueError(
                f"model.experts_per_token ({m.experts_per_token}) must be at most "
                f"model.num_experts ({m.num_experts})"
            )
        if m.vision_family != "qwen2_5_vl" and (
            m.path is not None
            or self.data.train_file is not None
            or self.data.task not in VISION_TASKS
        ):
            raise ValueError(
                f"model.vision_family={m.vision_family!r} picks the built-in model of a built-in "
                f"vision task (data.task: {' or '.join(VISION_TASKS)}, no model.path, no "
                "data.train_file); a model directory's config.json says its own family"
            )
        if self.model.hidden_size % self.model.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.model.hidden_size}) must be a multiple of "
                f"model.num_heads ({self.model.num_heads})"
            )
        return self


def _check_lora(cfg: Config) -> None:
    """Settings that cannot go with LoRA, refused with what to change."""
    if cfg.algorithm.kl.in_reward and cfg.algorithm.kl.coef > 0:
        raise ValueError(
            "trainer.lora computes the reference log-probs in the trainer (its model with the "
            "adapters disabled), after the advantages are taken, so the KL cannot be part of the "
            "reward: set algorithm.kl.in_reward=false (the KL in the loss) or trainer.lora.rank=0"
        )
