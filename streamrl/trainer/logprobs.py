"""Per-token log-probs of responses under a model, laid out like the builtin engine's batches.

Prompts are left-padded and responses right-padded, so every response starts at the same column
and positions come from the attention mask exactly as during generation. Rows that carry the
rollout's routed experts (mixture-of-experts models, `algorithm.routing_replay`) are computed
with those experts (`streamrl.models.moe`); rows of a vision-language model carry their
prompts' processor tensors (`media`), which the model's forward receives with the token types
that give it its 3-D positions (`streamrl.models.vl_forward`). The trainer, the
reference role and the pi_old role all use this one function, which is what keeps trainer and
rollout log-probs within floating-point noise of each other on identical weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from streamrl.models import moe
from streamrl.models.vision import forward_media_kwargs, placeholder_ids


@dataclass
class PackedBatch:
    """A padded batch: `input_ids_bt`, `attention_mask_bt`, and where the responses sit."""

    input_ids_bt: torch.Tensor
    attention_mask_bt: torch.Tensor
    response_ids_br: torch.Tensor
    response_mask_br: torch.Tensor
    prompt_width: int
    routes_nlk: torch.Tensor | None = None  # experts to replay per flattened token (`moe`)
    # A vision-language model's batch: the rows' processor tensors, concatenated in row order
    # (`collate_media`); an empty dict for text rows.
    media: dict[str, torch.Tensor] | None = None

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with its tensors on `device`."""
        return PackedBatch(
            self.input_ids_bt.to(device),
            self.attention_mask_bt.to(device),
            self.response_ids_br.to(device),
            self.response_mask_br.to(device),
            self.prompt_width,
            None if self.routes_nlk is None else self.routes_nlk.to(device),
            None if self.media is None else {k: v.to(device) for k, v in self.media.items()},
        )


def pack(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_token_id: int,
    routes: Sequence[np.ndarray] | None = None,
    media: Sequence[dict | None] | None = None,
) -> PackedBatch:
    """The rows padded into one batch; `routes` (each row's `routed_experts`, its positions
    from the prompt's first token on) are laid out the same way for routing replay; `media`
    (a vision-language model's rows: each one's processor tensors, None for a text row) are
    concatenated in row order."""
    num = len(prompts)
    width_p = max(len(p) for p in prompts)
    width_r = max(max((len(r) for r in responses), default=0), 1)
    input_ids = torch.full((num, width_p + width_r), pad_token_id, dtype=torch.long)
    attention = torch.zeros((num, width_p + width_r), dtype=torch.long)
    response_ids = torch.full((num, width_r), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((num, width_r))
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, width_p - len(p) : width_p] = _ids(p)
        input_ids[i, width_p : width_p + len(r)] = _ids(r)
        attention[i, width_p - len(p) : width_p + len(r)] = 1
        response_ids[i, : len(r)] = _ids(r)
        response_mask[i, : len(r)] = 1.0
    routes_nlk = None
    if routes is not None:
        starts = [width_p - len(p) for p in prompts]
        routes_nlk = moe.padded_routes(routes, starts, width_p + width_r, num)
    return PackedBatch(
        input_ids,
        attention,
        response_ids,
        response_mask,
        width_p,
        routes_nlk,
        None if media is None else collate_media(media),
    )


# The processor tensors a Qwen-VL or Omni thinker forward takes, each concatenated over the
# batch's rows (audio features and their masks padded to the longest clip's frames).
MEDIA_TENSORS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "video_second_per_grid",
    "input_features",
    "feature_attention_mask",
)


def collate_media(media: Sequence[dict | None]) -> dict[str, torch.Tensor]:
    """The rows' processor tensors concatenated in row order: a Qwen-VL or Omni model matches
    vision and audio features to placeholder tokens in the order the tokens appear in the
    flattened batch."""
    out = {}
    for name in MEDIA_TENSORS:
        parts = [m[name] for m in media if m is not None and m.get(name) is not None]
        if not parts:
            continue
        parts = [torch.as_tensor(p) for p in parts]
        if name in ("input_features", "feature_attention_mask"):  # frames last; mask 0 on pads
            frames = max(p.shape[-1] for p in parts)
            parts = [torch.nn.functional.pad(p, (0, frames - p.shape[-1])) for p in parts]
        out[name] = torch.cat(parts)
    return out


def _ids(seq: Sequence[int]) -> torch.Tensor:
    # A copy: arrays read from Ray's object store are read-only, which torch warns about.
    return torch.tensor(np.asarray(seq, dtype=np.int64))


def response_logprobs(
    model, batch: PackedBatch, temperature: float = 1.0, *, with_entropy: bool = False
):
    """Log-probs `[B, R]` of each response token (zeros on padding); keeps the autograd graph.

    With `with_entropy`, returns (log-probs, entropies) where entropies `[B, R]` are those of the
    full temperature-scaled distributions the tokens were drawn from."""
    width_r = batch.response_ids_br.shape[1]
    if batch.media is not None:  # 3-D positions and the media
        positions = forward_media_kwargs(
            model, batch.input_ids_bt, batch.attention_mask_bt, batch.media
        )
    else:
        positions = {"position_ids": (batch.attention_mask_bt.cumsum(-1) - 1).clamp(min=0)}
    with moe.replaying(model, batch.routes_nlk, batch.attention_mask_bt.reshape(-1)):
        logits = model(
            input_ids=batch.input_ids_bt,
            attention_mask=batch.attention_mask_bt,
            use_cache=False,
            **positions,
        ).logits
    # The token at column c is predicted by the logits at column c - 1.
    start = batch.prompt_width - 1
    logits_br = logits[:, start : start + width_r, :].float()
    if batch.media is not None:  # placeholders are never sampled (`models.vision`)
        banned = torch.tensor(placeholder_ids(model), device=logits_br.device)
        logits_br = logits_br.index_fill(-1, banned, float("-inf"))
    if temperature > 0:
        logits_br = logits_br / temperature
    logp_brv = torch.log_softmax(logits_br, dim=-1)
    logp_br = logp_brv.gather(-1, batch.response_ids_br.unsqueeze(-1)).squeeze(-1)
    logp_br = logp_br * batch.response_mask_br
    if not with_entropy:
        return logp_br
    entropy_br = -(logp_brv.exp() * logp_brv).sum(-1) * batch.response_mask_br
    return logp_br, entropy_br
