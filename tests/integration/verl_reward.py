"""A reward with veRL's row layout in its signature: it fails (and the sample is dropped) unless
every key of the Parquet row reached it through the bus as the file had it. It answers in veRL's
form too: a mapping with the reward under `score` and more numbers (and text) beside it."""

from __future__ import annotations

from streamrl.reward.math_answer import math_answer


def verl_style(response: str, answer: str, *, data_source, ability, reward_model, extra_info):
    if not (data_source == "local/sums" and ability == "math"):
        raise ValueError(f"row keys arrived wrong: {data_source!r}, {ability!r}")
    if reward_model != {"ground_truth": answer, "style": "rule"} or extra_info["index"] < 0:
        raise ValueError(f"nested row keys arrived wrong: {reward_model!r}, {extra_info!r}")
    result = math_answer(response, answer)
    right = result.value == 1.0
    return {"score": float(right), "acc": right, "answered": result.status == "ok", "pred": "x"}
