"""Resolving a reward function by dotted path and turning whatever it returns into a RewardResult."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from streamrl.api.reward import RewardResult


def resolve_callable(path: str) -> Callable[..., Any]:
    """Import `module:function` (or `module.function`); the error says what was wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"expected a dotted path like 'my_pkg.rewards:score', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{path!r}: module {module_name!r} has no callable {attr!r}")
    return fn


def to_result(value: Any) -> RewardResult:
    """Normalise a reward function's return value; anything unusable is an infra_error, never 0.

    A number is the reward; a `RewardResult` is taken as it is; a mapping (veRL's form) holds
    the reward under `score`, and its other entries that are numbers or booleans become the
    result's components (other entries, such as text, are not logged)."""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, Mapping):
        if "score" not in value:
            return RewardResult(
                None,
                "infra_error",
                f"reward returned a mapping without 'score' (keys: {', '.join(map(str, value))})",
            )
        result = to_result(value["score"])
        parts = {str(k): _number(v) for k, v in value.items() if k != "score"}
        parts = {k: v for k, v in parts.items() if v is not None and math.isfinite(v)}
        return replace(result, components=parts) if result.status == "ok" else result
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy or torch scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return RewardResult(
            None, "infra_error", f"reward returned {type(value).__name__}, not a number"
        )
    if not math.isfinite(value):
        return RewardResult(None, "infra_error", f"reward returned {value}")
    return RewardResult.ok(float(value))


def _number(value: Any) -> float | None:
    """A component's value as a float: a number, a boolean (1 or 0), or a numpy/torch scalar
    of either; else None."""
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    return float(value) if isinstance(value, (int, float)) else None


def score_text(fn: Callable[..., Any], text: str, row: Any) -> RewardResult:
    """Score in this process, with no timeout (the benchmarks' TRL reward calls this; a run
    scores in the sandbox, `streamrl.reward.sandbox`)."""
    try:
        return to_result(fn(text, row.answer, **row.extra))
    except Exception as e:  # a user's reward may raise anything; it is reported, not hidden
        return RewardResult(None, "infra_error", f"{type(e).__name__}: {e}"[:200])
