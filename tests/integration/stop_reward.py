"""The default task's exact-match reward, also logging how the response ended: component
`cut_at_stop` is 1 when the text ends with the stop string `+0=` (a column adding a zero digit),
where the rollout cut it, else 0. A cut response has no answer and scores 0, as a wrong one."""

from __future__ import annotations

from streamrl.api.reward import RewardResult
from streamrl.reward.rule import arith_exact_match

STOP = "+0="


def exact_match_noting_stops(response: str, answer: str, **extra: object) -> RewardResult:
    cut = response.endswith(STOP)
    scored = arith_exact_match(response, answer)
    value = 0.0 if cut or scored.value is None else scored.value
    # Past the stop string nothing was generated: it can only sit at the very end.
    inside = STOP in response[: -len(STOP)] if cut else STOP in response
    return RewardResult(value, components={"cut_at_stop": float(cut), "stop_inside": float(inside)})
