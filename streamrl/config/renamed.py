"""Config keys that moved when the config became nested, and their translation.

An old key is still accepted, for one release, with a warning that names its new place:
`algorithm.kl_coef=0.01` works as `algorithm.kl.coef=0.01`. Keys and whole sections move
(`runtime.roles.rollout.replicas` -> `runtime.ray.roles.rollout.replicas`); a key that became
a section keeps its value under one field of it (`algorithm.advantage=rloo` ->
`algorithm.advantage.estimator=rloo`), told apart by the value: a mapping is the new section.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("streamrl.config")

_MOVES = {
    **{
        f"rollout.vllm_{k}": f"rollout.vllm.{k}"
        for k in (
            "dtype",
            "kv_cache_gib",
            "max_model_len",
            "enforce_eager",
            "prefix_caching",
            "in_process",
            "engines",
            "engine_kwargs",
        )
    },
    **{
        f"rollout.sglang_{k}": f"rollout.sglang.{k}"
        for k in (
            "url",
            "launch_cmd",
            "launch_args",
            "dtype",
            "deterministic",
            "startup_timeout_s",
            "request_timeout_s",
            "weights_dir",
            "weight_sync",
        )
    },
    "runtime.ray_address": "runtime.ray.address",
    **{
        f"runtime.{k}": f"runtime.ray.{k}"
        for k in (
            "num_cpus",
            "roles",
            "placement_group",
            "bus_shards",
            "max_restarts",
            "trainer_recovery",
            "restart_backoff_s",
            "health_interval_s",
            "health_timeout_s",
        )
    },
    **{
        f"runtime.weight_{k}": f"runtime.weights.{k}"
        for k in (
            "channel",
            "bind",
            "port",
            "collective_backend",
            "token",
        )
    },
    "algorithm.adv_scale": "algorithm.advantage.scale",
    **{
        f"algorithm.{k}": f"algorithm.advantage.{k}"
        for k in (
            "std_unbiased",
            "std_eps",
            "gamma",
            "lam",
        )
    },
    "algorithm.policy_loss": "algorithm.loss.type",
    **{
        f"algorithm.{k}": f"algorithm.loss.{k}"
        for k in (
            "clip_eps_low",
            "clip_eps_high",
            "dual_clip",
            "cispo_max_ratio",
            "entropy_coef",
        )
    },
    "algorithm.loss_agg": "algorithm.loss.agg",
    "algorithm.loss_agg_constant": "algorithm.loss.agg_constant",
    "algorithm.kl_coef": "algorithm.kl.coef",
    "algorithm.kl_estimator": "algorithm.kl.estimator",
    "algorithm.kl_in_reward": "algorithm.kl.in_reward",
    "algorithm.is_correction": "algorithm.off_policy.correction",
    "algorithm.is_level": "algorithm.off_policy.level",
    **{
        f"algorithm.{k}": f"algorithm.off_policy.{k}"
        for k in (
            "tis_cap",
            "mis_low",
            "mis_high",
            "proximal",
            "max_token_staleness",
        )
    },
    **{
        f"algorithm.{k}": f"algorithm.shaping.{k}"
        for k in (
            "overlong_cache",
            "mask_truncated",
            "reward_norm",
            "reward_norm_momentum",
            "reward_clip",
        )
    },
    "algorithm.dynamic_sampling_oversample": "algorithm.dynamic_sampling.oversample",
    "algorithm.dynamic_sampling_max_batches": "algorithm.dynamic_sampling.max_batches",
}
# Keys that became sections: an old scalar value goes to this field of the section.
_BECAME_SECTIONS = {
    "algorithm.advantage": "algorithm.advantage.estimator",
    "algorithm.dynamic_sampling": "algorithm.dynamic_sampling.enabled",
}


def new_key(dotted: str, value: Any = None) -> str | None:
    """The key an old dotted key (or a key under an old section) is now; None when it did not
    move."""
    if dotted in _BECAME_SECTIONS and not isinstance(value, dict):
        return _BECAME_SECTIONS[dotted]
    for old, new in _MOVES.items():
        if dotted == old or dotted.startswith(old + "."):
            return new + dotted[len(old) :]
    return None


def warn_renamed(old: str, new: str) -> None:
    log.warning(
        "config key %r is now %r; the old name is accepted until the next release", old, new
    )


def translate(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a raw config mapping) with every old key moved to its new place, each move
    warned about once."""
    moved: list[tuple[str, str, Any]] = []
    for old in (*_MOVES, *_BECAME_SECTIONS):
        section, _, name = old.rpartition(".")
        node = _get(data, section)
        if not isinstance(node, dict) or name not in node:
            continue
        value = node[name]
        new = new_key(old, value)
        if new is None or new == old:
            continue
        moved.append((old, new, node.pop(name)))
    for old, new, value in moved:
        warn_renamed(old, new)
        _put(data, new, value)
    return data


def _get(data: dict[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _put(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, last = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        node[last] = {**value, **node[last]}  # the new spelling wins where both are given
    else:
        node.setdefault(last, value)
