"""PPO mini-batches and epochs: several optimizer updates from one generated batch.

With `algorithm.ppo_epochs` > 1 or `algorithm.mini_batch_groups` below the batch, the trainer
holds a step's rows until the whole batch is in (the accounting still streams), then:

    1. pi_old: one no-grad forward over the batch, before any update, gives each token's
       log-prob under the weights the batch starts from (the proximal policy of
       `off_policy.proximal=current`; it also measures the trainer/engine log-prob mismatch);
    2. for each epoch, the batch's groups in a shuffled order, cut into mini-batches of
       `mini_batch_groups` groups; each mini-batch is accumulated in micro-batches and applied
       as one optimizer update, normalised over that mini-batch alone;
    3. the last update ends the version: `trainer.steps`, staleness and the learning-rate
       schedule keep counting generated batches, and every update of a batch uses its rate.

Which groups form which mini-batch is a function of the group ids, the run seed and the version
alone, never of the order the groups arrived in, so `max_staleness=0` still equals the
synchronous loop and a resumed or replayed step makes the same updates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamrl.api import fields as F


@dataclass(frozen=True)
class UpdatePlan:
    """How many optimizer updates a batch makes (`algorithm.ppo_epochs`, `mini_batch_groups`)."""

    epochs: int = 1
    mini_batch_groups: int | None = None
    """Groups per update; None: the whole batch."""
    micro_batch_rows: int = 64
    """Rows per forward/backward (`algorithm.micro_batch_groups` x `rollout.group_size`)."""
    seed: int = 0

    def several(self, batch_groups: int) -> bool:
        """Whether a batch of `batch_groups` groups makes more than one update."""
        per_epoch = self.mini_batch_groups is not None and self.mini_batch_groups < batch_groups
        return self.epochs > 1 or per_epoch


def mini_batches(
    group_ids: Sequence[str], size: int | None, *, epochs: int, seed: int, version: int
) -> list[list[str]]:
    """The step's updates in order, each the ids of its groups: per epoch a permutation of the
    sorted ids (seeded by run seed and version), cut into runs of `size` (the last may be
    shorter). At least one (maybe empty) update, so an untrained step still ends its version."""
    ids = sorted(group_ids)
    if not ids:
        return [[]]
    size = size or len(ids)
    rng = np.random.default_rng([seed, version])
    out = []
    for _ in range(epochs):
        order = [ids[i] for i in rng.permutation(len(ids))]
        out.extend(order[lo : lo + size] for lo in range(0, len(order), size))
    return out


def train_updates(
    learner,
    groups: Mapping[str, Sequence[Mapping[str, Any]]],
    skipped_shares: Mapping[str, float],
    plan: UpdatePlan,
) -> dict[str, float]:
    """Make the optimizer updates of one batch; returns its `train/*` metrics (without the
    prefix). `groups`: each group's rows to compute (sorted within the group for a fixed
    layout); `skipped_shares`: each group's normaliser share of rows left out of the forward
    (zero advantage)."""
    rows = {gid: sorted(members, key=lambda r: r["sample_id"]) for gid, members in groups.items()}
    flat = [r for gid in sorted(rows) for r in rows[gid]]
    step = plan.micro_batch_rows
    prox: list[np.ndarray] = []
    for lo in range(0, len(flat), step):
        prox.extend(learner.logprobs(flat[lo : lo + step]))
    mismatch, tokens = 0.0, 0
    for r, p in zip(flat, prox, strict=True):
        mismatch += float(np.abs(p - np.asarray(r[F.ROLLOUT_LOGPROBS], dtype=np.float32)).sum())
        tokens += len(p)
    if learner.settings.off_policy.proximal == "current":
        with_prox = {id(r): {**r, "prox_logprobs": p} for r, p in zip(flat, prox, strict=True)}
        rows = {gid: [with_prox[id(r)] for r in members] for gid, members in rows.items()}

    updates = mini_batches(
        sorted(set(rows) | set(skipped_shares)),
        plan.mini_batch_groups,
        epochs=plan.epochs,
        seed=plan.seed,
        version=learner.version,
    )
    outs, passes = [], 0
    for k, group_ids in enumerate(updates):
        batch = [r for gid in group_ids for r in rows.get(gid, [])]
        skipped = sum(skipped_shares.get(gid, 0.0) for gid in group_ids)
        learner.accumulate(batch[:step], num_skipped_tokens=skipped)
        for lo in range(step, len(batch), step):
            learner.accumulate(batch[lo : lo + step])
        passes += -(-len(batch) // step)
        outs.append(learner.step(ends_version=k == len(updates) - 1))
    merged = merge_updates(outs, plan.epochs)
    merged["logprob_mismatch"] = mismatch / max(tokens, 1)
    merged["micro_batches"] = passes
    return merged


def merge_updates(outs: Sequence[Mapping[str, float]], epochs: int) -> dict[str, float]:
    """One batch's metrics from its updates': loss and gradient norm averaged over updates,
    token statistics averaged over every token of every update, `skipped_nonfinite` counted."""
    from streamrl.trainer.learner import STAT_MEANS

    tokens = [o["trained_tokens"] for o in outs]
    total = max(sum(tokens), 1.0)
    out = {
        "loss": sum(o["loss"] for o in outs) / len(outs),
        "grad_norm": sum(o["grad_norm"] for o in outs) / len(outs),
        "lr": outs[-1]["lr"],
        "skipped_nonfinite": sum(o["skipped_nonfinite"] for o in outs),
        "trained_tokens": sum(tokens) / epochs,  # each epoch trains every token once
        "optimizer_steps": float(len(outs)),
    }
    for key in STAT_MEANS:
        out[key] = sum(o[key] * t for o, t in zip(outs, tokens, strict=True)) / total
    for key in (k for k in outs[0] if k.startswith("moe/")):  # a mixture-of-experts model's
        out[key] = sum(o.get(key, 0.0) * t for o, t in zip(outs, tokens, strict=True)) / total
    return out
