"""The rollout role: claims prompt rows it may generate now, generates, writes responses back.

Admission control is the staleness dial: a row of batch b may be generated only once the engine
holds policy version >= b - max_staleness. Finished samples are written as soon as the engine
reports them (streaming), with per-token log-probs and policy versions. Weights are pulled from
the weight-sync service before each batch and, when enabled, between decode steps (in flight).
Where the runtime lets calls block (threads and Ray modes), a thread watches for publishes
(`wait_newer`), so the decode loop asks for weights only when there are new ones instead of
making a round trip every `inflight_poll_s`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams
from streamrl.api.role import RoleBase
from streamrl.media.prepare import row_media

CONSUMER = "rollout"


class PublishWatcher:
    """A daemon thread that keeps `published`, the newest weight version it has seen, current by
    blocking in the weight service until each next publish. `healthy` is false while the
    service's calls fail (the rollout then polls as it would without a watcher)."""

    def __init__(self, weights, known: int, wait_s: float = 1.0):
        self.published = known
        self.healthy = True
        self._weights = weights
        self._wait_s = wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rollout-weights", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                newest = self._weights.wait_newer(self.published, self._wait_s)
                self.published, self.healthy = max(self.published, newest), True
            except SystemExit:  # Ray shutting down this process under a pending call
                return
            except Exception:  # noqa: BLE001 - retried; meanwhile the decode loop polls
                self.healthy = False
                self._stop.wait(self._wait_s)

    def close(self) -> None:
        """Stop watching and wait for the thread to end: at most `wait_s` and a margin, the time
        its current wait in the weight service takes to return. A thread left inside a Ray call
        when the process shuts Ray down can abort the process on exit."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self._wait_s + 5.0)


def to_requests(rows: Sequence[Mapping[str, Any]]) -> list[GenerationRequest]:
    """The engine's requests for claimed rows (a multimodal prompt's with its media, read back
    from the run's media store)."""
    media = row_media(rows) or [None] * len(rows)
    return [
        GenerationRequest(r["sample_id"], [int(t) for t in r[F.PROMPT_IDS]], m)
        for r, m in zip(rows, media, strict=True)
    ]


def result_fields(result: GenerationResult) -> dict[str, Any]:
    fields = {
        F.RESPONSE_IDS: np.asarray(result.response_ids, dtype=np.int64),
        F.ROLLOUT_LOGPROBS: np.asarray(result.logprobs, dtype=np.float32),
        F.VERSIONS: np.asarray(result.versions, dtype=np.int64),
        F.FINISH_REASON: result.finish_reason,
    }
    if F.ROUTED_EXPERTS in result.extra:  # an engine capturing routes (`routing_replay`)
        fields[F.ROUTED_EXPERTS] = result.extra[F.ROUTED_EXPERTS]
    return fields


class RolloutRole(RoleBase):
    claims: tuple[str, ...] = (F.PROMPT_IDS,)
    """Fields a claimed row must have (the prompt; an agent's episode also reads the answer)."""

    def __init__(
        self,
        bus,
        weights,
        engine,
        *,
        params: SamplingParams,
        max_staleness: int,
        max_rows: int,
        inflight_updates: bool,
        lease_s: float,
        multimodal: bool = False,
    ):
        if multimodal:  # a vision-language policy: each row's media come with its prompt
            self.claims = (*self.claims, F.MEDIA)
        self.bus = bus
        self.weights = weights
        self.engine = engine
        self.params = params
        self.max_staleness = max_staleness
        self.max_rows = max_rows
        self.inflight_updates = inflight_updates
        self.lease_s = lease_s
        self.inflight_poll_s = 0.02
        self.flush_rows = 64
        self._last_poll = 0.0
        self._watcher: PublishWatcher | None = None
        self.busy_s = 0.0  # claim to ack: generating and writing results
        self.weights_s = 0.0  # fetching and loading weights between batches
        self.wait_s = 0.0  # claims that found nothing admissible, and the waits after them
        self.claim_s = 0.0  # claims that found rows
        self.num_tokens = 0
        self.num_samples = 0

    def pull_weights(self):
        """Return (version, tensors) if the weight service has a newer version than the engine."""
        self._last_poll = time.perf_counter()
        return self.weights.fetch_newer(self.engine.version)

    def poll_inflight(self):
        """Between decode steps: newer weights if there are any. With a watcher, only when it has
        seen a newer publish; without one, ask the service at most every `inflight_poll_s`."""
        watcher = self._watcher
        if watcher is not None and watcher.healthy:
            if watcher.published <= self.engine.version:
                return None
        elif time.perf_counter() - self._last_poll < self.inflight_poll_s:
            return None
        return self.pull_weights()

    def _start_watcher(self) -> None:
        if (
            self._watcher is None
            and self.inflight_updates
            and self.long_poll_s > 0  # a runtime where blocking calls are fine
        ):
            self._watcher = PublishWatcher(self.weights, self.engine.version)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None

    def step(self) -> bool:
        self._start_watcher()
        started = time.perf_counter()
        update = self.pull_weights()
        if update is not None:
            self.engine.load_weights(*update)
        claim_started = time.perf_counter()
        self.weights_s += claim_started - started
        newest_allowed = self.engine.version + self.max_staleness
        lease = self.bus.claim(
            CONSUMER,
            self.claims,
            self.max_rows,
            sampler="fifo",
            where={"batch_index": ("<=", newest_allowed)},
            lease_s=self.lease_s,
            wait_s=self.long_poll_s,
        )
        if lease is None:
            # Nothing admissible: the next batch waits for newer weights (admission control),
            # so wait for a publish inside the weight service rather than polling for it.
            self.weights.wait_newer(self.engine.version, self.long_poll_s)
            self.wait_s += time.perf_counter() - claim_started
            return False
        start = time.perf_counter()
        self.claim_s += start - claim_started

        finished: dict[str, dict[str, Any]] = {}

        def emit(updates: Mapping[str, dict[str, Any]]) -> None:
            # Stream finished samples out in chunks: early enough for the next roles, few
            # enough bus calls to stay cheap.
            finished.update(updates)
            self.num_tokens += sum(len(u[F.RESPONSE_IDS]) for u in updates.values())
            self.num_samples += len(updates)
            if len(finished) >= self.flush_rows:
                self.bus.write(dict(finished))
                finished.clear()

        self.generate_rows(lease.rows, emit)
        self.bus.ack(lease.lease_id, writes=dict(finished) if finished else None)  # the last chunk
        self.busy_s += time.perf_counter() - start
        return True

    def generate_rows(self, rows, emit) -> None:
        """Generate the claimed `rows`, handing `emit` each finished sample's fields as soon as
        it is done ({sample_id: fields})."""
        self.engine.generate(
            to_requests(rows),
            self.params,
            on_finished=lambda results: emit({r.request_id: result_fields(r) for r in results}),
            weight_poll=self.poll_inflight if self.inflight_updates else None,
        )

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "busy_s": self.busy_s,
            "weights_s": self.weights_s,
            "claim_s": self.claim_s,
            "wait_s": self.wait_s,
            "tokens": self.num_tokens,
            "samples": self.num_samples,
            "version": self.engine.version,
        }
        # An engine that balances over several engines says how it spread the requests.
        per_engine = getattr(self.engine, "requests_per_engine", None)
        if per_engine is not None:
            stats["requests_per_engine"] = per_engine
        return stats
