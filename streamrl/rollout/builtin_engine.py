"""The builtin rollout engine: continuous batching over a preallocated KV cache, in process.

It needs nothing beyond PyTorch and transformers, and drives a Llama-family decoder (Qwen3,
Qwen3-MoE, Qwen2, Llama; the built-in tiny model is a Qwen3) with its own forward pass instead
of the model's `forward` (`rollout/decoder_runner.py`: on a CPU a small model is bound by the
per-op costs that runner keeps low; `docs/benchmarks-log.md` has the figures). The file holds
the sampling, then the engine with its scheduler.

How a call to `generate` runs:

- requests take the cache's slots (at most `max_batch_size`) in request order; a slot holds one
  sequence from column 0, so sequences of any length sit side by side without padding;
- one step samples one token for every busy slot: newly admitted requests from a prefill of
  their prompts (identical prompts, as in a GRPO group, are computed once), the others from a
  decode step on their last token;
- a finished sequence frees its slot at once and the next waiting request takes it (continuous
  batching); once nobody waits, busy slots are packed to the front so that finished rows stop
  costing compute;
- before every step but the first, `weight_poll` may hand over newer weights (in-flight update):
  the running sequences are prefilled again under them, so a request continues exactly as one
  resumed with its tokens so far would (as vLLM's and SGLang's continuations do), and every
  token records the policy version that produced it.

Sampling noise is a pure function of (seed, request_id, position of the token in the sequence):
a counter-based integer hash turned into Gumbel noise, computed for the whole batch at once. A
request therefore draws the same tokens whichever batch or slot it lands in and whoever its
neighbours are, which is what lets `max_staleness=0` reproduce the synchronous loop exactly; and
a request resumed as a continuation (prompt plus its tokens so far) draws what it would have
drawn uninterrupted. Log-probs are those of the sampled token under the distribution it was
drawn from, in fp32: the temperature-scaled logits, truncated by min-p, top-k and top-p when they
are on (`rollout/sampling.py`, vLLM's order) and renormalised. Stop token ids and stop strings end
a response as EOS does (stop strings need the tokenizer, `tokenizer=`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streamrl.api.engine import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    WeightPoll,
    check_requests,
)
from streamrl.api.fields import ROUTED_EXPERTS
from streamrl.rollout.decoder_runner import DecoderRunner
from streamrl.rollout.sampling import StopStrings, stop_token_set, truncate_logits

# ---------------------------------------------------------------------------------------------
# Sampling: Gumbel-max with counter-based noise.
# ---------------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # odd: each multiply is a bijection mod 2**32; below 2**31: no int64 overflow


def request_key(seed: int, request_id: str) -> tuple[int, int]:
    """Two 32-bit words that key the sampling noise of one request under one seed."""
    digest = hashlib.blake2b(f"{seed}/{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Integer hash of int64 tensors that hold 32-bit values (xor-shift-multiply, twice)."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


@functools.lru_cache(maxsize=8)
def _vocab_hash(vocab_size: int, device: torch.device) -> torch.Tensor:
    return _mix32((torch.arange(vocab_size, device=device) + 0x9E3779B9) & _MASK32)


def gumbel_noise(keys_b2: torch.Tensor, positions_b: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [B, vocab_size]; row b is a function of (keys_b2[b], positions_b[b])."""
    row_b = _mix32(keys_b2[:, 0] ^ _mix32(keys_b2[:, 1] ^ _mix32(positions_b)))
    bits_bv = _mix32(row_b[:, None] ^ _vocab_hash(vocab_size, keys_b2.device)[None, :])
    uniform_bv = ((bits_bv >> 8).float() + 0.5) * 2.0**-24  # 24 bits, strictly inside (0, 1)
    return -torch.log(-torch.log(uniform_bv))


def sample_tokens(
    logits_bv: torch.Tensor,
    temperature: float,
    keys_b2: torch.Tensor,
    positions_b: torch.Tensor,
    params: SamplingParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sampled token (argmax at temperature 0) and its log-prob under
    log_softmax(logits / temperature), truncated by `params`' min-p, top-k and top-p (when
    sampling) and renormalised, in fp32."""
    logits_bv = logits_bv.float()
    if temperature <= 0:
        logp_bv = torch.log_softmax(logits_bv, dim=-1)
        tokens_b = logits_bv.argmax(dim=-1)
    else:
        scaled_bv = logits_bv / temperature
        if params is not None and params.truncated:
            scaled_bv = truncate_logits(scaled_bv, params)
        # A dropped token has log-prob -inf: Gumbel noise never lifts it to the argmax.
        logp_bv = torch.log_softmax(scaled_bv, dim=-1)
        # Gumbel-max: argmax(logp + g) is a draw from Categorical(exp(logp)).
        noise_bv = gumbel_noise(keys_b2, positions_b, logits_bv.shape[-1])
        tokens_b = (logp_bv + noise_bv).argmax(dim=-1)
    return tokens_b, logp_bv.gather(-1, tokens_b[:, None]).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# The engine: the protocol, slots and results.
# ---------------------------------------------------------------------------------------------


class BuiltinEngine:
    """Continuous-batching KV-cache decoding of a Llama-family transformers model in this process."""

    def __init__(
        self,
        model,
        *,
        eos_token_id: int,
        pad_token_id: int,
        max_batch_size: int = 512,
        use_onednn: bool | None = None,
        tokenizer=None,
        capture_routes: bool = False,
    ):
        self.model = model
        self.tokenizer = tokenizer  # decodes responses for stop strings; needed only for them
        self.runner = DecoderRunner(model, use_onednn=use_onednn, capture_routes=capture_routes)
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self._version = 0
        self.num_weight_updates = 0
        # True from `load_weights` to the next `generate`: the runner's packed weights are
        # current. Otherwise `generate` repacks them, as the model may have been trained in place.
        self._packed_current = False

    @property
    def version(self) -> int:
        return self._version

    @torch.no_grad()
    def load_weights(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, value in named_tensors.items():
            if name not in params:
                raise KeyError(f"weight {name!r} does not exist in the engine's model")
            params[name].copy_(
                torch.from_numpy(np.array(value)) if isinstance(value, np.ndarray) else value
            )
        self.runner.refresh()
        self._packed_current = True
        self._version = version
        self.num_weight_updates += 1

    @torch.no_grad()
    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        *,
        on_finished: Callable[[list[GenerationResult]], None] | None = None,
        weight_poll: WeightPoll | None = None,
    ) -> list[GenerationResult]:
        if not requests:
            return []
        check_requests(requests, self.runner.text.embed_tokens.weight.shape[0])
        return _Generation(self, requests, params, on_finished, weight_poll).run()


class _Generation:
    """One `generate` call: which request each cache slot holds, and what the requests produced.

    Per slot (tensors over the cache's rows): `request` (index into the requests, -1 when free),
    `length` (tokens in the cache row), `count` (tokens generated) and `last` (the last sampled
    token, fed at the next decode step). Slots from `num_used` on are all free. Per request:
    `tokens`, `logprobs`, `versions` [requests, max_new_tokens], filled as tokens are sampled.
    """

    def __init__(self, engine: BuiltinEngine, requests, params: SamplingParams, on_finished, poll):
        self.engine, self.runner = engine, engine.runner
        self.requests, self.params = requests, params
        self.on_finished, self.weight_poll = on_finished, poll
        self.device = device = engine.runner.device
        num = len(requests)
        self.max_new = params.max_new_tokens
        keys = [request_key(params.seed, r.request_id) for r in requests]
        self.keys = torch.tensor(keys, dtype=torch.long, device=device)
        stop_ids = sorted(stop_token_set(params, engine.eos_token_id))
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
        self.stops = StopStrings(engine.tokenizer, params.stop) if params.stop else None
        self.tokens = torch.zeros((num, self.max_new), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((num, self.max_new), dtype=torch.float32, device=device)
        self.versions = torch.zeros((num, self.max_new), dtype=torch.long, device=device)
        self.stopped = torch.zeros(num, dtype=torch.bool, device=device)  # ended by a stop
        self.results: list[GenerationResult | None] = [None] * num
        self.num_admitted = 0
        num_slots = min(engine.max_batch_size, num)
        self.request = torch.full((num_slots,), -1, dtype=torch.long, device=device)
        self.length = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.count = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.last = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.num_used = 0
        if not engine._packed_current:  # the model may have been trained in place
            self.runner.refresh()
        engine._packed_current = False
        max_len = max(len(r.prompt_ids) for r in requests) + self.max_new
        self.runner.allocate(num_slots, max_len)
        # With routing capture: per request, the experts of each position it ran through the
        # model [requests, positions, moe layers, k], from the latest pass that ran it (after an
        # in-flight update, the new weights' prefill: `streamrl.models.moe.merge_routes`).
        self.routes = None
        if self.runner.capture_routes:
            moe_layers = sum(w.moe is not None for w in self.runner.layers)
            top_k = next(w.moe.top_k for w in self.runner.layers if w.moe is not None)
            self.routes = torch.zeros((num, max_len, moe_layers, top_k), dtype=torch.uint8)

    def run(self) -> list[GenerationResult]:
        first = True
        while self.num_admitted < len(self.requests) or bool((self.request >= 0).any()):
            if self.weight_poll is not None and not first:
                update = self.weight_poll()
                if update is not None:
                    self.engine.load_weights(*update)
                    self._recompute_cache()
            first = False
            self.step()
        assert all(r is not None for r in self.results)
        return self.results  # type: ignore[return-value]

    def _recompute_cache(self) -> None:
        """After an in-flight update: prefill the running sequences again under the new weights
        (prompt plus every token but the last, which the next decode step feeds), so that no
        later token attends to keys and values the old weights computed."""
        slots = (self.request[: self.num_used] >= 0).nonzero().flatten()
        if not len(slots):
            return
        indices = self.request[slots].tolist()
        tokens = self.tokens[indices].tolist()
        sequences = [
            [*self.requests[i].prompt_ids, *tokens[k][: n - 1]]
            for k, (i, n) in enumerate(zip(indices, self.count[slots].tolist(), strict=True))
        ]
        self.runner.prefill(slots, sequences, [self.requests[i].media for i in indices])
        self._keep_prefill_routes(indices)  # the later tokens are computed over these

    def _keep_prefill_routes(self, requests: Sequence[int]) -> None:
        """With routing capture: keep the routes of the prefill just run, of `requests`' own
        sequences from position 0 (replacing any an earlier pass left)."""
        if self.routes is not None:
            for i, routes in zip(requests, self.runner.routes, strict=True):
                self.routes[i, : len(routes)] = routes.to("cpu", torch.uint8)

    def step(self) -> None:
        """Sample one token for every busy slot; hand over the sequences that finish."""
        num_decoding = self.num_used
        decoding = self.request[:num_decoding] >= 0
        logits = None
        if bool(decoding.any()):
            logits = self.runner.decode(self.last[:num_decoding], self.length[:num_decoding])
            if self.routes is not None:  # the fed tokens' positions
                rows = decoding.nonzero().flatten()
                where = (self.request[rows].cpu(), self.length[rows].cpu())
                self.routes[where] = self.runner.routes[rows].to("cpu", torch.uint8)
            self.length[:num_decoding] += decoding
        new_slots = self._admit()
        if len(new_slots):
            requests = self.request[new_slots].tolist()
            prompts = [self.requests[i].prompt_ids for i in requests]
            media = [self.requests[i].media for i in requests]
            prefilled = self.runner.prefill(new_slots, prompts, media)
            self._keep_prefill_routes(requests)
            self.length[new_slots] = torch.tensor([len(p) for p in prompts], device=self.device)
            decoded, logits = logits, prefilled.new_zeros((self.num_used, prefilled.shape[-1]))
            if decoded is not None:
                logits[:num_decoding] = decoded
            logits[new_slots] = prefilled

        used = self.num_used
        request = self.request[:used]
        busy = request >= 0
        # The token sampled now sits at position `length` of its sequence (the cache holds
        # everything before it): that position, not the step, keys its noise.
        tokens, logprobs = sample_tokens(
            logits,
            self.params.temperature,
            self.keys[request.clamp(min=0)],
            self.length[:used],
            self.params,
        )
        rows, columns = request[busy], self.count[:used][busy]
        self.tokens[rows, columns] = tokens[busy]
        self.logprobs[rows, columns] = logprobs[busy]
        self.versions[rows, columns] = self.engine.version
        self.last[:used] = tokens
        self.count[:used] += busy
        stopped = torch.isin(tokens, self.stop_ids)
        if self.stops is not None:
            stopped |= self._stop_strings(rows, columns, busy)
        done = busy & (stopped | (self.count[:used] >= self.max_new))
        self.stopped[rows] = stopped[busy]
        if bool(done.any()):
            self._finish(done.nonzero().flatten())
        if self.num_admitted == len(self.requests):
            self._pack()

    def _stop_strings(
        self, rows: torch.Tensor, columns: torch.Tensor, busy: torch.Tensor
    ) -> torch.Tensor:
        """Per used slot: whether the token just sampled completes a stop string."""
        hit = torch.zeros_like(busy)
        tokens = self.tokens[rows].tolist()
        slots = busy.nonzero().flatten().tolist()
        for slot, row_tokens, column in zip(slots, tokens, columns.tolist(), strict=True):
            hit[slot] = self.stops.ends_here(row_tokens[: column + 1])
        return hit

    def _admit(self) -> torch.Tensor:
        """Give free slots to waiting requests, in request order; return the slots given."""
        num_waiting = len(self.requests) - self.num_admitted
        free = (self.request < 0).nonzero().flatten()[:num_waiting]
        if len(free):
            start = self.num_admitted
            self.request[free] = torch.arange(start, start + len(free), device=self.device)
            self.count[free] = 0
            self.num_admitted += len(free)
            self.num_used = max(self.num_used, int(free[-1]) + 1)
        return free

    def _finish(self, slots: torch.Tensor) -> None:
        """Build the results of the requests in `slots`, free the slots, stream the results."""
        indices = self.request[slots].tolist()
        counts = self.count[slots].tolist()
        tokens = self.tokens[indices].tolist()
        logprobs = self.logprobs[indices].tolist()
        versions = self.versions[indices].tolist()
        stopped = self.stopped[indices].tolist()
        finished = []
        for k, (i, n) in enumerate(zip(indices, counts, strict=True)):
            response = tokens[k][:n]
            result = GenerationResult(
                request_id=self.requests[i].request_id,
                response_ids=response,
                logprobs=logprobs[k][:n],
                versions=versions[k][:n],
                finish_reason="stop" if stopped[k] else "length",
            )
            if self.routes is not None:  # every position but the last token's
                ran = len(self.requests[i].prompt_ids) + n - 1
                result.extra[ROUTED_EXPERTS] = self.routes[i, :ran].numpy().copy()
            self.results[i] = result
            finished.append(result)
        self.request[slots] = -1
        if self.on_finished is not None:
            self.on_finished(finished)

    def _pack(self) -> None:
        """Once a quarter of the used slots are free (and nobody waits), move the busy ones to
        the front, so that decode steps stop computing rows that have finished."""
        used = self.num_used
        busy = (self.request[:used] >= 0).nonzero().flatten()
        if used - len(busy) < max(1, used // 4):
            return
        front = torch.arange(len(busy), device=self.device)
        moved = busy != front
        if bool(moved.any()):
            num_columns = int(self.length[busy].max())
            self.runner.move_rows(busy[moved], front[moved], num_columns)
        for state in (self.request, self.length, self.count, self.last):
            state[: len(busy)] = state[busy]
        self.request[len(busy) : used] = -1
        self.num_used = len(busy)
