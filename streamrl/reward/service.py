"""The reward role: claims generated rows, scores them in a sandboxed worker, writes the result.

Every result carries a status. `invalid_output` gets the task's explicit penalty when one is
configured (and then enters the baseline); `timeout` and `infra_error` rows keep reward None:
they are left out of advantages and training and counted by reason, never scored 0.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from streamrl.api import fields as F
from streamrl.reward.sandbox import ScoreTask

CONSUMER = "reward"


def score_rows(
    scorer, tokenizer, rows: Sequence[Mapping[str, Any]], invalid_penalty: float | None
) -> dict[str, dict[str, Any]]:
    texts = tokenizer.batch_decode(
        [list(r[F.RESPONSE_IDS]) for r in rows], skip_special_tokens=True
    )
    tasks = [
        ScoreTask(text, str(r[F.ANSWER]), dict(r.get(F.EXTRA) or {}))
        for text, r in zip(texts, rows, strict=True)
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
        }
    return updates


class RewardRole:
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
        self.bus = bus
        self.scorer = scorer
        self.tokenizer = tokenizer
        self.invalid_penalty = invalid_penalty
        self.max_rows = max_rows
        self.lease_s = lease_s
        self.claim_wait_s = 0.0  # set by runtimes whose bus supports long polls
        self.busy_s = 0.0

    def step(self) -> bool:
        lease = self.bus.claim(
            CONSUMER,
            [F.RESPONSE_IDS, F.ANSWER, F.EXTRA],
            self.max_rows,
            lease_s=self.lease_s,
            wait_s=self.claim_wait_s,
        )
        if lease is None:
            return False
        start = time.perf_counter()
        self.bus.write(score_rows(self.scorer, self.tokenizer, lease.rows, self.invalid_penalty))
        self.bus.ack(lease.lease_id)
        self.busy_s += time.perf_counter() - start
        return True

    def stats(self) -> dict[str, float]:
        return {"busy_s": self.busy_s, "restarts": self.scorer.num_restarts}

    def close(self) -> None:
        self.scorer.close()
