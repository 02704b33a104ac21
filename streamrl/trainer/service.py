"""The trainer role: trains batch k from whole groups as they complete, then publishes version k+1.

Groups of batch k are claimed as soon as their advantages are ready and trained as micro-batches
(gradient accumulation), so a slow group never holds back the rest. When all groups of batch k
are in, one optimizer step makes version k+1, the weights go to the weight-sync service, and
only then are the rows acknowledged. A sample staler than `max_staleness` (cannot happen under
admission control, checked anyway) is dropped and counted, never trained.

With PPO mini-batches and epochs (`updates.py`) the groups are held until the batch is complete
and the step then makes several optimizer updates; the version still advances once per batch.

With dynamic sampling the step trains exactly `batch_prompts` informative groups: the trainer
adds refill rounds of batch k to the bus itself while too few have signal, and trains a group
once its rank among the informative ones is certain (`dynamic_sampling.py`).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from streamrl.api import fields as F
from streamrl.api.bus import BusFullError
from streamrl.api.role import LoopPolicy
from streamrl.bus.leases import LeaseKeeper
from streamrl.metrics.memory import rank_memory_metrics
from streamrl.metrics.stats import summarize
from streamrl.trainer.dynamic_sampling import SURPLUS, StepGroups, group_informative, groups_of
from streamrl.trainer.updates import UpdatePlan, train_updates

log = logging.getLogger(__name__)

CONSUMER = "trainer"
TRAIN_FIELDS = [
    F.PROMPT_IDS,
    F.RESPONSE_IDS,
    F.ROLLOUT_LOGPROBS,
    F.VERSIONS,
    F.FINISH_REASON,
    F.REWARD,
    F.REWARD_STATUS,
    F.REWARD_COMPONENTS,
    F.ADVANTAGES,
]


def samples_digest(rows: Sequence[Mapping[str, Any]]) -> str:
    """Order-free fingerprint of a step's samples (ids and sampled tokens), to compare runs."""
    h = hashlib.sha256()
    for sample_id, tokens in sorted(
        (r["sample_id"], np.asarray(r[F.RESPONSE_IDS]).tolist()) for r in rows
    ):
        h.update(f"{sample_id}:{tokens};".encode())
    return h.hexdigest()[:16]


def num_trained_tokens(row: Mapping[str, Any]) -> int:
    """Tokens of a row the loss covers: its response, or an episode's sampled tokens only."""
    mask = row.get(F.LOSS_MASK)
    return len(row[F.RESPONSE_IDS]) if mask is None else int(np.sum(mask))


def component_means(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """`reward_components/<name>`: the mean of each named reward component over the rows whose
    reward reported it."""
    return _means("reward_components", [r.get(F.REWARD_COMPONENTS) for r in rows])


def episode_means(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """`episode/<name>`: the mean of each agent-episode metric (turns, tool_calls, tool_errors,
    malformed_calls, sampled_tokens, splits, seconds) over the rows of agent episodes."""
    return _means("episode", [(r.get(F.EPISODE) or {}).get("metrics") for r in rows])


def _means(prefix: str, dicts: Sequence[Mapping[str, float] | None]) -> dict[str, float]:
    parts: dict[str, list[float]] = {}
    for values in dicts:
        for name, value in (values or {}).items():
            parts.setdefault(name, []).append(float(value))
    return {f"{prefix}/{name}": sum(v) / len(v) for name, v in sorted(parts.items())}


def is_zero(advantage: Any) -> bool:
    """True for a zero advantage, scalar or per token."""
    return not np.any(np.asarray(advantage, dtype=np.float64))


def drop_reason(
    r: Mapping[str, Any], version: int, max_staleness: int | None, mask_truncated: bool
) -> str | None:
    """Why a row received by the trainer at `version` is not trained (None: it is)."""
    if r[F.REWARD] is None:
        return str(r[F.REWARD_STATUS])
    staleness = version - int(np.min(r[F.VERSIONS])) if len(r[F.VERSIONS]) else 0
    if max_staleness is not None and staleness > max_staleness:
        return "stale"
    if not np.isfinite(np.asarray(r[F.ROLLOUT_LOGPROBS], dtype=np.float64)).all():
        return "nonfinite_logprobs"  # an engine fault; never train on it
    if r[F.ADVANTAGES] is None:  # dynamic sampling: a group with no signal
        return "zero_variance"
    if mask_truncated and r[F.FINISH_REASON] == "length":
        return "truncated"  # overlong filtering: no loss, no normaliser share
    return None


def untrained_step_message(step: int, num_rows: int, dropped: Mapping[str, int]) -> str:
    """Why step `step` trained none of its `num_rows` samples, with what to change."""
    reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(dropped.items()))
    hint = {
        "truncated": "every response reached rollout.max_new_tokens under "
        "algorithm.shaping.mask_truncated: raise the one or turn off the other",
        "stale": "raise rollout.max_staleness or speed up the trainer",
    }.get(max(dropped, key=dropped.get) if dropped else "", "see samples/dropped_<reason>")
    return (
        f"step {step} trained none of its {num_rows} samples (dropped: {reasons or 'none'}); "
        f"{hint}. Said once; later such steps show in the metrics only."
    )


class BatchTrainer:
    """Micro-batch accounting for one training step; shared by the trainer role and the sync loop.

    `updates`: PPO mini-batches and epochs (None: one optimizer update per batch, its micro-batches
    trained as they arrive)."""

    def __init__(
        self,
        learner,
        *,
        skip_zero_advantage: bool,
        max_staleness: int | None,
        mask_truncated: bool = False,
        updates: UpdatePlan | None = None,
    ):
        self.learner = learner
        self.skip_zero_advantage = skip_zero_advantage
        self.max_staleness = max_staleness
        self.mask_truncated = mask_truncated
        self.updates = updates
        self.warned_untrained = False  # the first step that trains no sample says why, once
        self._reset()

    def _reset(self) -> None:
        self.rows_seen: list[Mapping[str, Any]] = []
        self.trained_ids: list[str] = []
        self.dropped: Counter[str] = Counter()
        self.busy_s = 0.0
        self.micro_batches = 0
        self.computed_rows = 0  # through forward and backward (trained_ids counts skipped ones too)
        # The micro-batches and dropped rows as received, as slices of `rows_seen` (what the
        # sample record keeps: `record.Event`).
        self.events: list[tuple[str, str | None, int, int]] = []
        # With `updates`: the rows to compute and the skipped rows' normaliser shares, by group,
        # held for `finish`.
        self.held: dict[str, list[Mapping[str, Any]]] = {}
        self.held_shares: dict[str, float] = {}

    def train_microbatch(self, rows: Sequence[Mapping[str, Any]]) -> None:
        start = time.perf_counter()
        trainable, skipped_tokens = [], 0.0
        first = len(self.rows_seen)
        for r in rows:
            self.rows_seen.append(r)
            reason = drop_reason(r, self.learner.version, self.max_staleness, self.mask_truncated)
            if reason is not None:
                self.dropped[reason] += 1
                continue
            self.trained_ids.append(r["sample_id"])
            if self.skip_zero_advantage and is_zero(r[F.ADVANTAGES]):
                share = self.learner.settings.normaliser_share(num_trained_tokens(r))
                skipped_tokens += share
                if self.updates is not None:
                    gid = r["group_id"]
                    self.held_shares[gid] = self.held_shares.get(gid, 0.0) + share
            else:
                trainable.append(r)
                if self.updates is not None:
                    self.held.setdefault(r["group_id"], []).append(r)
        if self.updates is None:
            self.learner.accumulate(trainable, num_skipped_tokens=skipped_tokens)
        self.events.append(("train", None, first, len(self.rows_seen)))
        self.micro_batches += 1
        self.computed_rows += len(trainable)
        self.busy_s += time.perf_counter() - start

    def drop_rows(self, rows: Sequence[Mapping[str, Any]], reason: str) -> None:
        """Rows of this step that are not trained (dynamic sampling's surplus): counted, and
        part of the step's metrics and digest."""
        self.events.append(("drop", reason, len(self.rows_seen), len(self.rows_seen) + len(rows)))
        self.rows_seen.extend(rows)
        self.dropped[reason] += len(rows)

    def finish(self) -> dict[str, Any]:
        """Optimizer step; returns the step's metrics, the ids it trained, and what it received
        (`sample_events`: the rows and micro-batch boundaries, for the sample record; the trainer's
        hooks take them out of the record)."""
        start = time.perf_counter()
        if self.updates is None:
            out = {**self.learner.step(), "optimizer_steps": 1.0}
        else:
            out = train_updates(self.learner, self.held, self.held_shares, self.updates)
            self.micro_batches = int(out.pop("micro_batches"))
        self.busy_s += time.perf_counter() - start
        rows = self.rows_seen
        rewards = [float(r[F.REWARD]) for r in rows if r[F.REWARD] is not None]
        staleness = [
            self.learner.version - 1 - int(np.min(r[F.VERSIONS]))
            for r in rows
            if len(r[F.VERSIONS])
        ]
        lengths = [len(r[F.RESPONSE_IDS]) for r in rows]
        metrics: dict[str, Any] = {f"train/{k}": v for k, v in out.items()}
        reward = summarize(rewards)
        metrics.update({"reward/mean": reward["mean"], "reward/std": reward["std"]})
        metrics.update(component_means(rows))
        metrics.update(episode_means(rows))
        metrics["response/length_mean"] = summarize(lengths)["mean"]
        metrics["response/tokens"] = sum(lengths)
        metrics["response/truncated_frac"] = sum(
            r[F.FINISH_REASON] == "length" for r in rows
        ) / max(len(rows), 1)
        st = summarize(staleness)
        metrics.update(
            {"staleness/mean": st["mean"], "staleness/max": st["max"], "staleness/hist": staleness}
        )
        metrics["samples/trained"] = len(self.trained_ids)
        metrics["train/micro_batches"] = self.micro_batches
        metrics["samples/computed"] = self.computed_rows
        metrics["samples/dropped"] = sum(self.dropped.values())
        for reason, n in self.dropped.items():
            metrics[f"samples/dropped_{reason}"] = n
        metrics["samples/zero_advantage_frac"] = sum(
            r[F.ADVANTAGES] is not None and is_zero(r[F.ADVANTAGES]) for r in rows
        ) / max(len(rows), 1)
        metrics["time/trainer_busy_s"] = self.busy_s
        metrics.update(rank_memory_metrics(self.learner.peak_memory_bytes()))
        trained_ids = self.trained_ids
        if rows and not trained_ids and not self.warned_untrained:
            self.warned_untrained = True
            log.warning(untrained_step_message(self.learner.version, len(rows), self.dropped))
        digest = samples_digest(rows)
        events = self.events
        self._reset()
        return {
            "metrics": metrics,
            "trained_ids": trained_ids,
            "samples_digest": digest,
            "sample_events": (rows, events),
        }


class TrainerRole:
    """Args:
    batch_prompts: groups trained per step.
    refill: with dynamic sampling, the feeder whose `batch(k, round_index)` makes the refill
        rounds of batch k (None: every group of batch k is trained, no refill).
    max_rounds: with `refill`, the most rounds (the feeder's batch included) per step.
    """

    def __init__(
        self,
        bus,
        weights,
        batch_trainer: BatchTrainer,
        *,
        extra_fields: Sequence[str] = (),
        batch_prompts: int,
        micro_batch_rows: int,
        lease_s: float,
        start_step: int = 0,
        refill=None,
        max_rounds: int = 1,
    ):
        self.bus = bus
        self.weights = weights
        self.trainer = batch_trainer
        self.fields = TRAIN_FIELDS + list(extra_fields)
        self.batch_prompts = batch_prompts
        self.micro_batch_rows = micro_batch_rows
        self.lease_s = lease_s
        # With `policy.overlapping_calls` (runtimes whose bus client may be called from two
        # threads), the next micro-batch is claimed in a second thread while this one trains:
        # the claim's round trip then overlaps the forward and backward instead of following them.
        self.policy = LoopPolicy()
        self._prefetch: Future | None = None
        self._claimer: ThreadPoolExecutor | None = None
        self.current = start_step
        self.refill = refill
        self.max_rounds = max_rounds
        self._leases: list[str] = []
        self._groups: set[str] = set()
        self._plan = self._new_plan()
        self._held: dict[str, list[Mapping[str, Any]]] = {}  # claimed groups not yet decided
        self._tried_round: tuple[int, int] | None = None  # (step, round) last tried
        self._step_started = time.perf_counter()
        # Keeps the step's claimed rows leased while it waits for slow groups (or refills).
        self._keeper = LeaseKeeper(bus, lease_s)

    def configure(self, policy: LoopPolicy) -> None:
        self.policy = policy

    def reset_step_clock(self) -> None:
        """The next step's time (`time/step_s`) counts from now. Called when the driver loop
        starts (not when this role was built: in Ray mode the other roles start after it) and
        after each step's evaluation and checkpoint, which are timed on their own."""
        self._step_started = time.perf_counter()

    def _new_plan(self) -> StepGroups | None:
        if self.refill is None:
            return None
        plan = StepGroups(target=self.batch_prompts, max_rounds=self.max_rounds)
        plan.add_round(self.refill.group_ids(self.current))  # the feeder adds round 0
        return plan

    def _add_round(self) -> bool:
        """Put the next refill round of the current batch on the bus, if it has room now. The
        first try of each round skips the room check: after a trainer recovery the round may
        be on the bus already, and adding it again is a no-op that needs no room."""
        plan = self._plan
        first_try = self._tried_round != (self.current, plan.rounds)
        self._tried_round = (self.current, plan.rounds)
        if not first_try and not self.bus.can_add(self.refill.batch_prompts):
            return False
        try:
            self.bus.add_rows(self.refill.batch(self.current, plan.rounds))
        except BusFullError:  # no room yet (or the feeder took it first): retried later
            return False
        plan.add_round(self.refill.group_ids(self.current, plan.rounds))
        return True

    def _take(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Record claimed groups; train (or set aside) those whose verdict is now certain."""
        for gid, members in groups_of(rows).items():
            self._plan.record(gid, group_informative(members))
            self._held[gid] = members
        train: list[Mapping[str, Any]] = []
        for gid, verdict in self._plan.decide().items():
            members = self._held.pop(gid)
            if verdict == SURPLUS:
                self.trainer.drop_rows(members, "surplus")
            else:  # trained, or dropped by the batch trainer (advantage None) and counted there
                train.extend(members)
        for lo in range(0, len(train), self.micro_batch_rows):
            self.trainer.train_microbatch(train[lo : lo + self.micro_batch_rows])

    def _claim(self):
        """Claim a micro-batch of whole groups of the current batch (None: none ready)."""
        return self.bus.claim(
            CONSUMER,
            self.fields,
            self.micro_batch_rows,
            sampler="group",
            where={"batch_index": ("==", self.current)},
            lease_s=self.lease_s,
            wait_s=self.policy.wait_s,
        )

    def close(self) -> None:
        """Stop the prefetching thread; a claim still in flight is released."""
        if self._claimer is None:
            return
        pending, self._prefetch = self._prefetch, None
        try:
            lease = pending.result() if pending is not None else None
            if lease is not None:
                self.bus.release(lease.lease_id)
        except Exception as e:  # noqa: BLE001 - closing after a failure: its lease expires
            log.warning("trainer: prefetched claim not released: %s", e)
        self._claimer.shutdown()
        self._claimer = None

    def step(self) -> dict[str, Any] | None:
        """Train one ready micro-batch of the current batch; return a step record when the step
        completed, else None (the caller checks `progressed` for whether any work was done)."""
        self.progressed = False
        if self._plan is not None and self._plan.wants_round:
            self.progressed = self._add_round()
        self._keeper.keep(self._leases)
        if self._prefetch is not None:
            lease, self._prefetch = self._prefetch.result(), None
        else:
            lease = self._claim()
        if lease is None:
            return None
        self.progressed = True
        self._leases.append(lease.lease_id)
        # A group served again after its lease expired (a stall) is already in this step.
        rows = [r for r in lease.rows if r["group_id"] not in self._groups]
        self._groups.update(r["group_id"] for r in rows)
        if self._plan is None:
            if len(self._groups) < self.batch_prompts:
                self._prefetch_claim()
            self.trainer.train_microbatch(rows)
            if len(self._groups) < self.batch_prompts:
                return None
        else:
            self._take(rows)
            if self._plan.wants_round:
                self._add_round()
            if not self._plan.complete:
                return None
        assert not self._held, f"groups without a verdict at the end of a step: {list(self._held)}"
        record = self.trainer.finish()
        if self._plan is not None:
            record["metrics"].update(self._plan.metrics(self.current + 1))
        record["step"] = self.current
        leases, self._leases, self._groups = self._leases, [], set()
        self.current += 1
        self._plan = self._new_plan()
        if self._plan is None:  # the next step's first claim overlaps the publish
            self._prefetch_claim()
        published = time.perf_counter()
        self.weights.publish(self.trainer.learner.version, self.trainer.learner.named_weights())
        record["metrics"]["time/weight_publish_s"] = time.perf_counter() - published
        for lease_id in leases:
            self.bus.ack(lease_id)
        record["metrics"]["time/step_s"] = time.perf_counter() - self._step_started
        self._step_started = time.perf_counter()
        return record

    def _prefetch_claim(self) -> None:
        """Claim the next micro-batch in the claiming thread: of the current step, or, right after
        a step ends, the first of the next one (it then overlaps the weight publish)."""
        if not self.policy.overlapping_calls:
            return
        if self._claimer is None:
            self._claimer = ThreadPoolExecutor(1, thread_name_prefix="trainer-claim")
        self._prefetch = self._claimer.submit(self._claim)
