"""Rule rewards: deterministic functions of the response text and the reference answer.

A reward function returns a float (status ok) or a `RewardResult` when it needs another status,
for instance `invalid_output` for a response that is not an answer at all.
"""

from __future__ import annotations

import re

from streamrl.api.reward import RewardResult

_INTEGER = re.compile(r"-?\d+")


def arith_exact_match(response: str, answer: str, **_: object) -> RewardResult:
    """1.0 when the number after the last ':' is the answer, 0.0 for another number,
    `invalid_output` when there is no such number (for example a cut-off response)."""
    _, sep, final = response.strip().rpartition(":")
    final = final.strip()
    if not sep or not _INTEGER.fullmatch(final):
        return RewardResult.invalid(f"no ':<integer>' answer at the end of {response[-30:]!r}")
    return RewardResult.ok(1.0 if int(final) == int(answer) else 0.0)


def integer_match(response: str, answer: str, **_: object) -> RewardResult:
    """1.0 when the whole response is the answer as an integer (the calculator agent task's
    final answer), 0.0 for another integer, `invalid_output` when it is not an integer."""
    final = response.strip()
    if not _INTEGER.fullmatch(final):
        return RewardResult.invalid(f"the answer is not an integer: {final[-30:]!r}")
    return RewardResult.ok(1.0 if int(final) == int(answer) else 0.0)


def final_word_match(response: str, answer: str, **_: object) -> RewardResult:
    """1.0 when the word after the last ':' is the answer (case aside: the built-in motion and
    tones tasks' direction or tone), 0.0 for another word, `invalid_output` when nothing
    follows a ':'."""
    _, sep, final = response.strip().rpartition(":")
    final = final.strip()
    if not sep or not final:
        return RewardResult.invalid(f"no ':<word>' answer at the end of {response[-30:]!r}")
    return RewardResult.ok(1.0 if final.lower() == answer.strip().lower() else 0.0)
