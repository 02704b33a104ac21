"""The builtin engine's model runner: a Llama-family decoder over a KV cache with a row per slot.

`DecoderRunner` runs prefill and decode passes with its own forward instead of the model's
`forward`: fused projections (prepacked for oneDNN on AVX-512 CPUs where MKL, behind `F.linear`,
runs its AVX2 kernels: about twice the throughput), about twenty tensor ops a layer per decode
step, no Python work per sequence. Mixture-of-experts layers (Qwen3-MoE) route with
`streamrl.models.moe.route` and can leave the experts of every token behind for routing replay.
In fp32 the norms and the attention scale are folded into the projections; below fp32 the
runner keeps transformers' order of operations (`_LayerWeights`). Qwen-VL models and the
Qwen2.5-Omni thinker run their language model here too, with prompts' embeddings and 3-D
positions from their vision and audio towers (`streamrl.rollout.vision_prompts`), and for
Qwen3-VL the deepstack features its first layers add to their outputs.
`rollout/builtin_engine.py` drives it: slots, sampling and results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from streamrl.models.moe import check_routable, route
from streamrl.models.onednn import onednn_linear_usable, onednn_preferred
from streamrl.models.vision import is_multimodal, placeholder_ids, text_model
from streamrl.rollout.vision_prompts import mrope_bands, prompt_inputs, rotary_tables

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama")
# Vision-language models whose language model is one of those (a Qwen2 or, for Qwen3-VL, a Qwen3
# decoder; 3-D positions).
VISION_LANGUAGE_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# The Qwen2.5-Omni model (as its directory's config names it) and the thinker transformers loads
# from it: a Qwen2 decoder with 3-D positions beside an audio and a vision tower.
OMNI_TYPES = ("qwen2_5_omni", "qwen2_5_omni_thinker")


def unsupported(config, rope_type: str | None = None) -> str | None:
    """Why the builtin engine cannot run a model of this HF config (None: it can). `rope_type`
    is the model's own (its rotary module's); by default it is read from the config."""
    if config.model_type == "qwen2_5_omni":
        config = config.thinker_config
    if config.model_type in VISION_LANGUAGE_TYPES + OMNI_TYPES:
        config = config.text_config
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope_type or rope.get("rope_type", "default")
    elif config.model_type not in SUPPORTED_MODEL_TYPES:
        kinds = ", ".join(SUPPORTED_MODEL_TYPES + VISION_LANGUAGE_TYPES + OMNI_TYPES)
        return (
            f"the builtin engine runs {kinds} models, got model_type {config.model_type!r}; use "
            "one of those or rollout.engine=vllm"
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
        reason = unsupported(model.config)
        if reason is None:
            rotary = getattr(text_model(model), "rotary_emb", None)
            reason = unsupported(model.config, getattr(rotary, "rope_type", None))
        if reason is not None:
            raise TypeError(reason)
        config = getattr(model.config, "text_config", model.config)
        self.model = model
        self.text = text_model(model)  # the decoder stack (a vision-language model's LM)
        self.vision = is_multimodal(model)
        self.device = self.text.embed_tokens.weight.device
        self.dtype = self.text.embed_tokens.weight.dtype
        # Wanted (None: where it beats MKL, `model.onednn_linears="auto"`) and usable (fp32, CPU).
        wanted = onednn_preferred() if use_onednn is None else use_onednn
        self.use_onednn = wanted and onednn_linear_usable(self.device, self.dtype)
        self.head_dim = self.text.layers[0].self_attn.head_dim
        self.bands = mrope_bands(model, self.head_dim) if self.vision else None
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
            for layer in self.text.layers
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
        rotary = self.text.rotary_emb
        positions = torch.arange(max_len, dtype=torch.float32, device=self.device)
        angles = positions[:, None] * rotary.inv_freq.float()[None, :]
        cos, sin = angles.cos() * rotary.attention_scaling, angles.sin() * rotary.attention_scaling
        # rotate_half(x) * [sin, sin] == roll(x, D/2) * [-sin, sin]: one op instead of three.
        self.cos = torch.cat([cos, cos], dim=-1).to(self.dtype)
        self.sin = torch.cat([-sin, sin], dim=-1).to(self.dtype)
        # Per slot, how far its text positions trail its cache columns (3-D positions, <= 0).
        self.rope_delta = torch.zeros(num_slots, dtype=torch.long, device=self.device)

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, num_columns: int) -> None:
        """Copy the first `num_columns` columns of cache rows `src` into rows `dst`."""
        for cache in (*self.k_cache, *self.v_cache):
            cache[dst, :, :num_columns] = cache[src, :, :num_columns]
        self.rope_delta[dst] = self.rope_delta[src]

    def prefill(
        self,
        slots: torch.Tensor,
        prompts: Sequence[Sequence[int]],
        media: Sequence[Any] | None = None,
    ) -> torch.Tensor:
        """Run the prompts into cache rows `slots`; return each one's next-token logits [n, V].
        `media` (a multimodal model) holds each prompt's processor tensors (a mapping with
        `pixel_values`, `image_grid_thw`, ... and a `key` naming them; None for a text prompt).

        Identical prompts are computed once (in the slot of the first) and their rows copied.
        """
        media = list(media) if media is not None else [None] * len(prompts)
        if any(m for m in media) and not self.vision:
            raise ValueError("prompts with media need a multimodal (Qwen-VL or Omni) model")
        keys = [(tuple(p), (m or {}).get("key")) for p, m in zip(prompts, media, strict=True)]
        first_slot: dict[tuple, int] = {}
        first_media: dict[tuple, Any] = {}
        for slot, key, m in zip(slots.tolist(), keys, media, strict=True):
            first_slot.setdefault(key, slot)
            first_media.setdefault(key, m)
        unique = [key[0] for key in first_slot]
        unique_index = {key: i for i, key in enumerate(first_slot)}
        which = self._tensor([unique_index[key] for key in keys])
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

        embeds_n, deepstack_n = None, None
        if self.vision:
            inputs = [
                prompt_inputs(self.model, self._tensor(list(p)), first_media[key])
                for p, key in zip(unique, first_slot, strict=True)
            ]
            embeds_n, cos, sin, deepstack_n = self._vision_inputs(inputs, width)
            deltas = self._tensor([x.rope_delta for x in inputs])
            self.rope_delta[slots] = deltas[which]
        else:
            cos, sin = self.cos[:width].repeat(num, 1), self.sin[:width].repeat(num, 1)
        hidden_nh = self._layers(ids_n, cos[:, None], sin[:, None], attend, embeds_n, deepstack_n)
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

        rope_positions = positions_b + self.rope_delta[:num] if self.vision else positions_b
        cos, sin = self.cos[rope_positions][:, None], self.sin[rope_positions][:, None]
        return self._logits(self._layers(ids_b, cos, sin, attend))

    def _vision_inputs(self, inputs, width: int):
        """Flat embeddings and rotary tables [num * width, ...] of prompts padded to `width`,
        and the deepstack additions of each layer that takes them, also flat (None: none)."""
        embeds, cos, sin = [], [], []
        rotary = self.text.rotary_emb
        levels = max((len(x.deepstack or []) for x in inputs), default=0)
        deepstack: list[list[torch.Tensor]] = [[] for _ in range(levels)]
        for x in inputs:
            pad = width - x.embeds_lh.shape[0]
            positions = F.pad(x.positions_3l, (0, pad))
            c, s = rotary_tables(positions, rotary.inv_freq, self.bands)
            cos.append(c * rotary.attention_scaling)
            sin.append(s * rotary.attention_scaling)
            embeds.append(F.pad(x.embeds_lh, (0, 0, 0, pad)))
            for level, out in enumerate(deepstack):  # a prompt without images adds zeros
                add = x.deepstack[level] if x.deepstack else torch.zeros_like(x.embeds_lh)
                out.append(F.pad(add, (0, 0, 0, pad)))
        return (
            torch.cat(embeds).to(self.dtype),
            torch.cat(cos).to(self.dtype),
            torch.cat(sin).to(self.dtype),
            [torch.cat(level).to(self.dtype) for level in deepstack] or None,
        )

    def _layers(
        self, ids_n: torch.Tensor, cos_n1d, sin_n1d, attend, embeds_n=None, deepstack_n=None
    ) -> torch.Tensor:
        """The decoder stack on flat tokens (or their given input embeddings); `attend` stores
        keys/values and returns attention; layer i's output gets `deepstack_n[i]` added."""
        x = F.embedding(ids_n, self.text.embed_tokens.weight) if embeds_n is None else embeds_n
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
            else:
                gate, up = w.gate_up(_rms_normalize(x, self.eps, w.post_norm)).chunk(2, dim=-1)
                x = (
                    w.down.add_to(x, F.silu(gate).mul_(up))
                    if self.fold
                    else x + w.down(F.silu(gate) * up)
                )
            if deepstack_n is not None and i < len(deepstack_n):
                x = x + deepstack_n[i]
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
        logits = self.lm_head(_rms_normalize(hidden_bh, self.eps) * self.text.norm.weight)
        if self.vision:  # media placeholders are never sampled (`streamrl.models.vision`)
            logits[:, placeholder_ids(self.model)] = float("-inf")
        return logits

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
