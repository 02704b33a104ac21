"""The reward role: claims generated rows, scores them in a sandboxed worker, writes the result.

Every result carries a status. `invalid_output` gets the task's explicit penalty when one is
configured (and then enters the baseline); `timeout` and `infra_error` rows keep reward None:
they are left out of advantages and training and counted by reason, never scored 0.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.api import fields as F
from streamrl.bus.transform import TransformRole
from streamrl.reward.sandbox import ScoreTask

CONSUMER = "reward"
MAX_REPORTED = 5  # distinct reasons a reward role logs; later ones are only counted

log = logging.getLogger(__name__)


def score_rows(
    scorer, tokenizer, rows: Sequence[Mapping[str, Any]], invalid_penalty: float | None
) -> dict[str, dict[str, Any]]:
    ids = [list(r[F.RESPONSE_IDS]) for r in rows]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    prompts: list[str | None] = [None] * len(rows)
    batched = getattr(scorer, "batched", False)  # a TRL-style reward takes prompts and ids
    if batched and all(r.get(F.PROMPT_IDS) is not None for r in rows):
        prompts = tokenizer.batch_decode(
            [list(r[F.PROMPT_IDS]) for r in rows], skip_special_tokens=True
        )
    tasks = [
        ScoreTask(
            text,
            str(r[F.ANSWER]),
            dict(r.get(F.EXTRA) or {}),
            prompt=prompt,
            completion_ids=[int(t) for t in response_ids] if batched else None,
        )
        for text, prompt, response_ids, r in zip(texts, prompts, ids, rows, strict=True)
    ]
    updates = {}
    for row, result in zip(rows, scorer.score(tasks), strict=True):
        value = result.value
        if result.status == "invalid_output":
            value = invalid_penalty
        updates[row["sample_id"]] = {
            F.REWARD: value,
            F.REWARD_STATUS: result.status,
            F.REWARD_REASON: result.reason,
            F.REWARD_COMPONENTS: dict(result.components),
        }
    return updates


class RewardRole(TransformRole):
    consumer = CONSUMER
    consumes = (F.RESPONSE_IDS, F.ANSWER, F.EXTRA)
    """`PROMPT_IDS` too when the reward is batched (TRL's form: it takes the prompts)."""

    def __init__(
        self,
        bus,
        scorer,
        tokenizer,
        *,
        invalid_penalty: float | None,
        max_rows: int,
        lease_s: float,
    ):
        super().__init__(bus, max_rows=max_rows, lease_s=lease_s)
        if getattr(scorer, "batched", False):
            self.consumes = (*type(self).consumes, F.PROMPT_IDS)
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.invalid_penalty = invalid_penalty
        self._reported: set[tuple[str, str | None]] = set()

    def compute(self, rows):
        updates = score_rows(self.scorer, self.tokenizer, rows, self.invalid_penalty)
        for sample_id, values in updates.items():
            self._report(sample_id, values[F.REWARD_STATUS], values[F.REWARD_REASON])
        return updates

    def _report(self, sample_id: str, status: str, reason: str | None) -> None:
        """Log each distinct reason a sample could not be scored, the first few times only:
        such samples are dropped and counted (`samples/dropped_<status>`), and a reward that
        fails on every sample should not be found out from the summary alone."""
        if status not in ("timeout", "infra_error"):
            return
        key = (status, reason)
        if key in self._reported or len(self._reported) >= MAX_REPORTED:
            return
        self._reported.add(key)
        log.warning(
            "reward: sample %s not scored (%s): %s; dropped from training and counted as "
            "samples/dropped_%s (each distinct reason is logged once)",
            sample_id,
            status,
            reason,
            status,
        )

    def stats(self) -> dict[str, float]:
        return {**super().stats(), "restarts": self.scorer.num_restarts}

    def close(self) -> None:
        self.scorer.close()
