"""Recovering a lost trainer in place (`runtime.trainer_recovery=in_place`): only the trainer
restarts, from its latest checkpoint, while rollout, reward, advantage and the rest keep running.

The trainer resumes at checkpoint step c, so the bus must still hold every row it trained after
c: the trainer defers its acks (`DeferredAcks`, in its process) until a checkpoint covers their
rows, and the bus's capacity grows by `trainer.checkpoint_every` batches to hold them (the
feeder, no longer bounded by capacity alone, adds a batch only once rollout may generate it).

| what | when the trainer is lost (the driver, `settle_trainer_rows` and the controller) |
| --- | --- |
| rows of batches >= c | never acked by the trainer: its leases are handed back, the new trainer trains them again from the same rows (no regeneration) |
| rows of batches < c | covered by checkpoint c; acks that died with the process are sent by the driver |
| `trained_samples.jsonl`, `metrics.jsonl` | truncated to step c, so no sample appears twice |
| weights | the DCS keeps the newest version k; the new trainer's versions c..k are not published again (object store, collective) or only to its own fresh tcp server on the same port; engines keep k until k+1 comes |
| other roles | untouched; tcp subscribers reconnect, collective members join the new trainer's group |

Why engines may keep version k of the lost trainer: the samples they draw carry its number and
their own log-probs, so staleness and the off-policy correction stay exact bookkeeping, and the
replayed steps train the very rows the lost trainer saw, so version k of the new trainer is the
old one up to floating-point order. With `trainer.checkpoint_every=0` (one checkpoint, at the
end) nothing bounds the deferred rows, so the controller restarts every role instead
(`restart_all`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from streamrl.api import fields as F
from streamrl.config.schema import Config

log = logging.getLogger(__name__)

TRAINER = "trainer"
COMMIT_THREADS = 8  # acks in flight at once when a checkpoint releases the held ones


def in_place_recovery(cfg: Config) -> bool:
    """Whether a lost trainer restarts alone (else the controller restarts every role). Only Ray
    mode supervises roles; inline and sync runs keep their bus as it was."""
    rt = cfg.runtime
    return (
        rt.mode == "ray" and rt.trainer_recovery == "in_place" and cfg.trainer.checkpoint_every > 0
    )


def held_groups(cfg: Config, groups_per_step: int) -> int:
    """Extra bus capacity for the trained rows no checkpoint covers yet."""
    return cfg.trainer.checkpoint_every * groups_per_step if in_place_recovery(cfg) else 0


def feeder_bound(cfg: Config, weights, start_step: int) -> Callable[[], int] | None:
    """The newest batch the feeder may add while rows are held for recovery: what rollout may
    generate now (version + max_staleness), the bound the bus's capacity sets otherwise."""
    if not in_place_recovery(cfg):
        return None
    return lambda: max(weights.latest_version(), start_step) + cfg.rollout.max_staleness


class DeferredAcks:
    """The trainer's view of the bus: acks wait for `commit()`, called once a checkpoint is on
    disk; meanwhile their leases are renewed so the rows stay the trainer's. Everything else
    goes straight to the bus."""

    def __init__(self, bus, lease_s: float):
        self._bus = bus
        self.lease_s = lease_s
        self._held: list[tuple[str, Sequence[str] | None]] = []
        self._renewed = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)

    def ack(
        self,
        lease_id: str,
        sample_ids: Sequence[str] | None = None,
        *,
        writes: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        if writes:  # fields go out now; only the ack waits for the checkpoint
            self._bus.write(writes)
        self._held.append((lease_id, sample_ids))

    def claim(self, *args: Any, **kwargs: Any):
        self._keep_leases()
        return self._bus.claim(*args, **kwargs)

    def commit(self) -> int:
        """Send the held acks (the latest checkpoint covers their rows); returns how many.

        A checkpoint's worth of leases (`checkpoint_every` steps of micro-batches) is acked
        several at a time: one after the other, their round trips held the trainer up for most
        of a step at each checkpoint."""
        held, self._held = self._held, []
        with ThreadPoolExecutor(max_workers=min(COMMIT_THREADS, max(len(held), 1))) as pool:
            for done in [pool.submit(self._bus.ack, *ack) for ack in held]:
                done.result()  # a failed ack raises here, after the others were sent
        return len(held)

    def _keep_leases(self) -> None:
        if time.monotonic() - self._renewed < self.lease_s / 3:
            return
        self._renewed = time.monotonic()
        for lease_id, _ in self._held:
            try:
                self._bus.renew(lease_id, self.lease_s)
            except ValueError as e:  # expired while the trainer stalled: the ack still counts
                log.debug("deferred lease %s not renewed: %s", lease_id, e)


def settle_trainer_rows(bus, next_step: int) -> tuple[int, int]:
    """After the trainer's loss: hand its leases back, and ack the rows of batches before
    `next_step` (the checkpoint it resumes from covers them). Returns (leases, rows)."""
    released = bus.release_consumer(TRAINER)
    acked = 0
    while True:
        lease = bus.claim(
            TRAINER, [F.PROMPT_IDS], 4096, where={"batch_index": ("<", next_step)}, lease_s=60.0
        )
        if lease is None:
            return released, acked
        bus.ack(lease.lease_id)
        acked += len(lease.rows)
