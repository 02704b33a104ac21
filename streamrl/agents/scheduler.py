"""Turns of many episodes batched into the engine's generate calls.

Episodes are coroutines; each assistant turn is a request submitted here. One engine call at a
time runs in a worker thread, over every request queued when it starts (turns of different
episodes side by side in one batch); requests that arrive during a call wait for the next one.
An episode whose turn finishes early is woken at once (the engine streams finished results), so
it calls its tools while the rest of the batch is still decoding, and its next turn joins the
next call. Short episodes therefore never wait for long ones to end.

    episode ─submit(ids)─► queue ──(priority order, at most max_batch)──► engine.generate
       ▲                                                                      │ on_finished
       └──────────────────────── future resolved ◄────────────────────────────┘

Order of the queue (`priority`): `oldest_version` first (default: a request whose episode holds
the oldest tokens is served first, so a starved episode does not run into the staleness bound),
or `fifo`. Before each call `before_call` may load newer weights; `weight_poll` is handed to the
engine for updates in flight. An engine call that raises is retried `retries` times with
exponential backoff (an engine server restarting); past them it fails only the requests in it
(their episodes get the error; the scheduler keeps serving). A request whose episode stopped
waiting for it (its turn deadline) is left out of later calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams, WeightPoll

log = logging.getLogger(__name__)

Priority = Literal["oldest_version", "fifo"]


@dataclass(order=True)
class _Queued:
    key: tuple
    request: GenerationRequest = field(compare=False)
    future: asyncio.Future = field(compare=False)


class TurnScheduler:
    """Runs queued turn requests through `engine` (see the module docstring). Use inside one
    asyncio event loop; `run()` serves until `close()`."""

    def __init__(
        self,
        engine,
        params: SamplingParams,
        *,
        priority: Priority = "oldest_version",
        max_batch: int = 512,
        before_call: Callable[[], None] | None = None,
        weight_poll: WeightPoll | None = None,
        retries: int = 0,
        backoff_s: float = 0.5,
    ):
        if priority not in ("oldest_version", "fifo"):
            raise ValueError(f"agent.priority={priority!r}: expected 'oldest_version' or 'fifo'")
        self.engine = engine
        self.params = params
        self.priority = priority
        self.max_batch = max_batch
        self.before_call = before_call
        self.weight_poll = weight_poll
        self.retries = retries
        self.backoff_s = backoff_s
        self.num_retries = 0
        self._queue: list[_Queued] = []
        self._arrived = asyncio.Event()
        self._order = itertools.count()
        self._closed = False
        self.num_calls = 0
        self.num_requests = 0

    async def generate(self, request: GenerationRequest, oldest_version: int | None) -> Any:
        """The engine's result for `request` (a `GenerationResult`), once a call has run it."""
        future = asyncio.get_running_loop().create_future()
        order = next(self._order)
        key = (order,) if self.priority == "fifo" else (_version_key(oldest_version), order)
        self._queue.append(_Queued(key, request, future))
        self._arrived.set()
        return await future

    def close(self) -> None:
        self._closed = True
        self._arrived.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            self._queue = sorted(q for q in self._queue if not q.future.done())
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            if batch:
                await self._call(loop, batch)

    async def _call(self, loop: asyncio.AbstractEventLoop, batch: list[_Queued]) -> None:
        futures = {q.request.request_id: q.future for q in batch}

        def deliver(results: list[GenerationResult]) -> None:
            for result in results:
                future = futures.pop(result.request_id, None)
                if future is not None and not future.done():
                    future.set_result(result)

        def on_finished(results: list[GenerationResult]) -> None:  # the engine's thread
            loop.call_soon_threadsafe(deliver, list(results))

        def call() -> list[GenerationResult]:
            if self.before_call is not None:
                self.before_call()
            return self.engine.generate(
                [q.request for q in batch if not q.future.done()],  # a retry: the unfinished
                self.params,
                on_finished=on_finished,
                weight_poll=self.weight_poll,
            )

        self.num_calls += 1
        self.num_requests += len(batch)
        for attempt in itertools.count():
            try:
                results = await asyncio.to_thread(call)
                break
            except Exception as error:  # noqa: BLE001 - retried, then handed to the episodes
                if attempt < self.retries:
                    self.num_retries += 1
                    log.warning(
                        "engine call failed (%s); retry %d of %d", error, attempt + 1, self.retries
                    )
                    await asyncio.sleep(self.backoff_s * 2**attempt)
                    continue
                for future in futures.values():
                    if not future.done():
                        future.set_exception(error)
                return
        deliver(results)  # any the engine did not stream


def _version_key(version: int | None) -> float:
    return float("inf") if version is None else float(version)
