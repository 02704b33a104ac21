"""Multiple-choice answers: the reward of GPQA / MMLU-style data, where the answer is a letter.

`multiple_choice` reads the letter a response chose, in this order:

1. the last `\\boxed{}` that holds a letter (`\\boxed{C}`, `\\boxed{(C)}`, `\\boxed{\\text{C}}`);
2. else the last "answer" followed by a letter (`Answer: C`, `The answer is (C).`,
   `final answer: **C**`);
3. else a response that is nothing but a letter (`C`, `(C)`, `C.`).

Letters are capitals A-Z. The reference answer is a letter too, written any of those plain ways
(`C`, `(C)`, `c`). Use it with `reward.function=streamrl.reward.choice:multiple_choice`; tell the
model the format in the prompt (`data.prompt_template`), for example "... End with
'Answer: X' where X is the letter of your choice."
"""

from __future__ import annotations

import re

from streamrl.api.reward import RewardResult

_LETTER = r"[\(\[]?\s*([A-Z])\s*[\)\]]?(?![A-Za-z0-9])"
_BOXED = re.compile(r"\\boxed\{\s*(?:\\text\{)?\s*" + _LETTER + r"\s*\}?\s*\}")
_ANSWER = re.compile(r"(?i:answer)(?:\s+is)?\s*:?\s*(?:\*\*|\$)?\s*" + _LETTER)
_ALONE = re.compile(r"\s*(?:\*\*)?" + _LETTER + r"\s*\.?\s*(?:\*\*)?\s*")


def chosen_letter(response: str) -> str | None:
    """The letter the response chose (see the module docstring), or None."""
    for pattern in (_BOXED, _ANSWER):
        found = pattern.findall(response)
        if found:
            return found[-1]
    alone = _ALONE.fullmatch(response)
    return alone.group(1) if alone else None


def multiple_choice(response: str, answer: str, **_: object) -> RewardResult:
    """1.0 when the response chose the reference letter, 0.0 for another letter,
    `invalid_output` when it chose none; a reference that is not a letter is an `infra_error`
    (the sample is dropped and counted: the data needs fixing)."""
    reference = chosen_letter(str(answer).strip().upper())
    if reference is None:
        return RewardResult(None, "infra_error", f"the reference answer {answer!r} is not a letter")
    given = chosen_letter(response)
    if given is None:
        return RewardResult.invalid(f"no choice letter in ...{response[-40:]!r}")
    return RewardResult.ok(1.0 if given == reference else 0.0)
