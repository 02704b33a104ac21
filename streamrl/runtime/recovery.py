"""Recovering a lost trainer or bus shard in place (`runtime.ray.trainer_recovery=in_place`): only
the trainer restarts, from its latest checkpoint, while rollout, reward, advantage and the rest
keep running.

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

A lost bus shard is rebuilt the same way, around the trainer's resume. Ray restarts the shard
empty under the same handle (`RayBus.create(restartable=True)`) and retries the calls that
were in flight; they wait in the new process until it is restored. The supervisor sees the new
pid and calls `recover_shard` (`runtime/ray_runtime.py`):

| step | what | why |
| --- | --- | --- |
| 1 | the trainer and the feeder are killed (`Supervisor.halt`) | nothing more is trained, acked or added while the shard is rebuilt |
| 2 | the shard gets the bus's consumers and checkpoint c's freed ids (`RayBus.restore_shard`); its held calls go through | roles keep claiming; their acks, writes and releases of rows the shard lost are counted (`lost_calls`) and ignored |
| 3 | the trainer's rows are settled as for its own loss (above) and it resumes from c | every row it trained after c is trained again, so none of the shard's lost rows is missing from the model and none counts twice; logs are truncated to c |
| 4 | the shard's rows of batches c .. (the feeder's next batch - 1) are rebuilt from the data and re-added under their own sample ids, without a capacity check (`lost_rows`, `RayBus.restore_rows`) | rollout regenerates them; rows before c are in the checkpoint, rows on the other shards are kept and trained again from the same values |
| 5 | the trainer and a feeder starting at c are started again | the feeder's adds of batches c.. are no-ops up to where it was |

Rollout, reward, advantage and the rest keep running throughout; the restart counts against the
shard's `runtime.ray.max_restarts`. A critic keeps its state (the rows it valued on the lost
shard are valued again when regenerated). Without in-place recovery, or when Ray cannot restart
the shard (its node lost), the controller restarts every role from c (`BusLost`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

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


def lost_rows(ctx, bus, shard: int, batches: Iterable[int]) -> list[dict[str, Any]]:
    """The prompt rows of `batches` that live on bus shard `shard`: what it held of them when
    it was lost, rebuilt from the data (the feeder's batches depend only on the seed and the
    batch index), under their own sample ids."""
    from streamrl.data.role import make_feeder

    feeder = make_feeder(ctx)
    return [
        row for b in batches for row in feeder.batch(b) if bus.shard_of(row["group_id"]) == shard
    ]
