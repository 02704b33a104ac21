"""What the builtin engine needs to run a Qwen-VL prompt: its input embeddings and 3-D positions.

A Qwen2-VL / Qwen2.5-VL language model is a Qwen2 decoder whose inputs differ from a text
model's in two ways: every image or video placeholder token's embedding is replaced by the
vision tower's output for its merged patch, and rotary positions are three numbers per token
(time, height, width; text tokens have all three equal) whose frequency bands come from the
three in `mrope_section` order. `prompt_inputs` computes both with the model's own vision tower
(`get_image_features`, `get_video_features`) and the position rule the trainer's forward is
given (`streamrl.models.vl_forward.mrope_position_ids`), so the engine and the trainer agree. After the prompt, a text token's three positions are equal and
trail its cache column by the prompt's `rope_delta`, which is all decoding needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from streamrl.models.vl_forward import mm_token_type_ids, mrope_position_ids

VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def mrope_bands(model, head_dim: int) -> torch.Tensor | None:
    """Per rotary frequency (head_dim / 2 of them), which of the three positions (0 time,
    1 height, 2 width) it turns with; None for a model with 1-D positions."""
    config = getattr(model.config, "text_config", model.config)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    section = rope.get("mrope_section")
    if not section:
        return None
    if sum(section) != head_dim // 2:
        raise ValueError(f"mrope_section {section} does not add up to head_dim / 2")
    return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(section)])


@dataclass
class PromptInputs:
    """One prompt's input embeddings [len, hidden], 3-D positions [3, len] and the offset of its
    later text positions from their cache columns (`rope_delta`, <= 0)."""

    embeds_lh: torch.Tensor
    positions_3l: torch.Tensor
    rope_delta: int


@torch.no_grad()
def prompt_inputs(model, ids: torch.Tensor, media: Mapping[str, Any] | None) -> PromptInputs:
    """The embeddings and positions of prompt `ids` (1-D) with its processor tensors `media`
    (None or empty: a text prompt, whose positions are 0 .. len - 1)."""
    inner = model.model
    embeds = inner.language_model.embed_tokens(ids)
    ids_bt = ids[None]
    grids = {key: media[key] for key in VISION_INPUTS if media and media.get(key) is not None}
    for pixels_key, grid_key, token_id, features in (
        ("pixel_values", "image_grid_thw", model.config.image_token_id, inner.get_image_features),
        (
            "pixel_values_videos",
            "video_grid_thw",
            model.config.video_token_id,
            inner.get_video_features,
        ),
    ):
        if pixels_key not in grids:
            continue
        pixels = grids[pixels_key].to(embeds.device, inner.visual.dtype)
        grid = grids[grid_key].to(embeds.device)
        out = features(pixels, grid)
        pooled = out.pooler_output if hasattr(out, "pooler_output") else out
        feats = torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
        where = ids == token_id
        if int(where.sum()) != feats.shape[0]:
            raise ValueError(
                f"the prompt has {int(where.sum())} placeholder tokens for {feats.shape[0]} "
                "vision features: its ids and media come from different processing"
            )
        embeds = embeds.clone()
        embeds[where] = feats.to(embeds.dtype)
    if not grids:
        placeholders = (ids == model.config.image_token_id) | (ids == model.config.video_token_id)
        if bool(placeholders.any()):
            raise ValueError(
                f"the prompt has {int(placeholders.sum())} image / video placeholder tokens but "
                "no media: a multimodal prompt's ids and media travel together"
            )
        positions = torch.arange(len(ids), device=ids.device).expand(3, -1)
        return PromptInputs(embeds, positions, 0)
    seconds = media.get("second_per_grid_ts") if media else None
    positions_3l = mrope_position_ids(
        model.config,
        mm_token_type_ids(model.config, ids_bt).cpu(),
        _cpu(grids.get("image_grid_thw")),
        _cpu(grids.get("video_grid_thw")),
        _cpu(seconds),
    )[:, 0].to(ids.device)
    return PromptInputs(embeds, positions_3l, int(positions_3l.max()) + 1 - len(ids))


def _cpu(value):
    return None if value is None else torch.as_tensor(value).cpu()


def rotary_tables(positions_3n: torch.Tensor, inv_freq: torch.Tensor, bands: torch.Tensor):
    """(cos, sin) [n, head_dim] of 3-D positions, each frequency turning with its band's
    position; laid out as the runner's tables are (sin's first half negated)."""
    chosen = positions_3n.float()[bands.to(positions_3n.device)]  # [head_dim / 2, n]
    angles = chosen.t() * inv_freq.float()[None, :]
    return torch.cat([angles.cos()] * 2, dim=-1), torch.cat([-angles.sin(), angles.sin()], dim=-1)
