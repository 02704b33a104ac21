"""Contract of a rollout engine: token ids in, token ids with log-probs and versions out.

Every engine (builtin, vLLM, SGLang) speaks this protocol, so the rollout service never touches
text. A request can be resumed as a continuation (prompt plus the tokens generated so far), which
is how in-flight weight updates and multi-turn agents both work. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. temperature 0 means greedy.

    The truncation controls shape the distribution tokens are drawn from (after temperature):
    `min_p` drops tokens below `min_p` times the most likely one's probability, `top_k` keeps
    the k most likely (0: off), `top_p` the most likely ones whose probability mass reaches p.
    An engine records each token's log-prob under the distribution it drew it from, the
    truncated and renormalised one (docs/engines.md). The response ends at EOS, at a token of
    `stop_token_ids`, or at the token whose text completes one of `stop` (that token is the
    response's last, finish reason "stop")."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    seed: int = 0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    @property
    def truncated(self) -> bool:
        """Whether tokens are drawn from a truncated distribution (sampling, and a control on)."""
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0)


@dataclass
class GenerationRequest:
    """One sequence to extend. `request_id` also seeds its sampling noise, so a request draws the
    same tokens whichever batch it lands in. `media`: a multimodal prompt's preprocessed inputs
    (the processor's tensors such as `pixel_values` and `image_grid_thw`, `key` naming them, and
    `decoded`, the media as `(kind, array)` pairs for engines that run the processor
    themselves); `prompt_ids` already hold one placeholder token per vision token."""

    request_id: str
    prompt_ids: list[int]
    media: Mapping[str, Any] | None = None


@dataclass
class GenerationResult:
    request_id: str
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length"]
    extra: dict[str, Any] = field(default_factory=dict)


# Called by an engine between decode steps; returns (version, named tensors) when newer weights
# should be loaded before the next token, else None.
WeightPoll = Callable[[], "tuple[int, Mapping[str, Any]] | None"]


class Engine(Protocol):
    @property
    def version(self) -> int:
        """Policy version of the weights the engine holds now."""
        ...

    def load_weights(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        """Replace the weights (called between decode steps or batches); later tokens carry `version`."""
        ...

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        *,
        on_finished: Callable[[list[GenerationResult]], None] | None = None,
        weight_poll: WeightPoll | None = None,
    ) -> list[GenerationResult]:
        """Generate every request to EOS or `max_new_tokens`. `on_finished` receives results as
        soon as they finish (streaming); `weight_poll` is consulted between decode steps for an
        in-flight weight update. Returns all results in request order."""
        ...


# Every engine calls this first: a prompt no model can run (no tokens, or a token id outside the
# vocabulary) would otherwise fail deep inside a forward pass (an index error in the builtin
# engine, a device-side assert that takes a GPU server down, a stuck request on a server whose
# scheduler died). The whole call fails with one ValueError naming the request, before any
# request of it starts, and the engine stays usable.
def check_requests(requests: Sequence[GenerationRequest], vocab_size: int | None) -> None:
    """Raise ValueError for the first request whose prompt is empty or holds a token id outside
    [0, vocab_size); `vocab_size` None (unknown to the caller) skips only the upper bound."""
    for request in requests:
        ids = np.asarray(request.prompt_ids)  # a list, or an array read from the bus
        if ids.size == 0:
            raise ValueError(
                f"request {request.request_id!r} has an empty prompt: prompt_ids must hold at "
                "least one token id"
            )
        lowest, highest = int(ids.min()), int(ids.max())
        bound = "" if vocab_size is None else f", the model's vocabulary is [0, {vocab_size})"
        if lowest < 0:
            raise ValueError(
                f"request {request.request_id!r}: prompt token id {lowest} at position "
                f"{int(ids.argmin())} is negative; token ids are >= 0{bound}"
            )
        if vocab_size is not None and highest >= vocab_size:
            raise ValueError(
                f"request {request.request_id!r}: prompt token id {highest} at position "
                f"{int(ids.argmax())} is outside the model's vocabulary [0, {vocab_size}); "
                "was the prompt encoded with another model's tokenizer?"
            )
