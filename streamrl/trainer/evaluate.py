"""Held-out evaluation: greedy decoding of the eval prompts, scored by the run's reward rule."""

from __future__ import annotations

from collections.abc import Sequence

from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.data.dataset import PromptRow
from streamrl.reward.scoring import score_text


def greedy_accuracy(
    engine,
    tokenizer,
    rows: Sequence[PromptRow],
    prompt_ids: Sequence[list[int]],
    reward_fn,
    max_new_tokens: int,
) -> float:
    """Fraction of `rows` whose greedy answer earns reward 1 (exact match for the built-in task)."""
    requests = [GenerationRequest(f"eval-{i}", ids) for i, ids in enumerate(prompt_ids)]
    results = engine.generate(
        requests, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    )
    correct = 0
    for row, res in zip(rows, results, strict=True):
        text = tokenizer.decode(res.response_ids, skip_special_tokens=True)
        result = score_text(reward_fn, text, row)
        correct += int(result.status == "ok" and (result.value or 0.0) >= 1.0)
    return correct / max(len(rows), 1)
