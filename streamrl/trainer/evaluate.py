"""Held-out evaluation: greedy decoding of the eval prompts, scored by the run's reward function.

The reward is user code seeing model output, here as in training: it runs in the reward sandbox
(`streamrl.reward.sandbox`), so one that hangs or raises on some response costs that response
`reward.timeout_s` at most and counts it as not correct, reported, instead of stalling the
trainer that evaluates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.api.reward import RewardResult
from streamrl.data.dataset import PromptRow
from streamrl.reward.sandbox import ScoreTask

# Results that are not a score of the response (an invalid output is one: not correct).
UNSCORED = ("timeout", "infra_error")


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    """Fraction of the rows whose greedy answer earns reward 1 (exact match for the built-in task)."""
    unscored: dict[str, int] = field(default_factory=dict)
    """Responses the reward could not score, by status (`timeout`, `infra_error`): counted as
    not correct."""
    first_reason: str = ""
    """Why the first of them was not scored."""
    misses: list[tuple[int, str, RewardResult]] = field(default_factory=list)
    """(row index, response, reward result) of every response not counted correct, in row
    order: what `streamrl eval --show N` prints."""

    def unscored_text(self) -> str:
        """`N not scored (timeout 2, infra_error 1; the first: REASON)`, or '' if none."""
        if not self.unscored:
            return ""
        counts = ", ".join(f"{status} {n}" for status, n in sorted(self.unscored.items()))
        total = sum(self.unscored.values())
        return f"{total} not scored ({counts}; the first: {self.first_reason})"


def greedy_accuracy(
    engine,
    tokenizer,
    rows: Sequence[PromptRow],
    prompt_ids: Sequence[list[int]],
    scorer,
    max_new_tokens: int,
) -> EvalResult:
    """Greedy answers to `rows` from `engine`, scored by `scorer` (a `SandboxedScorer`)."""
    requests = [GenerationRequest(f"eval-{i}", ids) for i, ids in enumerate(prompt_ids)]
    results = engine.generate(
        requests, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    )
    tasks = [
        ScoreTask(
            tokenizer.decode(res.response_ids, skip_special_tokens=True), row.answer, row.extra
        )
        for row, res in zip(rows, results, strict=True)
    ]
    scores = scorer.score(tasks)
    hit = [s.status == "ok" and (s.value or 0.0) >= 1.0 for s in scores]
    failed = [s for s in scores if s.status in UNSCORED]
    return EvalResult(
        accuracy=sum(hit) / max(len(rows), 1),
        unscored=dict(Counter(s.status for s in failed)),
        first_reason=failed[0].reason if failed else "",
        misses=[
            (i, task.response, score)
            for i, (task, score, ok) in enumerate(zip(tasks, scores, hit, strict=True))
            if not ok
        ],
    )
