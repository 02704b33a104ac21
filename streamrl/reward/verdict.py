"""Reading a judge's reply: the verdict it names, as a reward, or why it cannot be read.

Pure functions of the reply text and `reward.judge.verdict` (`VerdictConfig`). A reply that does
not hold a verdict is `invalid_output` with the reply quoted in the reason: the judge failed to
answer, which says nothing about the response, so the sample is dropped and counted, never
scored 0.
"""

from __future__ import annotations

import math
import re

from streamrl.api.reward import RewardResult
from streamrl.config.reward_schema import VerdictConfig

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_EDGES = " \t\n\r.,;:!?\"'`*()[]"


def render(template: str, **values: str) -> str:
    """`template` with each `{name}` replaced by its value, in one pass, not `str.format`:
    responses and answers may hold braces (even a placeholder's) of their own."""
    names = "|".join(re.escape(name) for name in values)
    return re.sub(r"\{(" + names + r")\}", lambda m: values[m.group(1)], template)


def verdict_text(reply: str, config: VerdictConfig) -> str | None:
    """The part of `reply` that is the verdict: `pattern`'s first group, or the whole reply."""
    if config.pattern is None:
        return reply
    found = re.search(config.pattern, reply)
    return None if found is None else found.group(1)


def parse_label(reply: str, config: VerdictConfig) -> tuple[RewardResult, str]:
    """(the reward of the label the reply names, that label); case and surrounding
    punctuation are ignored, anything else is not a label."""
    labels = {label.lower(): (label, reward) for label, reward in config.label_rewards.items()}
    text = verdict_text(reply, config)
    key = None if text is None else text.strip(_EDGES).lower()
    if key not in labels:
        return _unreadable(reply, f"not one of {', '.join(config.label_rewards)}"), "invalid"
    label, reward = labels[key]
    return RewardResult.ok(reward), label


def parse_score(reply: str, config: VerdictConfig) -> tuple[RewardResult, str]:
    """(the reward of the score the reply gives, the score as text): `pattern`'s group or the
    reply's last number, inside `score_range`, mapped onto [0, 1] with `normalize`."""
    text = verdict_text(reply, config)
    numbers = _NUMBER.findall(text or "")
    if not numbers:
        return _unreadable(reply, "no score in it"), "invalid"
    score = float(numbers[-1] if config.pattern is None else numbers[0])
    lo, hi = config.score_range
    if not math.isfinite(score) or not lo <= score <= hi:
        return _unreadable(reply, f"score {score:g} outside [{lo:g}, {hi:g}]"), "invalid"
    value = (score - lo) / (hi - lo) if config.normalize else score
    return RewardResult.ok(value), f"{score:g}"


def parse(reply: str, config: VerdictConfig) -> tuple[RewardResult, str]:
    """The reply's reward and its verdict (a label, a score, or "invalid") as `config` reads it."""
    if config.kind == "score":
        return parse_score(reply, config)
    return parse_label(reply, config)


def _unreadable(reply: str, why: str) -> RewardResult:
    return RewardResult.invalid(f"judge verdict unreadable ({why}): {reply[:80]!r}")
