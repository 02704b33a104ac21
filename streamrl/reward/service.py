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
from streamrl.api.reward import RewardResult
from streamrl.bus.transform import TransformRole
from streamrl.reward.combine import Part, combine
from streamrl.reward.judge import verdict_of
from streamrl.reward.sandbox import ScoreTask

CONSUMER = "reward"
MAX_REPORTED = 5  # distinct reasons a reward role logs; later ones are only counted

log = logging.getLogger(__name__)


def score_rows(
    scorer,
    tokenizer,
    rows: Sequence[Mapping[str, Any]],
    invalid_penalty: float | None,
    *,
    remote=None,
    remote_weight: float = 1.0,
    judge_weight: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Each row's reward fields: the reward functions' result (`scorer`, None for none), the
    `remote` service's and the judge's verdict (the rows' `judge` field, when `judge_weight`
    is set), combined by `reward/combine.py`."""
    ids = [list(r[F.RESPONSE_IDS]) for r in rows]
    episodes = [r.get(F.EPISODE) for r in rows]
    # An agent episode's reward scores its final answer, not the whole transcript.
    # (An agent run's rows are all episodes: their transcripts are not decoded.)
    decoded = (
        [""] * len(rows) if all(episodes) else tokenizer.batch_decode(ids, skip_special_tokens=True)
    )
    texts = [e["final_text"] if e else text for e, text in zip(episodes, decoded, strict=True)]
    prompts: list[str | None] = [None] * len(rows)
    batched = getattr(scorer, "batched", False)  # a TRL-style reward takes prompts and ids
    if (batched or remote is not None) and all(r.get(F.PROMPT_IDS) is not None for r in rows):
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
    parts: list[list[Part]] = [[] for _ in rows]
    if scorer is not None:
        for own, result in zip(parts, score_tasks(scorer, tasks, episodes), strict=True):
            own.append(Part("function", 1.0, result))
    else:  # an agent episode's own reward (or status) still counts
        for own, episode in zip(parts, episodes, strict=True):
            if (result := episode_result(episode)) is not None:
                own.append(Part("function", 1.0, result))
    if remote is not None:
        for own, result in zip(parts, remote.score(tasks), strict=True):
            own.append(Part(remote.name, remote_weight, result))
    if judge_weight is not None:  # the judge's unreadable verdict is its fault: no penalty
        for own, row in zip(parts, rows, strict=True):
            own.append(Part("judge", judge_weight, verdict_of(row[F.JUDGE]), penalized=False))
    updates = {}
    for row, own in zip(rows, parts, strict=True):
        combined = combine(own)
        result, value = combined.result, combined.result.value
        if result.status == "invalid_output":
            value = invalid_penalty if combined.penalized else None
        updates[row["sample_id"]] = {
            F.REWARD: value,
            F.REWARD_STATUS: result.status,
            F.REWARD_REASON: result.reason,
            F.REWARD_COMPONENTS: dict(result.components),
        }
    return updates


def score_tasks(
    scorer, tasks: Sequence[ScoreTask], episodes: Sequence[Mapping[str, Any] | None]
) -> list[RewardResult]:
    """Each task's reward: an agent episode's own where it has one (`episode_result`), else the
    scorer's, one call for all the others."""
    results = [episode_result(e) for e in episodes]
    asked = [i for i, result in enumerate(results) if result is None]
    for i, result in zip(asked, scorer.score([tasks[i] for i in asked]), strict=True):
        results[i] = result
    return results


def _scored_by_function(episode: Mapping[str, Any]) -> bool:
    return episode["status"] == "ok" and episode.get("reward") is None


def episode_result(episode: Mapping[str, Any] | None) -> RewardResult | None:
    """An agent episode's reward where the reward function is not asked: the workflow's own
    reward (with its per-turn rewards as a component), or the status of an episode that could
    not finish (timeout, infra_error: dropped and counted, never 0). None: score it."""
    if episode is None or _scored_by_function(episode):
        return None
    if episode["status"] != "ok":
        return RewardResult(None, episode["status"], episode.get("reason") or "")
    components = {"turn_rewards": float(sum(episode.get("turn_rewards") or []))}
    return RewardResult(float(episode["reward"]), "ok", "", components)


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
        episodes: bool = False,
        remote=None,
        remote_weight: float = 1.0,
        judge_weight: float | None = None,
    ):
        super().__init__(bus, max_rows=max_rows, lease_s=lease_s)
        if getattr(scorer, "batched", False) or remote is not None:
            self.consumes = (*type(self).consumes, F.PROMPT_IDS)
        if episodes:  # an agent run: each row's episode outcome (`episode_result`)
            self.consumes = (*self.consumes, F.EPISODE)
        if judge_weight is not None:  # the judge role's verdict, added into the reward
            self.consumes = (*self.consumes, F.JUDGE)
        self.scorer = scorer
        self.remote = remote
        self.remote_weight = remote_weight
        self.judge_weight = judge_weight
        self.tokenizer = tokenizer
        self.invalid_penalty = invalid_penalty
        self._reported: set[tuple[str, str | None]] = set()

    def compute(self, rows):
        updates = score_rows(
            self.scorer,
            self.tokenizer,
            rows,
            self.invalid_penalty,
            remote=self.remote,
            remote_weight=self.remote_weight,
            judge_weight=self.judge_weight,
        )
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
        restarts = self.scorer.num_restarts if self.scorer is not None else 0
        return {**super().stats(), "restarts": restarts}

    def close(self) -> None:
        for part in (self.scorer, self.remote):
            if part is not None:
                part.close()
