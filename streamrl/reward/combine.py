"""Several rewards of one sample made into one: the weighted sum, each part logged.

A sample's reward may come from the reward functions, a judge and a remote service together.
The sum is taken only when every part scored it: a part that could not (`timeout`,
`infra_error`) leaves the sample unscored, dropped and counted, as a failed function does; an
`invalid_output` of any part makes the sample's. Each part's value is a component of the result
(`reward_components/<name>`), beside the components the parts report themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamrl.api.reward import RewardResult

UNSCORED = ("timeout", "infra_error")


@dataclass(frozen=True)
class Part:
    name: str
    """`function`, `judge` or `remote`: the component its value is logged as."""
    weight: float
    result: RewardResult
    penalized: bool = True
    """Whether an `invalid_output` of this part is the response's fault and may take
    `reward.invalid_output_penalty`. A judge's unreadable verdict is the judge's: never."""


@dataclass(frozen=True)
class Combined:
    result: RewardResult
    penalized: bool
    """Whether the result, if `invalid_output`, takes the penalty (else it is dropped)."""


def combine(parts: Sequence[Part]) -> Combined:
    """One result for a sample from its parts (at least one); a single part is kept as it is."""
    if not parts:
        raise ValueError("combine needs at least one part")
    if len(parts) == 1:  # its own components only; its weight still scales it
        (part,) = parts
        result = part.result
        if result.status == "ok" and part.weight != 1.0:
            result = RewardResult(part.weight * float(result.value), "ok", "", result.components)
        return Combined(result, part.penalized)
    for part in parts:
        if part.result.status in UNSCORED:
            reason = f"{part.name}: {part.result.reason}"
            return Combined(RewardResult(None, part.result.status, reason), False)
    invalid = [p for p in parts if p.result.status == "invalid_output"]
    if invalid:
        reason = "; ".join(f"{p.name}: {p.result.reason}" for p in invalid)
        return Combined(RewardResult.invalid(reason), all(p.penalized for p in invalid))
    components: dict[str, float] = {}
    for part in parts:
        components.update(part.result.components)
        components[part.name] = float(part.result.value)
    value = sum(p.weight * float(p.result.value) for p in parts)
    return Combined(RewardResult(value, "ok", "", components), True)
