"""The builtin rollout engine: batched sampling with a KV cache on any HF causal LM.

It runs wherever PyTorch runs (CPU or GPU) and needs nothing beyond transformers. Each request
draws its sampling noise from its own generator seeded by (seed, request_id), so a sample is the
same whichever batch it is generated in; that is what lets `max_staleness=0` reproduce the
synchronous loop exactly. Between decode steps the engine asks `weight_poll` for newer weights
(in-flight update); every token records the policy version that produced it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams, WeightPoll


def request_seed(seed: int, request_id: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(request_id.encode())) % (2**63 - 1)


class BuiltinEngine:
    """Static-batch KV-cache decoding on a transformers model held in this process."""

    def __init__(self, model, *, eos_token_id: int, pad_token_id: int, max_batch_size: int = 512):
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self._version = 0
        self.num_weight_updates = 0

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
        self._version = version
        self.num_weight_updates += 1

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        *,
        on_finished: Callable[[list[GenerationResult]], None] | None = None,
        weight_poll: WeightPoll | None = None,
    ) -> list[GenerationResult]:
        results: list[GenerationResult] = []
        for start in range(0, len(requests), self.max_batch_size):
            chunk = requests[start : start + self.max_batch_size]
            results.extend(self._generate_batch(chunk, params, on_finished, weight_poll))
        return results

    @torch.no_grad()
    def _generate_batch(self, requests, params, on_finished, weight_poll) -> list[GenerationResult]:
        num = len(requests)
        max_prompt = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((num, max_prompt), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((num, max_prompt), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding keeps every row's last token aligned
            input_ids[i, max_prompt - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention_mask[i, max_prompt - len(r.prompt_ids) :] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        generators = None
        if params.temperature > 0:
            generators = [
                torch.Generator().manual_seed(request_seed(params.seed, r.request_id))
                for r in requests
            ]

        tokens = torch.zeros((num, params.max_new_tokens), dtype=torch.long)
        logprobs = torch.zeros((num, params.max_new_tokens))
        versions = torch.zeros((num, params.max_new_tokens), dtype=torch.long)
        lengths = torch.zeros(num, dtype=torch.long)
        done = torch.zeros(num, dtype=torch.bool)
        results: list[GenerationResult | None] = [None] * num

        cache = None
        step_ids, step_pos = input_ids, position_ids
        for t in range(params.max_new_tokens):
            if weight_poll is not None and t > 0:
                update = weight_poll()
                if update is not None:
                    self.load_weights(*update)
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention_mask,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            next_tok, next_lp = self._sample(logits, params.temperature, generators)
            active = ~done
            tokens[active, t] = next_tok[active]
            logprobs[active, t] = next_lp[active]
            versions[active, t] = self._version
            lengths[active] += 1
            is_last = t == params.max_new_tokens - 1
            finished_now = active & ((next_tok == self.eos_token_id) | is_last)
            done |= finished_now
            if finished_now.any():
                batch = []
                for i in finished_now.nonzero().flatten().tolist():
                    results[i] = self._result(requests[i], tokens, logprobs, versions, lengths, i)
                    batch.append(results[i])
                if on_finished is not None:
                    on_finished(batch)
            if bool(done.all()):
                break
            step_ids = next_tok.unsqueeze(1)
            step_pos = step_pos[:, -1:] + 1
            ones = torch.ones((num, 1), dtype=torch.long)
            attention_mask = torch.cat([attention_mask, ones], dim=1)
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _sample(self, logits, temperature: float, generators):
        if temperature <= 0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logits.argmax(dim=-1)
            return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        # Gumbel-max with each row's own noise stream: argmax(logp + g) ~ Categorical(exp(logp)).
        uniform = torch.stack([torch.rand(logits.shape[-1], generator=g) for g in generators])
        exponential = -torch.log(uniform.clamp_min(1e-20))
        gumbel = -torch.log(exponential.clamp_min(1e-20))
        tok = (logp + gumbel).argmax(dim=-1)
        return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)

    def _result(self, request, tokens, logprobs, versions, lengths, i) -> GenerationResult:
        n = int(lengths[i])
        response = tokens[i, :n].tolist()
        return GenerationResult(
            request_id=request.request_id,
            response_ids=response,
            logprobs=logprobs[i, :n].tolist(),
            versions=versions[i, :n].tolist(),
            finish_reason="stop" if response and response[-1] == self.eos_token_id else "length",
        )
