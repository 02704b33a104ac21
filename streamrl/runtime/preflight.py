"""Checks before any work: what a run could only fail on minutes later (after the warm start,
or once its roles are up) is refused at once, with what to do instead.

`check_paths` runs for every `streamrl train`; `check_same_data_order` and `finished` for
`--resume`; `check_same_data` once a run has loaded its training rows (the controller), to
record them or to refuse a resume on other rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

from streamrl.config import ConfigError


def check_paths(cfg) -> None:
    """Fail before any work on paths in the config that cannot be used."""
    from streamrl.data.dataset import is_pattern
    from streamrl.reward.forms import check_reward_config

    try:
        check_reward_config(cfg.reward)
    except ValueError as e:
        raise ConfigError(f"reward.function: {e}") from None
    for key, value in (
        ("model.path", cfg.model.path),
        ("data.train_file", cfg.data.train_file),
        ("data.eval_file", cfg.data.eval_file),
    ):
        pattern = key.startswith("data.") and value is not None and is_pattern(value)
        if value is not None and not Path(value).exists() and not pattern:
            raise ConfigError(f"{key} = {value!r} does not exist")
    if cfg.data.train_file or cfg.data.eval_file:  # fail now, not after the warm start
        from streamrl.runtime.context import load_datasets

        quiet = logging.getLogger("streamrl")  # the run reports skipped rows; this only checks
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            load_datasets(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        finally:
            quiet.setLevel(level)
    if cfg.model.path is not None:
        check_model_dir(cfg)
        warn_on_a_trained_model(cfg)
    check_multimodal(cfg)
    check_local_resources(cfg)
    rt = cfg.runtime
    if rt.weights.channel == "tcp":
        from streamrl.weights.remote import resolve_token
        from streamrl.weights.tcp import is_loopback

        if not is_loopback(rt.weights.bind) and not resolve_token(rt.weights.token):
            raise ConfigError(
                f"runtime.weights.bind = {rt.weights.bind!r} serves weights beyond this machine "
                "without a token: set runtime.weights.token or $STREAMRL_WEIGHT_TOKEN"
            )


# What fixes which prompts make up batch b: a resumed run that changed any of them would train
# some prompts twice and skip others.
DATA_ORDER_KEYS = (
    "data.task",
    "data.digits",
    "data.train_file",
    "data.seed",
    "rollout.batch_prompts",
    "algorithm.dynamic_sampling.enabled",
    "algorithm.dynamic_sampling.oversample",
    "algorithm.dynamic_sampling.max_batches",
)


# With a data file, also which of its rows are too long to keep (streamrl.runtime.context) and
# which rows' media are refused (a limit, or a size that changes the prompt's length); the
# feeder gives a refused row's place to the next prompt of the order (streamrl.data.feeder).
FILE_ORDER_KEYS = (
    "data.media.max_pixels",
    "data.media.max_frames",
    "data.media.max_audio_seconds",
    "data.media.max_media",
    "rollout.max_new_tokens",
    "rollout.vllm.max_model_len",
    "data.chat_template",
    "data.prompt_template",
    "data.system_prompt",
    "data.prompt_key",
    "data.answer_key",
)


def config_value(cfg, dotted: str):
    """The value of a dotted key (`algorithm.dynamic_sampling.enabled`) of a config."""
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def check_same_data_order(saved, cfg, run_dir: Path) -> None:
    """Refuse resume overrides that change the data order the run's checkpoints count in."""
    changed = []
    for key in DATA_ORDER_KEYS + (FILE_ORDER_KEYS if saved.data.train_file else ()):
        before, after = config_value(saved, key), config_value(cfg, key)
        if before != after:
            changed.append(f"{key} {before!r} -> {after!r}")
    if changed:
        raise ConfigError(
            f"--resume {run_dir}: {', '.join(changed)} would change which prompts each batch "
            "holds, so the resumed run would train some twice and skip others. Resume without "
            f"it, or {new_run_instead(saved, run_dir)}"
        )


def new_run_instead(saved, run_dir: Path) -> str:
    """How to go on from a run that cannot be resumed as it is: a new run from its weights."""
    from streamrl.trainer.checkpoint import latest_model_dir
    from streamrl.trainer.schedule import final_lr

    return (
        "start a new run from the trained weights: "
        f"model.path={latest_model_dir(run_dir) or run_dir / 'checkpoints/step-N/model'} "
        f"algorithm.lr={final_lr(saved):.3g} (about the rate it ended at; a new run starts its "
        "schedule and optimizer afresh)"
    )


DATA_FILE = "data.json"


def check_same_data(cfg, run_dir: Path, train_rows, resuming: bool) -> None:
    """Record the training rows' count and digest in `run_dir/data.json` when a run starts, and
    refuse to resume it on other rows: a file edited, replaced, or added to a folder or pattern
    since would change which prompts each batch holds, with the same config."""
    import json

    from streamrl.data.dataset import rows_digest

    now = {"rows": len(train_rows), "digest": rows_digest(train_rows)}
    path = run_dir / DATA_FILE
    if resuming and path.is_file():
        before = json.loads(path.read_text())
        if before != now:
            raise ConfigError(
                f"--resume {run_dir}: the training data changed since the run started "
                f"({before['rows']} rows, digest {before['digest']} -> {now['rows']} rows, "
                f"digest {now['digest']}: a file edited or replaced, or one added to its folder "
                "or pattern), so the resumed run would train some prompts twice and skip "
                f"others. Restore the data, or {new_run_instead(cfg, run_dir)}"
            )
        return
    path.write_text(json.dumps(now) + "\n")  # a new run, or one from before this file existed


def finished(run_dir: Path, steps: int) -> bool:
    """Whether the run in `run_dir` has a checkpoint of its last step (`steps`) or later."""
    from streamrl.trainer.checkpoint import latest_checkpoint, read_state

    checkpoint = latest_checkpoint(run_dir, checksums=False)  # the run checks them as it starts
    return checkpoint is not None and read_state(checkpoint)["next_step"] >= steps


def check_local_resources(cfg) -> None:
    """Refuse an engine or a GPU this machine lacks, when the roles run here (on a cluster,
    other nodes may have them)."""
    import importlib.util

    r = cfg.rollout
    if cfg.runtime.ray.address:
        return
    cuda = [
        key
        for key, device in (("rollout.device", r.device), ("trainer.device", cfg.trainer.device))
        if device == "cuda"
    ]
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"{' and '.join(cuda)} = 'cuda', but torch sees no GPU here: use 'auto' (a GPU "
                "when there is one) or 'cpu'"
            )
    if r.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "rollout.engine = 'vllm', but vLLM is not installed here: `make install-vllm` "
            "installs its CPU build (see docs/engines.md)"
        )
    if r.engine == "vllm":
        check_vllm_cpu_head_size(cfg)
    launches = r.sglang.url is None and r.sglang.launch_cmd is None
    if r.engine == "sglang" and launches and importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            "rollout.engine = 'sglang', but SGLang is not installed here: install it (a GPU "
            "build), attach a running server (rollout.sglang.url=http://host:port) or say how "
            "to start one (rollout.sglang.launch_cmd)"
        )


def check_vllm_cpu_head_size(cfg) -> None:
    """Refuse a model whose attention head size vLLM's CPU build cannot run, when the rollout
    runs on this machine's CPU (it would fail at the first batch, after the warm start, and
    again at each restart)."""
    import torch

    from streamrl.rollout.vllm_engine import CPU_HEAD_SIZES

    device = cfg.rollout.device
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return
    if cfg.model.path is None:
        m = cfg.model
        head_dim = m.hidden_size // m.num_heads
        where = (
            f"the built-in model's (model.hidden_size={m.hidden_size} / "
            f"model.num_heads={m.num_heads})"
        )
    else:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        where = f"model.path's ({cfg.model.path})"
    if head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"rollout.engine = 'vllm' on the CPU: vLLM's CPU attention runs head sizes "
            f"{', '.join(map(str, CPU_HEAD_SIZES))}, and {where} is {head_dim}; use "
            "rollout.engine=builtin, or a model with one of those head sizes"
        )


def warn_on_a_trained_model(cfg) -> None:
    """Warn when `model.path` is a streamrl checkpoint's model and this run's learning rate is
    far above the rate that run ended at: a new run restarts schedule and optimizer, and the
    demo's converged model lost 0.16 of held-out accuracy in 10 steps at the default rate."""
    from streamrl.config.loader import load_config
    from streamrl.trainer.schedule import final_lr

    model = Path(cfg.model.path).resolve()
    run_dir = model.parent.parent.parent  # RUN/checkpoints/step-N/model
    if model.name != "model" or model.parent.parent.name != "checkpoints":
        return
    if not (run_dir / "config.yaml").is_file():
        return
    try:
        ended = final_lr(load_config([str(run_dir / "config.yaml")]))
    except ConfigError:  # a config of another version: nothing to compare with
        return
    a = cfg.algorithm
    if a.lr > 3 * ended and a.lr_warmup_steps == 0:
        logging.getLogger(__name__).warning(
            "model.path is the model trained by %s, whose learning rate ended at %.3g; this run "
            "starts a new schedule and optimizer at algorithm.lr=%.3g, which can undo what it "
            "learned: algorithm.lr=%.3g continues it (README, 'More training for a trained "
            "model')",
            run_dir,
            ended,
            a.lr,
            ended,
        )


def check_multimodal(cfg) -> None:
    """Refuse what a vision-language policy cannot do yet, before any work (docs/multimodal.md,
    "Not yet")."""
    from streamrl.config.derived import multimodal

    if not multimodal(cfg):
        if cfg.model.freeze_vision:
            raise ConfigError(
                "model.freeze_vision=true, but the policy has no vision tower (its config.json "
                "has no vision_config): freezing applies to a vision-language policy such as "
                "Qwen2.5-VL; set model.freeze_vision=false"
            )
        return
    t = cfg.trainer
    refused = {
        "rollout.engine=" + cfg.rollout.engine: cfg.rollout.engine not in ("builtin", "vllm"),
        "trainer.padding_free=true": t.padding_free,
        f"trainer.lora.rank={t.lora.rank}": bool(t.lora.rank),
        "agent.enabled=true": cfg.agent.enabled,
        "algorithm.advantage.estimator=gae (a critic)": cfg.algorithm.advantage.estimator == "gae",
        "reward.judge.enabled=true": cfg.reward.judge.enabled,
    }
    named = [name for name, on in refused.items() if on]
    if named:
        raise ConfigError(
            f"a vision-language policy does not work with {', '.join(named)} yet: images and "
            "video run on the builtin and vLLM engines with a padded-batch trainer "
            "(docs/multimodal.md)"
        )


def check_model_dir(cfg) -> None:
    """Refuse a model directory that the run could only fail on, once its roles are up."""
    from streamrl.data.prompts import NO_CHAT_TEMPLATE, has_chat_template
    from streamrl.models.loading import load_tokenizer

    path = cfg.model.path
    if cfg.data.chat_template and not has_chat_template(load_tokenizer(path)):
        raise ConfigError(f"model.path = {path!r}: {NO_CHAT_TEMPLATE}")
    if cfg.rollout.engine == "builtin":
        from transformers import AutoConfig

        from streamrl.rollout.decoder_runner import unsupported

        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        reason = unsupported(hf_config)
        if reason is not None:
            raise ConfigError(f"model.path = {path!r}: {reason}")
        if cfg.algorithm.routing_replay != "off" and not getattr(hf_config, "num_experts", 0):
            raise ConfigError(
                f"model.path = {path!r} is not a mixture-of-experts model (its config has no "
                "num_experts), so it has no routing to replay: set algorithm.routing_replay=off"
            )
