"""Building a role's heavy parts (model, engine, learner, scorer) from the run context.

Each process builds its own; the same functions serve the sync loop, inline mode and Ray actors.
Torch and the modules built on it are imported by the functions that build with them: the
feeder's and the reward's processes never load torch (about 2 CPU-s each at start-up).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from streamrl.api import fields as F
from streamrl.api.engine import SamplingParams
from streamrl.config.schema import Config
from streamrl.data.feeder import PromptFeeder
from streamrl.data.prompts import encode_prompt
from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.reward.sandbox import SandboxedScorer
from streamrl.runtime.context import RunContext
from streamrl.trainer.evaluate import EvalResult, HeldOut, SampledResult

if TYPE_CHECKING:
    from streamrl.rollout.builtin_engine import BuiltinEngine
    from streamrl.rollout.sglang_engine import SglangEngine
    from streamrl.rollout.vllm_engine import VllmEngine
    from streamrl.trainer.advantage import AdvantageSettings
    from streamrl.trainer.algos.objective import LossSettings
    from streamrl.trainer.learner import Learner
    from streamrl.trainer.ranks import RankedLearner
    from streamrl.trainer.service import BatchTrainer

log = logging.getLogger(__name__)


def set_threads(num: int) -> None:
    import torch

    torch.set_num_threads(num)


def prompts_per_batch(cfg: Config) -> int:
    """Prompts (groups) per generation batch (the feeder's, and each dynamic-sampling refill):
    `batch_prompts`, times `dynamic_sampling_oversample` under dynamic sampling."""
    a = cfg.algorithm
    if a.dynamic_sampling:
        return math.ceil(a.dynamic_sampling_oversample * cfg.rollout.batch_prompts)
    return cfg.rollout.batch_prompts


def batches_per_step(cfg: Config) -> int:
    """Most generation batches one training step may use: dynamic sampling's cap, else 1."""
    a = cfg.algorithm
    return a.dynamic_sampling_max_batches if a.dynamic_sampling else 1


def loss_settings(cfg: Config) -> LossSettings:
    from streamrl.trainer.algos.objective import LossSettings

    a = cfg.algorithm
    return LossSettings(
        policy_loss=a.policy_loss,
        clip_eps_low=a.clip_eps_low,
        clip_eps_high=a.clip_eps_high,
        dual_clip=a.dual_clip,
        cispo_max_ratio=a.cispo_max_ratio,
        kl_coef=a.kl_coef,
        kl_estimator=a.kl_estimator,
        kl_in_reward=a.kl_in_reward,
        entropy_coef=a.entropy_coef,
        is_mode=a.is_correction,
        is_level=a.is_level,
        tis_cap=a.tis_cap,
        mis_band=(a.mis_low, a.mis_high),
        loss_agg=a.loss_agg,
        loss_agg_constant=a.loss_agg_constant or float(cfg.rollout.max_new_tokens),
        max_token_staleness=a.max_token_staleness,
    )


def advantage_settings(cfg: Config) -> AdvantageSettings:
    from streamrl.trainer.advantage import AdvantageSettings

    a = cfg.algorithm
    return AdvantageSettings(
        estimator=a.advantage,
        scale=a.adv_scale,
        std_unbiased=a.std_unbiased,
        std_eps=a.std_eps,
        gamma=a.gamma,
        lam=a.lam,
        kl_in_reward_coef=a.kl_coef if a.kl_in_reward else 0.0,
        kl_estimator=a.kl_estimator,
        overlong_cache=a.overlong_cache,
        max_new_tokens=cfg.rollout.max_new_tokens,
        dynamic_sampling=a.dynamic_sampling,
        reward_clip=a.reward_clip,
        reward_norm=a.reward_norm,
        reward_norm_momentum=a.reward_norm_momentum,
    )


def trainer_extra_fields(cfg: Config) -> tuple[str, ...]:
    """Fields the trainer needs beyond the rollout's, reward's and advantage's."""
    a = cfg.algorithm
    extra = []
    if a.kl_coef > 0 and not a.kl_in_reward:
        extra.append(F.REF_LOGPROBS)
    if a.proximal == "pi_old":
        extra.append(F.OLD_LOGPROBS)
    return tuple(extra)


def make_feeder(ctx: RunContext) -> PromptFeeder:
    r = ctx.cfg.rollout
    tokenizer = load_tokenizer(ctx.policy_dir)
    return PromptFeeder(
        ctx.train_rows,
        tokenizer,
        batch_prompts=prompts_per_batch(ctx.cfg),
        group_size=r.group_size,
        seed=ctx.cfg.data.seed,
        max_rounds=batches_per_step(ctx.cfg),
        chat_template=ctx.cfg.data.chat_template,
    )


def make_engine(ctx: RunContext, model=None) -> BuiltinEngine | VllmEngine | SglangEngine:
    """The rollout engine `rollout.engine` names. Given `model` (the evaluator shares the
    trainer's model object), always the builtin engine over that model."""
    if model is None and ctx.cfg.rollout.engine == "vllm":
        return make_vllm_engine(ctx)
    if model is None and ctx.cfg.rollout.engine == "sglang":
        from streamrl.rollout.sglang_engine import make_sglang_engine

        return make_sglang_engine(ctx)
    from streamrl.models.onednn import resolve_onednn
    from streamrl.rollout.builtin_engine import BuiltinEngine

    tok = load_tokenizer(ctx.policy_dir)
    if model is None:
        model = load_policy_model(ctx, "rollout.device")
    return BuiltinEngine(
        model,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_batch_size=ctx.cfg.rollout.max_batch_size,
        use_onednn=resolve_onednn(ctx.cfg.model.onednn_linears),
    )


def make_vllm_engine(ctx: RunContext) -> VllmEngine:
    from streamrl.rollout.vllm_engine import VllmEngine, VllmSettings

    r = ctx.cfg.rollout
    settings = VllmSettings(
        dtype=ctx.cfg.model.dtype if r.vllm_dtype == "auto" else r.vllm_dtype,
        max_model_len=r.vllm_max_model_len,
        max_num_seqs=r.max_batch_size,
        kv_cache_gib=r.vllm_kv_cache_gib,
        enforce_eager=r.vllm_enforce_eager,
        enable_prefix_caching=r.vllm_prefix_caching,
        in_process=r.vllm_in_process,
        num_engines=r.vllm_engines,
        seed=ctx.cfg.run.seed,
        extra=dict(r.vllm_engine_kwargs),
    )
    eos_token_id = load_tokenizer(ctx.policy_dir).eos_token_id
    return VllmEngine(ctx.policy_dir, eos_token_id=eos_token_id, settings=settings)


def rollout_rows_per_claim(cfg: Config) -> int:
    """Rows a rollout service claims at once: `max_batch_size` for each engine it drives."""
    r = cfg.rollout
    return r.max_batch_size * (r.vllm_engines if r.engine == "vllm" else 1)


def sampling_params(ctx: RunContext) -> SamplingParams:
    r = ctx.cfg.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens, temperature=r.temperature, seed=ctx.cfg.run.seed
    )


def resolve_device(key: str, device: str) -> str:
    """A device setting (`key` names it in errors) resolved: `auto` is a GPU when torch sees one."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{key}=cuda, but torch sees no GPU; use {key}=cpu")
    return device


def load_policy_model(ctx: RunContext, device_key: str = "trainer.device", *, onednn: bool = True):
    """The policy model from the run's model directory, on the device the setting `device_key`
    names (the trainer, reference and pi_old models use `trainer.device`, the builtin engine
    `rollout.device`). Every role loads its model through here. `onednn=False` keeps PyTorch's
    own linears whatever `model.onednn_linears` says (a compiled trainer)."""
    from streamrl.models.onednn import configure_linears

    section, field = device_key.split(".")
    device = resolve_device(device_key, getattr(getattr(ctx.cfg, section), field))
    model = load_causal_lm(ctx.policy_dir, dtype=ctx.cfg.model.dtype).to(device)
    if onednn:
        configure_linears(model, ctx.cfg.model.onednn_linears)
    return model


def make_learner(ctx: RunContext) -> Learner | RankedLearner:
    """The policy learner: in this process, or rank 0 of `trainer.world_size` FSDP2 ranks."""
    import torch

    from streamrl.trainer.learner import Learner

    a, t = ctx.cfg.algorithm, ctx.cfg.trainer
    torch.manual_seed(ctx.cfg.run.seed)
    settings = loss_settings(ctx.cfg)
    kwargs = dict(
        pad_token_id=load_tokenizer(ctx.policy_dir).pad_token_id,
        lr=a.lr,
        weight_decay=a.weight_decay,
        grad_clip=a.grad_clip,
        temperature=ctx.cfg.rollout.temperature,
        settings=settings,
        lr_schedule=a.lr_schedule,
        warmup_steps=a.lr_warmup_steps,
        total_steps=t.steps,
        min_lr_ratio=a.min_lr_ratio,
        padding_free=t.padding_free,
    )
    if t.world_size == 1:
        # oneDNN's linears are a custom op that inductor cannot lower: a compiled trainer keeps
        # PyTorch's (inductor then picks the matmul kernels itself).
        model = load_policy_model(ctx, onednn=not t.compile)
        return Learner(model, compile=t.compile, **kwargs)
    # Imported here: FSDP2 and distributed checkpoints cost every role process a second of
    # imports (DTensor, sympy) that only a multi-rank trainer needs.
    from streamrl.trainer.fsdp import FSDPSettings
    from streamrl.trainer.ranks import RankedLearner, RankSpec

    spec = RankSpec(
        model_dir=str(ctx.policy_dir),
        dtype=ctx.cfg.model.dtype,
        learner_kwargs=kwargs,
        fsdp=FSDPSettings(
            mixed_precision=t.mixed_precision, activation_checkpointing=t.activation_checkpointing
        ),
        device=resolve_device("trainer.device", t.device),
        max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
        num_threads=torch.get_num_threads(),
        seed=ctx.cfg.run.seed,
    )
    return RankedLearner(spec, t.world_size)


def make_batch_trainer(ctx: RunContext) -> BatchTrainer:
    from streamrl.trainer.service import BatchTrainer

    a = ctx.cfg.algorithm
    learner = make_learner(ctx)
    settings = learner.settings
    return BatchTrainer(
        learner,
        # A zero-advantage sample still has a gradient when KL or entropy is in the loss.
        skip_zero_advantage=a.skip_zero_advantage
        and not settings.kl_in_loss
        and settings.entropy_coef == 0,
        max_staleness=ctx.cfg.rollout.max_staleness,
        mask_truncated=a.mask_truncated,
    )


def make_critic(ctx: RunContext):
    import torch

    from streamrl.critic.service import Critic, load_value_model
    from streamrl.models.onednn import configure_linears

    c = ctx.cfg.critic
    torch.manual_seed(ctx.cfg.run.seed)
    model = load_value_model(ctx.policy_dir, ctx.cfg.model.dtype)
    configure_linears(model, ctx.cfg.model.onednn_linears)
    return Critic(
        model,
        pad_token_id=load_tokenizer(ctx.policy_dir).pad_token_id,
        lr=c.lr,
        value_clip=c.value_clip,
        grad_clip=c.grad_clip,
    )


def make_scorer(ctx: RunContext) -> SandboxedScorer:
    return SandboxedScorer(ctx.cfg.reward.function, timeout_s=ctx.cfg.reward.timeout_s)


class Evaluator:
    """Held-out accuracy of a model (greedy, or pass@k of sampled answers), with its own engine
    over the same model object."""

    def __init__(self, ctx: RunContext, model):
        tokenizer = load_tokenizer(ctx.policy_dir)
        chat = ctx.cfg.data.chat_template
        self.held_out = HeldOut(
            engine=make_engine(ctx, model),
            tokenizer=tokenizer,
            rows=ctx.eval_rows,
            prompt_ids=[
                encode_prompt(tokenizer, r.prompt, chat_template=chat) for r in ctx.eval_rows
            ],
            scorer=make_scorer(ctx),  # its worker process starts at the first evaluation
            max_new_tokens=ctx.cfg.rollout.max_new_tokens,
            correct_at=ctx.cfg.trainer.eval_correct_at,
        )
        self.seed = ctx.cfg.run.seed

    def evaluate(self) -> EvalResult:
        self.held_out.engine.model.eval()
        result = self.held_out.greedy()
        self._warn_unscored(len(self.held_out.rows), result.unscored_text())
        return result

    @staticmethod
    def _warn_unscored(num: int, unscored_text: str) -> None:
        if unscored_text:
            log.warning(
                "held-out evaluation of %d responses: %s; counted as not correct",
                num,
                unscored_text,
            )

    def sample(self, samples: int, temperature: float, advance=lambda n: None) -> SampledResult:
        """pass@k of the held-out prompts from `samples` answers each at `temperature`."""
        self.held_out.engine.model.eval()
        result = self.held_out.sampled(samples, temperature, seed=self.seed, advance=advance)
        self._warn_unscored(samples * len(self.held_out.rows), result.unscored_text())
        return result

    def accuracy(self) -> float:
        return self.evaluate().accuracy

    def close(self) -> None:
        """Stop the reward sandbox's worker (it also ends with this process)."""
        self.held_out.scorer.close()
