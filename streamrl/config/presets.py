"""Algorithm presets: one key (`algorithm.preset`) selects a published recipe.

A preset only fills in the `algorithm` fields the user did not set, so every knob stays
overridable (`algorithm.preset=dapo algorithm.loss.clip_eps_high=0.3`). The field defaults of
`AlgorithmConfig` are the `grpo` preset. Values follow `docs/algorithms.md`; where a paper's
setting needs a model or a scale this project does not have, the table says what was chosen.

| preset | advantage | policy loss | aggregation | KL | extras |
| --- | --- | --- | --- | --- | --- |
| grpo | group z-score (unbiased std + 1e-4) | PPO clip 0.2/0.2 | token mean | none | |
| dapo | group z-score | clip-higher 0.2/0.28 | token mean | none | dynamic sampling, soft overlong penalty |
| dr_grpo | group mean only | PPO clip 0.2/0.2 | constant (max length) | none | |
| rloo | leave-one-out | PPO clip 0.2/0.2 | sequence mean of token sums | k1 in the reward, 0.03 | |
| reinforce_pp | return-to-go, batch z-score | PPO clip 0.2/0.2 | token mean | k1 in the reward, 0.01 | |
| gspo | group z-score | sequence ratio, clip 3e-4/4e-4 | sequence mean of token means | none | |
| cispo | group z-score | clipped IS weight (cap 5), detached, times the log-prob | token mean | none | 4 mini-batches a step, lr 1e-4 |
| ppo | GAE (gamma 1, lambda 0.95) with a critic | PPO clip 0.2/0.2 | token mean | none | critic role |
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dapo": {
        "loss": {"clip_eps_high": 0.28},
        "dynamic_sampling": {"enabled": True},
        "shaping": {"overlong_cache": 4},
    },
    "dr_grpo": {"advantage": {"scale": "none"}, "loss": {"agg": "constant"}},
    "rloo": {
        "advantage": {"estimator": "rloo"},
        "loss": {"agg": "seq_mean_token_sum"},
        "kl": {"coef": 0.03, "estimator": "k1", "in_reward": True},
    },
    "reinforce_pp": {
        "advantage": {"estimator": "reinforce_pp"},
        "kl": {"coef": 0.01, "estimator": "k1", "in_reward": True},
    },
    "gspo": {
        "loss": {
            "type": "gspo",
            "clip_eps_low": 3e-4,
            "clip_eps_high": 4e-4,
            "agg": "seq_mean_token_mean",
        }
    },
    # MiniMax-M1 trains each batch in several off-policy updates, where CISPO's detached
    # weight keeps every token's gradient that PPO's clip would zero: 8 groups per update is 4
    # updates per step at the default rollout.batch_prompts of 32, at a lower learning rate (4
    # AdamW steps per batch at the default 3e-4 collapsed the policy on the built-in task).
    "cispo": {"loss": {"type": "cispo"}, "mini_batch_groups": 8, "lr": 1e-4},
    "ppo": {"advantage": {"estimator": "gae"}},
}


def apply_preset(data: Any) -> Any:
    """Fill the preset's values into a raw `algorithm` mapping wherever the user left a key out
    (section by section: `loss.clip_eps_high` set keeps the preset's `loss.type`)."""
    if not isinstance(data, dict):
        return data
    name = data.get("preset", "grpo")
    if name not in PRESETS:
        return data  # the Literal check on `preset` reports it with the allowed names
    return _fill(PRESETS[name], data)


def _fill(preset: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for key, value in preset.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = _fill(value, out[key])
    return out
