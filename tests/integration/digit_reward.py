"""A reward with signal for an untrained model: the share of digits in the response. Random
responses differ in it, so every group has advantages and every step changes the weights."""

from __future__ import annotations


def digit_share(response: str, answer: str, **extra: object) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)
