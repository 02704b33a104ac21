"""Recovering a lost trainer in place (`runtime.ray.trainer_recovery=in_place`): only the trainer
restarts, from its latest checkpoint, while rollout, reward, advantage and the rest keep running.

The trainer resumes at checkpoint step c, so the bus must still hold every row it trained after
c: the trainer defers its acks (`bus/deferred.py`, in its process) until a checkpoint covers their
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

from streamrl.api import fields as F

log = logging.getLogger(__name__)


def settle_trainer_rows(bus, consumer: str, next_step: int) -> tuple[int, int]:
    """After the trainer's loss: hand back the leases of its bus consumer, and ack the rows of
    batches before `next_step` (the checkpoint it resumes from covers them). Returns (leases,
    rows)."""
    released = bus.release_consumer(consumer)
    acked = 0
    while True:
        lease = bus.claim(
            consumer, [F.PROMPT_IDS], 4096, where={"batch_index": ("<", next_step)}, lease_s=60.0
        )
        if lease is None:
            return released, acked
        bus.ack(lease.lease_id)
        acked += len(lease.rows)
