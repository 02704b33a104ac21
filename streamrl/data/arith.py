"""The built-in task: multi-digit addition, answered with a short worked solution.

A response works column by column from the units and ends with the answer after a colon:
`37+85=` -> `7+5=12,3+8+1=12:122`. The rule reward checks the number after the last colon.
Responses are reasoning traces, several times longer than the answer, as in real RL
post-training where generation, not the prompt, dominates the work.

Why this task shows that RL works: the warm start imitates a *noisy teacher* that, in
`teacher_forget_carry` of its solutions, never carries (`3+8=11` instead of `3+8+1=12`, and
no leading overflow digit, so 37+85 -> 12). The warm-started policy knows the format and every column sum, and sometimes
carries, but its greedy solution to a carry problem is wrong. Only the reward (exact match with
the true sum) can tell it which habit is right, so held-out greedy accuracy rising from about
the carry-free fraction of problems (~0.3 for two digits) to near 1.0 is learning that came
from RL, not from imitation. Held-out evaluation uses operand pairs never seen in training.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def is_eval_pair(a: int, b: int, eval_fraction: float) -> bool:
    """Deterministic split: a pair is held out when its hash falls under `eval_fraction`."""
    h = zlib.crc32(f"{a},{b}".encode()) % 10_000
    return h < eval_fraction * 10_000


def sample_problems(
    num: int, *, digits: int, seed: int, split: str, eval_fraction: float = 0.1
) -> list[Problem]:
    """Draw `num` problems with operands of up to `digits` digits from the `train` or `eval` split."""
    rng = random.Random(f"{seed}-{split}")
    pairs = sample_pairs(
        num, lo=0, hi=10**digits - 1, rng=rng, split=split, eval_fraction=eval_fraction
    )
    return [Problem(a, b) for a, b in pairs]


def sample_pairs(
    num: int, *, lo: int, hi: int, rng: random.Random, split: str, eval_fraction: float
) -> list[tuple[int, int]]:
    """`num` operand pairs in [lo, hi] drawn from `rng`, each of the `train` or `eval` split
    (`is_eval_pair`) as `split` asks."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    out: list[tuple[int, int]] = []
    want_eval = split == "eval"
    while len(out) < num:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if is_eval_pair(a, b, eval_fraction) == want_eval:
            out.append((a, b))
    return out


def worked_solution(a: int, b: int, *, carry: bool = True) -> str:
    """Column-by-column solution ending in `:answer`; `carry=False` is the noisy teacher's habit
    of dropping every carry, including the last column's overflow (99+99 -> 88)."""
    return column_solution(a, b, [carry] * max(len(str(a)), len(str(b))))


def column_solution(a: int, b: int, keep_carry: Sequence[bool]) -> str:
    """The worked solution of a+b in which the carry out of column i (from the units) is kept
    when `keep_carry[i]`, and dropped otherwise; the last column's carry is the answer's leading
    overflow digit. All kept is the right solution, none kept the noisy teacher's habit."""
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    if len(keep_carry) != width:
        raise ValueError(
            f"keep_carry needs one flag per column of {a}+{b} ({width}), got {keep_carry}"
        )
    carry_in, steps, total = 0, [], 0
    for i in range(width):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        column = x + y + carry_in
        steps.append(f"{x}+{y}" + (f"+{carry_in}" if carry_in else "") + f"={column}")
        total += (column % 10) * 10**i
        carry_out = column // 10 if keep_carry[i] else 0
        if i == width - 1:
            total += carry_out * 10**width
        carry_in = carry_out
    return ",".join(steps) + f":{total}"


def teacher_solution(problem: Problem, rng: random.Random, forget_carry: float) -> str:
    """What the noisy teacher writes: the right solution, or with probability `forget_carry`
    the one that never carries."""
    return worked_solution(problem.a, problem.b, carry=rng.random() >= forget_carry)


def has_carry(a: int, b: int) -> bool:
    return worked_solution(a, b, carry=False) != worked_solution(a, b)
