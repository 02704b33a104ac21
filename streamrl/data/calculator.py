"""The built-in agent task: products of two- and three-digit numbers, answered with a tool.

The prompt is `123*45=`. The tiny built-in model cannot multiply in its head, but it can call the
`calculate` tool and copy the result into its answer:

    <|user|>123*45=<|end|><|assistant|><call>calculate("123*45")</call><|end|>   (sampled)
    <|tool|>5535<|end|><|assistant|>                                               (context)
    5535<|end|>                                                                    (sampled)

The episode succeeds when its final answer is the product. The warm start imitates a *noisy
teacher*: it calls the tool in only `teacher_tool_use` of its answers (otherwise it writes a
guess of the right length), and when it does, it copies the result with its last digit dropped
in `teacher_miscopy` of them. The warm-started policy knows the format and usually calls the tool,
but its greedy habit is the sloppy copy, so held-out success starts near 0. What RL must teach is
using the tool well: call it, and copy all of its result. Held-out problems are operand pairs
never seen in training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from streamrl.data.arith import sample_pairs


@dataclass(frozen=True)
class Product:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}*{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    @property
    def call(self) -> str:
        """The tool call that solves it, in the built-in chat format."""
        return f'<call>calculate("{self.a}*{self.b}")</call>'


def sample_products(num: int, *, digits: int, seed: int, split: str) -> list[Product]:
    """`num` products of operands with 2 to `digits` digits, from the `train` or `eval` split
    (the held-out pairs are the addition task's: a deterministic hash of the pair)."""
    if digits < 2:
        raise ValueError(f"the calculator task needs data.digits >= 2, got {digits}")
    rng = random.Random(f"calculator-{seed}-{split}")
    pairs = sample_pairs(num, lo=10, hi=10**digits - 1, rng=rng, split=split, eval_fraction=0.1)
    return [Product(a, b) for a, b in pairs]


@dataclass(frozen=True)
class TeacherEpisode:
    """What the noisy teacher does: its turns (each closed by the end-of-turn token) and, when
    it calls the tool, the tool's result between them."""

    turns: list[str]
    tool_result: str | None


def teacher_episode(
    problem: Product, rng: random.Random, *, tool_use: float, miscopy: float
) -> TeacherEpisode:
    if rng.random() >= tool_use:  # a guess of the right length, in its head
        width = len(problem.answer)
        guess = str(rng.randint(10 ** (width - 1), 10**width - 1))
        return TeacherEpisode([guess], None)
    result = problem.answer
    copied = result[:-1] if rng.random() < miscopy and len(result) > 1 else result
    return TeacherEpisode([problem.call, copied], result)
