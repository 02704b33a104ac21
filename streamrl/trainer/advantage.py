"""The advantage role: turns the rewards of complete groups into advantages.

Per group it shapes the rewards (DAPO overlong penalty, KL in the reward, clipping, online
normalisation), applies dynamic sampling (a group whose rewards are all equal is dropped:
advantage None), and runs the configured estimator (`algos/advantages.py`). Sequence-level
estimators write one float per sample; REINFORCE++ and GAE write one per response token, and GAE
also writes the `returns` the critic learns from.

Estimators with batch statistics (batch-scaled GRPO, REINFORCE++, GAE whitening, online reward
normalisation) wait for the whole batch; the others handle each group as soon as it is scored.
Only samples with a reward enter the baseline; the others get advantage 0 and the trainer drops
them with their reward status.

The online reward normaliser is the role's only state; `NormaliserLog` keeps it in the run
directory (`reward_norm.json`) so that a resumed or restarted role carries on with it.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from streamrl.api import fields as F
from streamrl.bus.batches import BatchCollector
from streamrl.bus.transform import TransformRole
from streamrl.config.schema import AdvantageConfig, AlgorithmConfig, KLConfig, ShapingConfig
from streamrl.trainer.algos import advantages as A
from streamrl.trainer.algos import shaping
from streamrl.trainer.algos.losses import kl_estimate

CONSUMER = "advantage"
TOKEN_LEVEL = ("reinforce_pp", "gae")
NORMALISER_FILE = "reward_norm.json"


@dataclass(frozen=True)
class AdvantageSettings:
    """What the advantage role reads: the config's `algorithm.advantage`, `algorithm.kl` and
    `algorithm.shaping` sections as they are, whether dynamic sampling is on, and the longest
    response (the overlong penalty's end)."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    dynamic_sampling: bool = False
    max_new_tokens: int = 0

    @classmethod
    def of(cls, algorithm: AlgorithmConfig, max_new_tokens: int) -> AdvantageSettings:
        return cls(
            advantage=algorithm.advantage,
            kl=algorithm.kl,
            shaping=algorithm.shaping,
            dynamic_sampling=algorithm.dynamic_sampling.enabled,
            max_new_tokens=max_new_tokens,
        )

    @property
    def estimator(self) -> str:
        return self.advantage.estimator

    @property
    def kl_in_reward_coef(self) -> float:
        """The KL's weight in the reward (0 when the KL is in the loss or off)."""
        return self.kl.coef if self.kl.in_reward else 0.0

    @property
    def whole_batch(self) -> bool:
        """True when the estimator needs statistics over the whole batch."""
        if self.shaping.reward_norm or self.estimator in (
            "reinforce_pp",
            "reinforce_pp_baseline",
            "gae",
        ):
            return True
        return self.estimator == "grpo" and self.advantage.scale == "batch"

    def consumes(self) -> tuple[str, ...]:
        fields = [F.REWARD, F.RESPONSE_IDS, F.ROLLOUT_LOGPROBS]
        if self.kl_in_reward_coef > 0:
            fields.append(F.REF_LOGPROBS)
        if self.estimator == "gae":
            fields.append(F.VALUES)
        return tuple(fields)


def _padded(seqs: Sequence[Any], width: int) -> torch.Tensor:
    out = torch.zeros(len(seqs), width, dtype=torch.float64)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(np.asarray(s, dtype=np.float64))
    return out


def advantage_fields(
    rows: Sequence[Mapping[str, Any]],
    settings: AdvantageSettings,
    normaliser: shaping.RewardNormaliser | None = None,
) -> dict[str, dict[str, Any]]:
    """Advantages (and GAE returns) for rows holding one or more complete groups."""
    s = settings
    by_group: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        by_group[r["group_id"]].append(r)
    # Every row gets every output field (the critic waits for `returns` on each row it acks).
    default = {F.ADVANTAGES: 0.0} | ({F.RETURNS: None} if s.estimator == "gae" else {})
    updates: dict[str, dict[str, Any]] = {r["sample_id"]: dict(default) for r in rows}
    kept: list[Mapping[str, Any]] = []
    for members in by_group.values():
        scored = [r for r in members if r[F.REWARD] is not None]
        if s.dynamic_sampling and not shaping.informative([float(r[F.REWARD]) for r in scored]):
            for r in scored:
                updates[r["sample_id"]][F.ADVANTAGES] = None
            continue
        kept.extend(scored)
    if not kept:
        return updates

    lengths = [len(r[F.RESPONSE_IDS]) for r in kept]
    width = max(max(lengths), 1)
    mask_bt = _padded([np.ones(n) for n in lengths], width)
    rewards_b = torch.tensor([float(r[F.REWARD]) for r in kept], dtype=torch.float64)
    if s.shaping.overlong_cache is not None:
        rewards_b += torch.tensor(
            [
                shaping.overlong_penalty(
                    n, max_len=s.max_new_tokens, cache_len=s.shaping.overlong_cache
                )
                for n in lengths
            ],
            dtype=torch.float64,
        )
    rewards_b = shaping.clip_rewards(rewards_b, s.shaping.reward_clip)
    if normaliser is not None:
        rewards_b = normaliser(rewards_b)
    kl_bt = None
    if s.kl_in_reward_coef > 0:
        behav_bt = _padded([r[F.ROLLOUT_LOGPROBS] for r in kept], width)
        ref_bt = _padded([r[F.REF_LOGPROBS] for r in kept], width)
        kl_bt = kl_estimate(behav_bt, ref_bt, s.kl.estimator) * mask_bt
    group_b = torch.tensor(_group_indices(kept))

    if s.estimator in TOKEN_LEVEL:
        token_rewards = A.outcome_token_rewards(rewards_b, mask_bt, kl_bt, s.kl_in_reward_coef)
        if s.estimator == "reinforce_pp":
            adv_bt = A.masked_whiten(A.returns_to_go(token_rewards), mask_bt, s.advantage.std_eps)
            returns_bt = None
        else:
            values_bt = _padded([r[F.VALUES] for r in kept], width)
            adv_bt, returns_bt = A.gae(
                token_rewards, values_bt, mask_bt, gamma=s.advantage.gamma, lam=s.advantage.lam
            )
            adv_bt = A.masked_whiten(adv_bt, mask_bt, s.advantage.std_eps)
        for i, r in enumerate(kept):
            n = lengths[i]
            update = {F.ADVANTAGES: adv_bt[i, :n].numpy().astype(np.float32)}
            if returns_bt is not None:
                update[F.RETURNS] = returns_bt[i, :n].numpy().astype(np.float32)
            updates[r["sample_id"]] = update
        return updates

    if kl_bt is not None:
        rewards_b = rewards_b - s.kl_in_reward_coef * kl_bt.sum(-1)
    if s.estimator == "grpo":
        adv_b = A.grpo_advantages(
            rewards_b,
            group_b,
            scale=s.advantage.scale,
            unbiased=s.advantage.std_unbiased,
            eps=s.advantage.std_eps,
        )
    elif s.estimator == "rloo":
        adv_b = A.rloo_advantages(rewards_b, group_b)
    elif s.estimator == "reinforce_pp_baseline":
        adv_b = A.reinforce_pp_baseline_advantages(rewards_b, group_b, eps=s.advantage.std_eps)
    else:
        raise ValueError(f"unknown advantage estimator {s.estimator!r}")
    for r, a in zip(kept, adv_b.tolist(), strict=True):
        updates[r["sample_id"]] = {F.ADVANTAGES: float(a)}
    return updates


def _group_indices(rows: Sequence[Mapping[str, Any]]) -> list[int]:
    index: dict[str, int] = {}
    return [index.setdefault(r["group_id"], len(index)) for r in rows]


class NormaliserLog:
    """The online reward normaliser's statistics, saved in the run directory after every batch.

    The file holds the latest state and, in the order batches were first normalised, the state
    just before each one. A run resumed from a checkpoint whose next step is k normalises
    batches k, k+1, ... again, so it restores the state before the first of them (exact with
    max_staleness=0; with more, a refill round of an earlier batch normalised after that point
    is left out). A role restarted in the middle of a run restores the latest state, since the
    rows it already wrote are not served again.
    """

    def __init__(self, normaliser: shaping.RewardNormaliser, path: Path, *, keep_batches: int):
        self.normaliser = normaliser
        self.path = path
        self.keep_batches = keep_batches
        self.before: list[tuple[int, dict[str, float]]] = []  # (batch, state before it)

    def restore(self, next_step: int | None) -> None:
        """Load the state before batch `next_step` (a resume), or the latest one (None)."""
        if not self.path.exists():
            return
        saved = json.loads(self.path.read_text())
        self.before = [(int(b), state) for b, state in saved["before"]]
        state = saved["latest"]
        if next_step is not None:
            later = [st for b, st in self.before if b >= next_step]
            state = later[0] if later else state
            self.before = [(b, st) for b, st in self.before if b < next_step]
        self.normaliser.load_state_dict(state)

    def start_batch(self, batch_index: int) -> None:
        """Called before rows of `batch_index` update the statistics."""
        if all(b != batch_index for b, _ in self.before):
            self.before.append((batch_index, self.normaliser.state_dict()))
            oldest = max(b for b, _ in self.before) - self.keep_batches
            self.before = [(b, st) for b, st in self.before if b >= oldest]

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"latest": self.normaliser.state_dict(), "before": self.before}))
        tmp.replace(self.path)


class AdvantageRole(TransformRole):
    """Args (beyond the bus and lease settings):
    groups_per_batch: groups of one feeder batch (or refill round), for whole-batch estimators.
    normaliser_path: where `NormaliserLog` keeps the reward normaliser (None: not saved).
    resume_step: the checkpoint's next step when this run resumed one, else None.
    keep_batches: how many batches back the log must reach (staleness + checkpoint interval).
    """

    consumer = CONSUMER
    sampler = "group"

    def __init__(
        self,
        bus,
        weights,
        settings: AdvantageSettings,
        *,
        groups_per_batch: int,
        max_staleness: int,
        max_rows: int,
        lease_s: float,
        normaliser_path: Path | None = None,
        resume_step: int | None = None,
        keep_batches: int = 8,
    ):
        super().__init__(bus, max_rows=max_rows, lease_s=lease_s)
        self.settings = settings
        self.consumes = settings.consumes()
        self.normaliser = (
            shaping.RewardNormaliser(settings.shaping.reward_norm_momentum)
            if settings.shaping.reward_norm
            else None
        )
        self.normaliser_log = None
        if self.normaliser is not None and normaliser_path is not None:
            self.normaliser_log = NormaliserLog(
                self.normaliser, normaliser_path, keep_batches=keep_batches
            )
            if bus.stats()["acked"].get(CONSUMER, 0) > 0:  # restarted during this run
                self.normaliser_log.restore(None)
            elif resume_step is not None:
                self.normaliser_log.restore(resume_step)
        self.batches = BatchCollector(
            bus,
            weights,
            consumer=CONSUMER,
            fields=self.consumes,
            groups_per_batch=groups_per_batch,
            max_staleness=max_staleness,
            max_rows=max_rows,
            lease_s=lease_s,
        )

    def compute(self, rows):
        return advantage_fields(rows, self.settings, self.normaliser)

    def step(self) -> bool:
        if not self.settings.whole_batch:
            return super().step()
        complete = self.batches.poll(wait_s=self.long_poll_s)
        if complete is None:
            return self.batches.claimed
        key, rows = complete
        start = time.perf_counter()
        if self.normaliser_log is not None:
            self.normaliser_log.start_batch(key[0])
        updates = self.compute(rows)
        if self.normaliser_log is not None:  # saved before the trainer can see the batch
            self.normaliser_log.save()
        self.batches.ack_batch(key, writes=updates)
        self.busy_s += time.perf_counter() - start
        return True
