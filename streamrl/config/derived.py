"""Quantities derived from the config that several roles and the runtime share.

Pure functions of `Config`, so the feeder, the trainer, the bus's sizing and the synchronous
loop agree on them without importing each other.
"""

from __future__ import annotations

import math

from streamrl.config.data_schema import AUDIO_TASKS, VISION_TASKS
from streamrl.config.schema import Config


def prompts_per_batch(cfg: Config) -> int:
    """Prompts (groups) per generation batch (the feeder's, and each dynamic-sampling refill):
    `batch_prompts`, times `dynamic_sampling_oversample` under dynamic sampling."""
    a = cfg.algorithm
    if a.dynamic_sampling.enabled:
        return math.ceil(a.dynamic_sampling.oversample * cfg.rollout.batch_prompts)
    return cfg.rollout.batch_prompts


def batches_per_step(cfg: Config) -> int:
    """Most generation batches one training step may use: dynamic sampling's cap, else 1."""
    a = cfg.algorithm
    return a.dynamic_sampling.max_batches if a.dynamic_sampling.enabled else 1


def rows_per_batch(cfg: Config) -> int:
    """Sample rows of one generation batch: its groups times `group_size`."""
    return prompts_per_batch(cfg) * cfg.rollout.group_size


def bus_capacity_groups(cfg: Config) -> int:
    """At most (max_staleness + 1) batches of prompts in flight, plus room for the refill
    batches of the step being trained under dynamic sampling (reserved: the feeder leaves it)."""
    return (cfg.rollout.max_staleness + batches_per_step(cfg)) * prompts_per_batch(cfg)


def in_place_recovery(cfg: Config) -> bool:
    """Whether a lost trainer restarts alone (else the controller restarts every role). Only Ray
    mode supervises roles; inline and sync runs keep their bus as it was."""
    rt = cfg.runtime
    return (
        rt.mode == "ray"
        and rt.ray.trainer_recovery == "in_place"
        and cfg.trainer.checkpoint_every > 0
    )


def groups_per_step(cfg: Config) -> int:
    """Most groups one training step may take, refill batches included."""
    return batches_per_step(cfg) * prompts_per_batch(cfg)


def held_groups(cfg: Config, groups_per_step: int) -> int:
    """Extra bus capacity for the trained rows no checkpoint covers yet (in-place recovery)."""
    return cfg.trainer.checkpoint_every * groups_per_step if in_place_recovery(cfg) else 0


MEDIA_TASKS = VISION_TASKS + AUDIO_TASKS


# Top-level keys of a model's config.json that make it multimodal: a vision tower (Qwen-VL), or
# a Qwen2.5-Omni thinker (audio and vision towers).
MULTIMODAL_CONFIG_KEYS = ("vision_config", "thinker_config")


def multimodal(cfg: Config) -> bool:
    """Whether the policy takes images, video or audio: a `model.path` whose config has a
    vision tower or is a Qwen2.5-Omni thinker's, or the built-in model of a built-in media task. Every role that reads a prompt
    then reads its `media` field too."""
    if cfg.model.path is None:
        return cfg.data.train_file is None and cfg.data.task in MEDIA_TASKS
    return any(key in model_config(cfg.model.path) for key in MULTIMODAL_CONFIG_KEYS)


def model_config(path) -> dict:
    """The model directory's config.json ({} when there is none, or it is not an object)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
