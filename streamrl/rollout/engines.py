"""The built-in engine factories: `rollout.engine` (builtin, vllm, sglang) to an engine.

Each is registered by name in `api/registry.py`; `make_engine` builds the one the config names,
also one a plugin registered. Every factory takes the run context and returns an object that
speaks `api/engine.py`'s protocol. The heavy imports (torch, vLLM) happen inside the factory
that needs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamrl.api.engine import SamplingParams
from streamrl.api.registry import engine_factory
from streamrl.api.run import RunContext
from streamrl.config.derived import multimodal
from streamrl.config.schema import Config
from streamrl.models.loading import load_policy_model, policy_tokenizer


def make_engine(ctx: RunContext, model=None) -> Any:
    """The rollout engine `rollout.engine` names. Given `model` (the evaluator shares the
    trainer's model object), always the builtin engine over that model."""
    if model is not None:
        return builtin_engine(ctx, model)
    return engine_factory(ctx.cfg.rollout.engine)(ctx)


def builtin_engine(ctx: RunContext, model=None):
    """streamrl's own engine (PyTorch only) over `model`, or over the policy loaded on
    `rollout.device` in `rollout.dtype`."""
    from streamrl.models.onednn import resolve_onednn
    from streamrl.rollout.builtin_engine import BuiltinEngine

    tok = policy_tokenizer(ctx)
    model_given = model is not None
    if model is None:
        dtype = ctx.cfg.rollout.dtype
        model = load_policy_model(ctx, "rollout.device", dtype=None if dtype == "auto" else dtype)
    return BuiltinEngine(
        model,
        tokenizer=tok,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_batch_size=ctx.cfg.rollout.max_batch_size,
        use_onednn=resolve_onednn(ctx.cfg.model.onednn_linears),
        # The rollout's engine records its routing for replay; the evaluator's (over the
        # trainer's `model`) has nobody to hand it to.
        capture_routes=model_given is False and ctx.cfg.algorithm.routing_replay == "rollout",
    )


def vllm_engine(ctx: RunContext):
    from streamrl.rollout.vllm_engine import VllmEngine

    cfg = ctx.cfg
    config = cfg.rollout.vllm
    if multimodal(cfg) and "limit_mm_per_prompt" not in config.engine_kwargs:
        # vLLM sizes its encoder budget by this; a prompt over it is refused.
        most = cfg.data.media.max_media
        limits = {"limit_mm_per_prompt": {"image": most, "video": most}}
        config = config.model_copy(update={"engine_kwargs": {**config.engine_kwargs, **limits}})
    return VllmEngine(
        ctx.policy_dir,
        eos_token_id=policy_tokenizer(ctx).eos_token_id,
        config=config,
        model_dtype=cfg.model.dtype,
        max_num_seqs=cfg.rollout.max_batch_size,
        seed=cfg.run.seed,
        capture_routes=cfg.algorithm.routing_replay == "rollout",
    )


def sglang_engine(ctx: RunContext):
    """An SGLang server, launched or attached (`rollout.sglang`)."""
    from streamrl.rollout.sglang_engine import SglangEngine

    cfg = ctx.cfg
    return SglangEngine(
        ctx.policy_dir,
        eos_token_id=policy_tokenizer(ctx).eos_token_id,
        config=cfg.rollout.sglang,
        model_dtype=cfg.model.dtype,
        max_running_requests=cfg.rollout.max_batch_size,
        default_weights_dir=Path(ctx.run_dir) / "sglang",
        capture_routes=cfg.algorithm.routing_replay == "rollout",
    )


def sampling_params(cfg: Config) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        seed=cfg.run.seed,
        top_p=r.top_p,
        top_k=r.top_k,
        min_p=r.min_p,
        stop=tuple(r.stop),
        stop_token_ids=tuple(r.stop_token_ids),
    )


def rows_per_claim(cfg: Config) -> int:
    """Rows a rollout service claims at once: `max_batch_size` for each engine it drives."""
    r = cfg.rollout
    return r.max_batch_size * (r.vllm.engines if r.engine == "vllm" else 1)
