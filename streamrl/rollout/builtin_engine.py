"""The builtin rollout engine: continuous batching over a preallocated KV cache, in process.

It needs nothing beyond PyTorch and transformers, and drives a Llama-family decoder (Qwen3,
Qwen2, Llama; the built-in tiny model is a Qwen3) with its own forward pass instead of the
model's `forward`: fused projections (prepacked for oneDNN on AVX-512 CPUs where MKL, behind
`F.linear`, runs its AVX2 kernels: about twice the throughput), about twenty tensor ops a layer
per decode step, no Python work per sequence. On a CPU a small model is bound by exactly those
costs (`docs/benchmarks-log.md` has the figures). The file holds the three parts in order:
sampling, the model runner, and the engine with its scheduler.

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from streamrl.api.engine import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    WeightPoll,
    check_requests,
)
from streamrl.api.fields import ROUTED_EXPERTS
from streamrl.models.moe import check_routable, route
from streamrl.models.onednn import onednn_linear_usable, onednn_preferred
from streamrl.rollout.sampling import StopStrings, stop_token_set, truncate_logits

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama")

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
# The model runner: a Llama-family decoder over a KV cache with one row per slot.
# ---------------------------------------------------------------------------------------------


def unsupported(config, rope_type: str | None = None) -> str | None:
    """Why the builtin engine cannot run a model of this HF config (None: it can). `rope_type`
    is the model's own (its rotary module's); by default it is read from the config."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return (
            f"the builtin engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models, got "
            f"model_type {config.model_type!r}; use one of those or rollout.engine=vllm"
        )
    if rope_type is None:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope = rope or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
    layer_types = getattr(config, "layer_types", None) or []
    if (
        config.hidden_act != "silu"
        or any(t != "full_attention" for t in layer_types)
        or rope_type not in ("default", "linear", "llama3")
    ):
        return (
            "the builtin engine needs SiLU MLPs, full attention in every layer and a "
            f"position-independent rope scaling; got hidden_act={config.hidden_act!r}, "
            f"layer_types={layer_types!r}, rope_type={rope_type!r}; use rollout.engine=vllm"
        )
    return None


class DecoderRunner:
    """Prefill and decode passes of a Llama-family causal LM over a KV cache with a row per slot.

    It reads the model's own parameters, so that updates (trainer steps on a shared model, or
    `load_weights`) reach it through `refresh`, which rebuilds what it derives from them: the
    query/key/value and gate/up projections fused into one matmul each, with the preceding
    RMSNorm's weight and (for queries) the attention scale folded in, and every projection
    weight packed for oneDNN where that is wanted and usable (`_Linear`). Per layer the cache
    holds keys and values [slots, kv_heads, max_len, head_dim]; slot s holds its sequence's
    tokens in columns [0, length_s). Activations are flat: [tokens, features].
    """

    def __init__(self, model, *, use_onednn: bool | None = None, capture_routes: bool = False):
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        reason = unsupported(model.config, getattr(rotary, "rope_type", None))
        if reason is not None:
            raise TypeError(reason)
        config = model.config
        self.model = model
        self.device = model.model.embed_tokens.weight.device
        self.dtype = model.model.embed_tokens.weight.dtype
        # Wanted (None: where it beats MKL, `model.onednn_linears="auto"`) and usable (fp32, CPU).
        wanted = onednn_preferred() if use_onednn is None else use_onednn
        self.use_onednn = wanted and onednn_linear_usable(self.device, self.dtype)
        self.head_dim = model.model.layers[0].self_attn.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.eps = config.rms_norm_eps
        # Norm weights and attention scale folded into the projections: in fp32 only
        # (`_LayerWeights`); below it the runner follows transformers' order of operations.
        self.fold = self.dtype == torch.float32
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # Mixture-of-experts layers: with `capture_routes`, every pass leaves the experts it
        # routed each of its tokens to in `routes` (prefill: one [len, layers, k] per prompt,
        # in the order given; decode: [rows, layers, k]).
        self.capture_routes = capture_routes
        self.routes: Any = None
        self.refresh()
        if capture_routes:
            experts = [w.moe.gate_up.shape[0] for w in self.layers if w.moe is not None]
            check_routable(max(experts, default=0))

    @torch.no_grad()
    def refresh(self) -> None:
        """Rebuild everything derived from the model's parameters (call after they change)."""
        self.layers = [
            _LayerWeights.of(layer, self.num_heads, self.num_kv_heads, self.use_onednn, self.fold)
            for layer in self.model.model.layers
        ]
        head = self.model.lm_head
        self.lm_head = _Linear(head.weight, head.bias, self.use_onednn)

    def allocate(self, num_slots: int, max_len: int) -> None:
        """A zeroed cache of `num_slots` rows of `max_len` tokens, and rotary tables that long."""
        shape = (num_slots, self.num_kv_heads, max_len, self.head_dim)
        # Zeros, not empty: masked columns still enter the score matmul, and 0 * NaN is NaN.
        self.k_cache = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers
        ]
        self.v_cache = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers
        ]
        rotary = self.model.model.rotary_emb
        positions = torch.arange(max_len, dtype=torch.float32, device=self.device)
        angles = positions[:, None] * rotary.inv_freq.float()[None, :]
        cos, sin = angles.cos() * rotary.attention_scaling, angles.sin() * rotary.attention_scaling
        # rotate_half(x) * [sin, sin] == roll(x, D/2) * [-sin, sin]: one op instead of three.
        self.cos = torch.cat([cos, cos], dim=-1).to(self.dtype)
        self.sin = torch.cat([-sin, sin], dim=-1).to(self.dtype)

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, num_columns: int) -> None:
        """Copy the first `num_columns` columns of cache rows `src` into rows `dst`."""
        for cache in (*self.k_cache, *self.v_cache):
            cache[dst, :, :num_columns] = cache[src, :, :num_columns]

    def prefill(self, slots: torch.Tensor, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Run the prompts into cache rows `slots`; return each one's next-token logits [n, V].

        Identical prompts are computed once (in the slot of the first) and their rows copied.
        """
        first_slot: dict[tuple[int, ...], int] = {}
        for slot, prompt in zip(slots.tolist(), prompts, strict=True):
            first_slot.setdefault(tuple(prompt), slot)
        unique = list(first_slot)
        unique_index = {prompt: i for i, prompt in enumerate(unique)}
        which = self._tensor([unique_index[tuple(p)] for p in prompts])
        first = self._tensor(list(first_slot.values()))
        lengths = self._tensor([len(p) for p in unique])
        num, width = len(unique), max(len(p) for p in unique)
        # Right padding: every pad comes after every real token of its row, so a causal mask is
        # all the masking needed, and the pads' cache columns are overwritten before use.
        padded = [list(p) + [0] * (width - len(p)) for p in unique]
        ids_n = self._tensor(padded).flatten()
        index = self._cache_index(first.repeat_interleave(width), self._arange(width).repeat(num))

        # Causal attention within each prompt, for a [group * width] block of queries per
        # (prompt, kv head) (grouped-query attention without repeating keys).
        group, dim = self.num_heads // self.num_kv_heads, self.head_dim
        future = torch.ones((width, width), dtype=torch.bool, device=self.device).triu_(1)
        causal = torch.zeros((width, width), dtype=self.dtype, device=self.device)
        causal = causal.masked_fill_(future, float("-inf")).repeat(group, 1)

        def attend(layer: int, q_nhd, k_nhd, v_nhd):
            self._write_cache(layer, index, k_nhd, v_nhd)
            if not self.fold:
                q, k, v = (
                    t.view(num, width, -1, dim).transpose(1, 2) for t in (q_nhd, k_nhd, v_nhd)
                )
                return self._fused_attention(layer, q, k, v, ~future)
            # [prompt * kv head, ..., D], queries ordered (group, position) within a block
            q, k, v = (
                t.view(num, width, self.num_kv_heads, -1, dim).permute(0, 2, 3, 1, 4)
                for t in (q_nhd, k_nhd, v_nhd)
            )
            q, k, v = (t.reshape(num * self.num_kv_heads, -1, dim) for t in (q, k, v))
            scores = torch.baddbmm(causal.expand(len(q), -1, -1), q, k.transpose(1, 2))
            out = torch.bmm(torch.softmax(scores, dim=-1), v)  # [num * kv_heads, group * width, D]
            out = out.view(num, self.num_kv_heads, group, width, dim).permute(0, 3, 1, 2, 4)
            return out.reshape(num * width, -1)

        cos, sin = self.cos[:width].repeat(num, 1), self.sin[:width].repeat(num, 1)
        hidden_nh = self._layers(ids_n, cos[:, None], sin[:, None], attend)
        logits = self._logits(hidden_nh[self._arange(num) * width + lengths - 1])
        if self.routes is not None:  # [num * width, layers, k] -> each prompt's own positions
            per_unique = [self.routes[i * width : i * width + len(p)] for i, p in enumerate(unique)]
            self.routes = [per_unique[i] for i in which.tolist()]
        source = first[which]
        copies = source != slots
        if bool(copies.any()):
            self.move_rows(source[copies], slots[copies], width)
        return logits[which]

    def decode(self, ids_b: torch.Tensor, positions_b: torch.Tensor) -> torch.Tensor:
        """Feed token ids_b[b] to cache row b at positions_b[b]; return next-token logits [B, V]."""
        num, kv_heads, dim = ids_b.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        width = int(positions_b.max()) + 1
        index = self._cache_index(self._arange(num), positions_b)
        # Grouped-query attention without repeating keys: per (row, kv head) a [group, D] block
        # of queries meets that row's [width, D] keys; -inf hides the columns past its position.
        hidden = self._arange(width)[None, :] > positions_b[:, None]
        bias = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(hidden, float("-inf"))
        bias = bias[:, None, None, :].expand(num, kv_heads, group, width).reshape(-1, group, width)

        def attend(layer: int, q_bhd, k_bhd, v_bhd):
            self._write_cache(layer, index, k_bhd, v_bhd)
            if not self.fold:
                return self._fused_attention(
                    layer,
                    q_bhd.view(num, -1, 1, dim),
                    self.k_cache[layer][:num, :, :width],
                    self.v_cache[layer][:num, :, :width],
                    ~hidden[:, None, None, :],
                )
            keys = self.k_cache[layer][:num, :, :width].reshape(-1, width, dim)
            values = self.v_cache[layer][:num, :, :width].reshape(-1, width, dim)
            queries = q_bhd.reshape(-1, group, dim)
            probs = torch.softmax(torch.baddbmm(bias, queries, keys.transpose(1, 2)), dim=-1)
            return torch.bmm(probs, values).view(num, -1)

        cos, sin = self.cos[positions_b][:, None], self.sin[positions_b][:, None]
        return self._logits(self._layers(ids_b, cos, sin, attend))

    def _layers(self, ids_n: torch.Tensor, cos_n1d, sin_n1d, attend) -> torch.Tensor:
        """The decoder stack on flat tokens; `attend` stores keys/values and returns attention."""
        x = F.embedding(ids_n, self.model.model.embed_tokens.weight)
        num = x.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        routes: list[torch.Tensor] = []
        for i, w in enumerate(self.layers):
            qkv = w.qkv(_rms_normalize(x, self.eps, w.in_norm))
            qk = qkv[:, : (heads + kv_heads) * dim].view(num, heads + kv_heads, dim)
            v = qkv[:, (heads + kv_heads) * dim :].view(num, kv_heads, dim)
            if w.qk_norm is not None:
                qk = _rms_normalize(qk, self.eps).mul_(w.qk_norm)
            if self.fold:  # rotary, q and k
                qk = torch.addcmul(qk * cos_n1d, qk.roll(dim // 2, -1), sin_n1d)
            else:  # each product rounded, as transformers does
                qk = qk * cos_n1d + qk.roll(dim // 2, -1) * sin_n1d
            attended = attend(i, qk[:, :heads], qk[:, heads:], v)
            # Folded: the residual add inside the matmul; else rounded apart, as transformers.
            x = w.o.add_to(x, attended) if self.fold else x + w.o(attended)
            if w.moe is not None:
                out, experts_nk = w.moe(_rms_normalize(x, self.eps))
                x = x + out
                routes.append(experts_nk)
                continue
            gate, up = w.gate_up(_rms_normalize(x, self.eps, w.post_norm)).chunk(2, dim=-1)
            x = (
                w.down.add_to(x, F.silu(gate).mul_(up))
                if self.fold
                else x + w.down(F.silu(gate) * up)
            )
        self.routes = torch.stack(routes, dim=1) if self.capture_routes else None
        return x

    def _fused_attention(self, layer: int, q_nhqd, k_nhkd, v_nhkd, allowed) -> torch.Tensor:
        """Below fp32 (no folding): attention by PyTorch's fused kernel, the one the trainer's
        transformers model calls, with the layer's scale and keys and values repeated per query
        group as transformers repeats them, so engine and trainer round alike. Queries
        [n, heads, q, D], keys and values [n, kv_heads, k, D], `allowed` broadcast to
        [n, 1, q, k]; returns [n * q, heads * D]."""
        group = self.num_heads // self.num_kv_heads
        k, v = (t.repeat_interleave(group, dim=1) for t in (k_nhkd, v_nhkd))
        out = F.scaled_dot_product_attention(
            q_nhqd, k, v, attn_mask=allowed, scale=self.layers[layer].scale
        )
        return out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)

    def _logits(self, hidden_bh: torch.Tensor) -> torch.Tensor:
        return self.lm_head(_rms_normalize(hidden_bh, self.eps) * self.model.model.norm.weight)

    def _write_cache(self, layer: int, index: torch.Tensor, k_nhd, v_nhd) -> None:
        for cache, new in ((self.k_cache[layer], k_nhd), (self.v_cache[layer], v_nhd)):
            cache.view(-1, self.head_dim).index_copy_(0, index, new.reshape(-1, self.head_dim))

    def _cache_index(self, slots_n: torch.Tensor, positions_n: torch.Tensor) -> torch.Tensor:
        """Flat index [n * kv_heads] of (slot, kv head, position) in a cache viewed as [-1, D]."""
        max_len = self.k_cache[0].shape[2]
        row_heads = slots_n[:, None] * self.num_kv_heads + self._arange(self.num_kv_heads)
        return (row_heads * max_len + positions_n[:, None]).flatten()

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)


def _rms_normalize(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension, the statistic in fp32; one fused reduction (the vector
    norm) instead of square, then mean. Without `weight` the caller folds it elsewhere."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    scale = norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
    if x.dtype == torch.float32:
        out = x * scale
    else:
        # Below fp32, the product in fp32 rounded once, as transformers' RMSNorm does: a scale
        # rounded to bf16 first would be off by up to 0.4% for every feature of the token alike.
        out = (x.float() * scale).to(x.dtype)
    return out if weight is None else weight * out


@dataclass
class _LayerWeights:
    """One decoder layer's projections as the runner computes them.

    In fp32 the norms' weights and the attention scale are folded into the projections (`fold`):
    fewer ops, the same numbers to fp32 rounding. Below fp32 folding would round every folded
    weight once more, so there the norms' weights stay apart (`in_norm`, `post_norm`) and the
    scale is applied to the scores (`scale`), the order of operations transformers uses."""

    qkv: _Linear  # [q; k; v] rows (with `fold`: times the input norm's weight, columns)
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: q_norm rows, then k_norm rows
    o: _Linear
    gate_up: _Linear | None  # [gate; up] rows (with `fold`: times the post-attention norm's)
    down: _Linear | None
    moe: _Experts | None = None  # a mixture-of-experts layer's MLP (then no gate_up, down)
    in_norm: torch.Tensor | None = None  # without `fold`: the norms' weights
    post_norm: torch.Tensor | None = None
    scale: float = 1.0  # without `fold`: the attention scale, applied to the scores

    @classmethod
    def of(
        cls, layer, num_heads: int, num_kv_heads: int, onednn: bool, fold: bool = True
    ) -> _LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        # Folded, the attention scale goes into the queries: into the query norm's weight when
        # there is one, else into the query projection.
        q_scale = attn.scaling if fold else 1.0
        qk_norm = None
        if hasattr(attn, "q_norm"):
            q_norm = attn.q_norm.weight.expand(num_heads, -1) * q_scale
            qk_norm = torch.cat([q_norm, attn.k_norm.weight.expand(num_kv_heads, -1)])
            q_scale = 1.0
        in_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        common = dict(
            qkv=_Linear(*_fuse(qkv, [q_scale, 1.0, 1.0], in_norm if fold else None), onednn),
            qk_norm=qk_norm,
            o=_Linear(attn.o_proj.weight, attn.o_proj.bias, onednn),
            in_norm=None if fold else in_norm.weight,
            post_norm=None if fold else post_norm.weight,
            scale=1.0 if fold else attn.scaling,
        )
        if hasattr(mlp, "experts"):
            moe = _Experts(mlp, post_norm.weight)
            return cls(**{**common, "post_norm": None}, gate_up=None, down=None, moe=moe)
        gate_up = _fuse([mlp.gate_proj, mlp.up_proj], [1.0, 1.0], post_norm if fold else None)
        return cls(
            **common,
            gate_up=_Linear(*gate_up, onednn),
            down=_Linear(mlp.down_proj.weight, mlp.down_proj.bias, onednn),
        )


class _Experts:
    """A mixture-of-experts MLP (Qwen3-MoE's): the router picks `top_k` experts per token
    (`streamrl.models.moe.route`) and the output is their SiLU MLPs' outputs weighted by the
    router's probabilities, computed expert by expert over the tokens routed to each, in the
    order and with the products the transformers model uses (so that fp32 log-probs agree)."""

    def __init__(self, mlp, norm_weight: torch.Tensor):
        self.norm_weight = norm_weight
        self.router = mlp.gate.weight
        self.top_k = mlp.gate.top_k
        self.normalise = bool(getattr(mlp.gate, "norm_topk_prob", True))
        self.gate_up = mlp.experts.gate_up_proj  # [experts, 2 * inner, hidden]
        self.down = mlp.experts.down_proj  # [experts, hidden, inner]

    def __call__(self, x_normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the MLP's output [N, hidden], the experts each token went to [N, k]) of the
        RMS-normalised input (the norm's weight not yet applied)."""
        h = x_normed * self.norm_weight
        weights_nk, experts_nk, _ = route(F.linear(h, self.router), self.top_k, self.normalise)
        out = torch.zeros_like(h)
        for expert in torch.unique(experts_nk).tolist():
            tokens, slot = torch.where(experts_nk == expert)
            gate, up = F.linear(h[tokens], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert]) * weights_nk[tokens, slot, None]
            out.index_add_(0, tokens, y)
        return out, experts_nk


def _fuse(linears, scales: list[float], norm) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) computing all of `linears`, block i times scales[i], on the output
    of RMSNorm `norm` taken without its weight: linear(rms(x) * g, W) == linear(rms(x), W * g).
    `norm` None: on the norm's whole output (its weight applied by the caller)."""
    weight = torch.cat([m.weight * s for m, s in zip(linears, scales, strict=True)])
    if norm is not None:
        weight *= norm.weight[None, :]
    if all(m.bias is None for m in linears):
        return weight, None
    biases = [
        (m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)) * s
        for m, s in zip(linears, scales, strict=True)
    ]
    return weight, torch.cat(biases)


class _Linear:
    """y = x @ weight.T + bias, with the residual add fused in `add_to`.

    With `onednn`, the weight is packed once into oneDNN's blocked layout and the product runs
    through oneDNN (the kernels PyTorch's own compiler uses for CPU linears): in fp32 on an
    AMD AVX-512 CPU it is about twice as fast as `F.linear`, whose fp32 path goes through MKL
    (on Intel CPUs MKL is faster: `streamrl.models.onednn.onednn_preferred`).
    The packed weight is a copy: `DecoderRunner.refresh` rebuilds it when the model changes.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool):
        self.bias = bias
        self.onednn = onednn
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight) if onednn else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the add done by the matmul."""
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise.binary(
                x, residual, self.weight, self.bias, "add"
            )
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)


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
        check_requests(requests, self.model.model.embed_tokens.weight.shape[0])
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
        self.runner.prefill(slots, sequences)
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
            prefilled = self.runner.prefill(new_slots, prompts)
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
