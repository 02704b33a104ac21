"""Training and evaluation data of the built-in judge: arithmetic responses with their verdicts.

The built-in judge (`streamrl.judge.model`) is the tiny model fine-tuned to read a task's
prompt, a response and the reference answer as one user turn (`BUILTIN_TEMPLATE`, for example
`37+85=7+5=12,3+8+1=12:122|122`) and to write `correct` or `incorrect`. The verdict is the rule
reward's: `correct` exactly when `streamrl.reward.rule.arith_exact_match` gives 1.0, that is when
the integer after the response's last ':' equals the answer. The steps before the colon do not
count, and a response without a final `:<integer>` is `incorrect`.

The responses are what a policy warm-started on the noisy teacher (`streamrl.data.arith`) writes
during RL: the right worked solution, the one that forgets every carry, ones that forget only
some, a wrong digit in the final answer, a right answer after a slightly wrong step, a response
cut off before its answer, and a garbage tail. About half are correct. Problems come from
`arith.sample_problems`, so the `eval` split's operand pairs are never trained on.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from streamrl.config.reward_schema import BUILTIN_JUDGE_TEMPLATE
from streamrl.data import arith
from streamrl.reward.rule import arith_exact_match
from streamrl.reward.verdict import render as fill

BUILTIN_TEMPLATE = BUILTIN_JUDGE_TEMPLATE
"""The user turn the built-in judge reads: the prompt, the response and the reference answer."""

VERDICTS = ("correct", "incorrect")

# What a tail of garbage is made of: the characters a policy on this task writes (no '|', the
# template's separator of the response from the reference answer).
_JUNK = "0123456789+=,: "


@dataclass(frozen=True)
class JudgeExample:
    prompt: str
    response: str
    answer: str
    label: str  # one of VERDICTS


def verdict(response: str, answer: str) -> str:
    """The verdict the judge is trained to write: the rule reward's, as a word."""
    return VERDICTS[0] if arith_exact_match(response, answer).value == 1.0 else VERDICTS[1]


def render(template: str, *, prompt: str, response: str, answer: str) -> str:
    """`template` with its `{prompt}`, `{response}` and `{answer}` placeholders filled in.

    One pass over the template, not `str.format`: the texts may hold braces, and a placeholder
    inside a filled-in text stays as it is."""
    if "{response}" not in template:
        raise ValueError(
            f"a judge template must show the response: {template!r} has no '{{response}}' "
            "placeholder (also available: '{prompt}', '{answer}')"
        )
    return fill(template, prompt=prompt, response=response, answer=answer)


def judge_examples(num: int, *, digits: int, seed: int, split: str) -> list[JudgeExample]:
    """`num` examples on problems of the `train` or `eval` split, deterministic given `seed`:
    each one aims at `correct` or `incorrect` with even odds and draws a kind of response that
    gives it; a kind that cannot miss on its problem (forgetting carries where there are none)
    gives way to a wrong final answer."""
    problems = arith.sample_problems(num, digits=digits, seed=seed, split=split)
    rng = random.Random(f"judge-{seed}-{split}")
    examples = []
    for p in problems:
        kinds = _CORRECT_KINDS if rng.random() < 0.5 else _INCORRECT_KINDS
        make = rng.choices([k for k, _ in kinds], weights=[w for _, w in kinds])[0]
        response = make(p, rng)
        if kinds is _INCORRECT_KINDS and verdict(response, p.answer) == VERDICTS[0]:
            response = _wrong_answer(p, rng)
        examples.append(JudgeExample(p.prompt, response, p.answer, verdict(response, p.answer)))
    return examples


solution = arith.column_solution
"""The worked solution keeping only some carries (`arith.column_solution`)."""


def _width(p: arith.Problem) -> int:
    return max(len(str(p.a)), len(str(p.b)))


def _right(p: arith.Problem, rng: random.Random) -> str:
    return arith.worked_solution(p.a, p.b)


def _no_carry(p: arith.Problem, rng: random.Random) -> str:
    return arith.worked_solution(p.a, p.b, carry=False)


def _some_carries(p: arith.Problem, rng: random.Random) -> str:
    """Forgets the carries of a random nonempty, proper subset of the columns (all of them for a
    one-column sum)."""
    width = _width(p)
    forgotten = rng.sample(range(width), rng.randint(1, max(1, width - 1)))
    return solution(p.a, p.b, [i not in forgotten for i in range(width)])


def _off_answer(answer: str, rng: random.Random) -> str:
    """A near miss of `answer`: off by one or ten, a digit changed, dropped or added."""
    value = int(answer)
    while True:
        how = rng.randrange(5)
        if how == 0:
            out = str(value + rng.choice((-1, 1)))
        elif how == 1:
            out = str(value + rng.choice((-10, 10)))
        elif how == 2:
            i = rng.randrange(len(answer))
            out = answer[:i] + str(rng.randrange(10)) + answer[i + 1 :]
        elif how == 3:
            i = rng.randrange(len(answer))
            out = answer[:i] + answer[i + 1 :]
        else:
            i = rng.randrange(len(answer) + 1)
            out = answer[:i] + str(rng.randrange(10)) + answer[i:]
        if out and not out.startswith("-") and out == str(int(out)) and out != answer:
            return out


def _wrong_answer(p: arith.Problem, rng: random.Random) -> str:
    steps, _, _ = arith.worked_solution(p.a, p.b).rpartition(":")
    return f"{steps}:{_off_answer(p.answer, rng)}"


def _wrong_step(p: arith.Problem, rng: random.Random) -> str:
    """The right final answer after one column sum written one or two off."""
    steps_text, _, answer = arith.worked_solution(p.a, p.b).rpartition(":")
    steps = steps_text.split(",")
    i = rng.randrange(len(steps))
    lhs, _, column = steps[i].rpartition("=")
    off = rng.choice((1, 2))
    wrong = int(column) - off if int(column) >= off and rng.random() < 0.5 else int(column) + off
    steps[i] = f"{lhs}={wrong}"
    return ",".join(steps) + f":{answer}"


def _cut_off(p: arith.Problem, rng: random.Random) -> str:
    """A solution (right or carry-free) cut off before its colon, or now and then inside the
    final answer."""
    text = rng.choice((_right, _no_carry))(p, rng)
    colon = text.rindex(":")
    end = rng.randrange(colon + 1) if rng.random() < 0.8 else rng.randrange(colon + 1, len(text))
    return text[:end]


def _garbage(p: arith.Problem, rng: random.Random) -> str:
    """Nothing, junk alone, or a solution that goes on past its answer."""
    junk = "".join(rng.choices(_JUNK, k=rng.randint(1, 12)))
    how = rng.randrange(3)
    if how == 0:
        return ""
    if how == 1:
        return junk
    return rng.choice((_right, _no_carry))(p, rng) + rng.choice(",+= ") + junk


Kind = Callable[[arith.Problem, random.Random], str]
_CORRECT_KINDS: list[tuple[Kind, float]] = [(_right, 3.0), (_wrong_step, 1.0)]
_INCORRECT_KINDS: list[tuple[Kind, float]] = [
    (_no_carry, 2.0),
    (_some_carries, 1.0),
    (_wrong_answer, 2.0),
    (_cut_off, 1.0),
    (_garbage, 1.0),
]
