"""Math answers, checked with math-verify: the reward of GSM8K / MATH-style reasoning data.

`math_answer` reads the final answer out of a response the way math-verify does (a `\\boxed{}`
answer first, else the last LaTeX or plain expression: `#### 72`, `$x = 0.5$`, `the answer is
-4`) and compares it with the reference answer by value (`0.5`, `1/2` and `\\frac{1}{2}` are the
same answer). A reference answer may be plain (`72`) or LaTeX without delimiters
(`\\sqrt{2}`, as MATH writes them). Use it with `reward.function=streamrl.reward.math_answer:math_answer`.
"""

from __future__ import annotations

from functools import lru_cache

from math_verify import parse, verify

from streamrl.api.reward import RewardResult


@lru_cache(maxsize=4096)
def _reference(answer: str) -> tuple:
    """The parsed reference answer (math-verify's parse), tried as written, then as LaTeX."""
    for text in (answer, f"${answer}$", f"\\boxed{{{answer}}}"):
        parsed = parse(text)
        if parsed:
            return tuple(parsed)
    return ()


def math_answer(response: str, answer: str, **_: object) -> RewardResult:
    """1.0 when the response's final answer equals the reference answer, 0.0 for another
    answer, `invalid_output` when the response holds none; a reference answer math-verify
    cannot read is an `infra_error` (the sample is dropped and counted: the data needs fixing)."""
    reference = _reference(str(answer).strip())
    if not reference:
        return RewardResult(None, "infra_error", f"math-verify cannot read the answer {answer!r}")
    given = parse(response)
    if not given:
        return RewardResult.invalid(f"no answer math-verify can read in ...{response[-40:]!r}")
    return RewardResult.ok(1.0 if verify(list(reference), given) else 0.0)
