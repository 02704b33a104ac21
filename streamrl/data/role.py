"""The feeder role: adds one batch of prompt groups to the bus whenever the bus has room.

Capacity is the backpressure: at most (max_staleness + 1) batches are in flight, and room is
left for the trainer's dynamic-sampling refills. When the trainer keeps trained rows for its
recovery in place, capacity no longer bounds how far ahead the feeder runs: the newest batch
rollout may generate does (version + max_staleness).

While the next batch may not be added yet, its prompts are encoded (a multimodal policy's
media decoded, processed and stored), so that adding it is quick when room opens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.api.role import RoleBase
from streamrl.api.run import RunContext
from streamrl.config.derived import (
    batches_per_step,
    in_place_recovery,
    multimodal,
    prompts_per_batch,
)
from streamrl.data.feeder import PromptFeeder
from streamrl.models.loading import policy_tokenizer

if TYPE_CHECKING:
    from streamrl.media.prepare import MediaPreparer


class FeederRole(RoleBase):
    """Adds batches `start_batch` .. `end_batch - 1`, leaving `reserve_groups` free for the
    trainer's refills; `newest_batch()` (if given) bounds the next batch it may add, and
    `wait_for_batch(batch, wait_s)` blocks until that batch may be admissible."""

    def __init__(
        self,
        bus,
        feeder: PromptFeeder,
        *,
        start_batch: int,
        end_batch: int,
        reserve_groups: int = 0,
        newest_batch: Callable[[], int] | None = None,
        wait_for_batch: Callable[[int, float], None] | None = None,
    ):
        self.bus = bus
        self.feeder = feeder
        self.next_batch = start_batch
        self.end_batch = end_batch
        self.reserve_groups = reserve_groups
        self.newest_batch = newest_batch
        self.wait_for_batch = wait_for_batch
        self.prepared_batch = start_batch - 1  # the newest batch whose prompts are encoded

    def step(self) -> bool:
        if self.next_batch >= self.end_batch:
            return False
        # The next batch's prompts are encoded (media prepared) while it may not be added yet,
        # so that when room opens the batch goes on the bus at once: preparing media then
        # never holds back a rollout that has room for it.
        ahead = self.prepared_batch < self.next_batch
        wait_s = 0.0 if ahead else self.long_poll_s
        # The policy version first: while it rules the next batch out, the bus is not asked.
        if self.newest_batch is not None and self.next_batch > self.newest_batch():
            if ahead:
                return self._prepare_next()
            if self.wait_for_batch is not None and wait_s > 0:
                self.wait_for_batch(self.next_batch, wait_s)
            return False
        if not self.bus.can_add(self.feeder.batch_prompts + self.reserve_groups, wait_s=wait_s):
            return self._prepare_next() if ahead else False
        self.bus.add_rows(self.feeder.batch(self.next_batch))
        self.next_batch += 1
        return True

    def _prepare_next(self) -> bool:
        self.feeder.prompts(self.next_batch)
        self.prepared_batch = self.next_batch
        return True

    def stats(self) -> dict[str, Any]:
        media = self.feeder.media
        if media is None:
            return {"next_batch": self.next_batch}
        # Preparing media is the feeder's work (off the trainer's path): its busy time and
        # counts reach the run's metrics with the other roles'.
        return {"next_batch": self.next_batch, "busy_s": media.seconds, "metrics": media.metrics()}


def make_feeder(ctx: RunContext) -> PromptFeeder:
    """The run's prompt feeder (the feeder role's, and the trainer's for refills)."""
    cfg = ctx.cfg
    return PromptFeeder(
        ctx.train_rows,
        policy_tokenizer(ctx),
        batch_prompts=prompts_per_batch(cfg),
        group_size=cfg.rollout.group_size,
        seed=cfg.data.seed,
        max_rounds=batches_per_step(cfg),
        chat_template=cfg.data.chat_template,
        media=media_preparer(ctx),
    )


def media_preparer(ctx: RunContext) -> MediaPreparer | None:
    """A vision-language policy's media preparation (processor, store, limits), else None."""
    if not multimodal(ctx.cfg):
        return None
    from streamrl.media.cache import open_cache
    from streamrl.media.load import MediaLimits
    from streamrl.media.prepare import MediaPreparer  # torch: a vision-language feeder's only
    from streamrl.models.processors import load_processor

    m = ctx.cfg.data.media
    limits = MediaLimits(
        max_pixels=m.max_pixels,
        max_frames=m.max_frames,
        max_audio_seconds=m.max_audio_seconds,
        max_media=m.max_media,
        video_fps=m.video_fps,
    )
    store = open_cache(media_store_dir(ctx.cfg))
    if m.store_max_gb is not None:
        store.limit(int(m.store_max_gb * 1e9), min_age_s=m.store_keep_min * 60)
    return MediaPreparer(load_processor(ctx.policy_dir), store, limits)


def media_store_dir(cfg) -> Path:
    """The preprocessed-media store's folder: `data.media.store_dir`, else the cache's."""
    configured = cfg.data.media.store_dir
    return Path(configured) if configured else Path(cfg.run.cache_dir) / "media"


def feeder_bound(cfg, weights, start_step: int) -> Callable[[], int] | None:
    """The newest batch the feeder may add while rows are held for recovery: what rollout may
    generate now (version + max_staleness), the bound the bus's capacity sets otherwise."""
    if not in_place_recovery(cfg):
        return None
    return lambda: max(weights.latest_version(), start_step) + cfg.rollout.max_staleness


def build(ctx: RunContext, bus, weights, *, start_step: int) -> FeederRole:
    cfg = ctx.cfg
    return FeederRole(
        bus,
        make_feeder(ctx),
        start_batch=start_step,
        end_batch=cfg.trainer.steps,
        reserve_groups=(batches_per_step(cfg) - 1) * prompts_per_batch(cfg),
        newest_batch=feeder_bound(cfg, weights, start_step),
        wait_for_batch=lambda batch, wait_s: weights.wait_newer(
            batch - cfg.rollout.max_staleness - 1, wait_s
        ),
    )
