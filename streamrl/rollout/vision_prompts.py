"""What the builtin engine needs to run a multimodal prompt: its input embeddings and 3-D positions.

A Qwen2-VL / Qwen2.5-VL language model (and the Qwen2.5-Omni thinker's) is a Qwen2 decoder whose
inputs differ from a text model's in two ways: every image, video or audio placeholder token's
embedding is replaced by its tower's output for its merged patch or audio frame pair, and rotary
positions are three numbers per token (time, height, width; text and audio tokens have all three
equal) whose frequency bands come from the three in `mrope_section` order. `prompt_inputs`
computes both with the model's own towers (`get_image_features`, `get_video_features`,
`get_audio_features`) and the position rule the trainer's forward is given
(`streamrl.models.vl_forward.mrope_position_ids`), so the engine and the trainer agree. After
the prompt, a text token's three positions are equal and trail its cache column by the prompt's
`rope_delta`, which is all decoding needs.

Qwen3-VL (a Qwen3 decoder) differs in two ways: its frequency bands take turns among the three
positions (`mrope_interleaved`), and its vision tower also hands "deepstack" features of earlier
blocks to the first decoder layers, which add them to their outputs at the image and video
tokens (`PromptInputs.deepstack`; prompt tokens only, so decoding never sees them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from streamrl.models.vision import is_omni_thinker, text_model, tower_owner
from streamrl.models.vl_forward import mm_token_type_ids, mrope_position_ids


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
    if not rope.get("mrope_interleaved"):  # consecutive sections: time, then height, then width
        return torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(section)])
    # Qwen3-VL: frequency i turns with height if i % 3 == 1 and with width if i % 3 == 2, within
    # three times their sections; every other one with time.
    bands = torch.zeros(head_dim // 2, dtype=torch.long)
    for band in (1, 2):
        bands[band : 3 * section[band] : 3] = band
    return bands


@dataclass
class PromptInputs:
    """One prompt's input embeddings [len, hidden], 3-D positions [3, len], the offset of its
    later text positions from their cache columns (`rope_delta`, <= 0) and, for a Qwen3-VL
    prompt with images or video, what the first decoder layers add to their outputs
    (`deepstack`: one [len, hidden] per layer, zero but at the image and video tokens)."""

    embeds_lh: torch.Tensor
    positions_3l: torch.Tensor
    rope_delta: int
    deepstack: list[torch.Tensor] | None = None


@torch.no_grad()
def prompt_inputs(model, ids: torch.Tensor, media: Mapping[str, Any] | None) -> PromptInputs:
    """The embeddings and positions of prompt `ids` (1-D) with its processor tensors `media`
    (None or empty: a text prompt, whose positions are 0 .. len - 1)."""
    omni = is_omni_thinker(model)
    owner = tower_owner(model)
    embeds = text_model(model).embed_tokens(ids)
    media = media or {}
    config = model.config
    seen: list[str] = []
    deepstack: list[torch.Tensor] | None = None
    for kind, token_id, features, deep in _media_features(owner, media, config, ids.device):
        seen.append(kind)
        where = ids == token_id
        if int(where.sum()) != features.shape[0]:
            raise ValueError(
                f"the prompt has {int(where.sum())} {kind} placeholder tokens for "
                f"{features.shape[0]} {kind} features: its ids and media come from different "
                "processing"
            )
        embeds = embeds.clone()
        embeds[where] = features.to(embeds.dtype)
        if deep:
            deepstack = deepstack or [torch.zeros_like(embeds) for _ in deep]
            for layer, level in zip(deepstack, deep, strict=True):
                layer[where] = level.to(layer.dtype)
    for kind, token_id in (
        ("image", config.image_token_id),
        ("video", config.video_token_id),
        ("audio", getattr(config, "audio_token_id", None)),
    ):
        if kind not in seen and token_id is not None and bool((ids == token_id).any()):
            raise ValueError(
                f"the prompt has {int((ids == token_id).sum())} {kind} placeholder tokens but "
                f"no {kind} input: a multimodal prompt's ids and media travel together"
            )
    if "image" not in seen and "video" not in seen:  # text and audio: 1-D positions
        positions = torch.arange(len(ids), device=ids.device).expand(3, -1)
        return PromptInputs(embeds, positions, 0)
    seconds = media.get("video_second_per_grid" if omni else "second_per_grid_ts")
    positions_3l = mrope_position_ids(
        config,
        mm_token_type_ids(config, ids[None]).cpu(),
        _cpu(media.get("image_grid_thw")),
        _cpu(media.get("video_grid_thw")),
        _cpu(seconds),
    )[:, 0].to(ids.device)
    rope_delta = int(positions_3l.max()) + 1 - len(ids)
    return PromptInputs(embeds, positions_3l, rope_delta, deepstack)


def _media_features(owner, media: Mapping[str, Any], config, device: torch.device):
    """(kind, placeholder token id, features [tokens, hidden], deepstack features: one
    [tokens, hidden] per decoder layer they go to, empty but for Qwen3-VL) of each medium kind
    `media` holds, from the model's own towers (`owner` has the `get_*_features` methods)."""
    for kind, pixels_key, grid_key, token_id, method in (
        ("image", "pixel_values", "image_grid_thw", config.image_token_id, "get_image_features"),
        (
            "video",
            "pixel_values_videos",
            "video_grid_thw",
            config.video_token_id,
            "get_video_features",
        ),
    ):
        if media.get(pixels_key) is None:
            continue
        pixels = torch.as_tensor(media[pixels_key]).to(device, owner.visual.dtype)
        out = getattr(owner, method)(pixels, torch.as_tensor(media[grid_key]).to(device))
        pooled = out.pooler_output if hasattr(out, "pooler_output") else out
        if isinstance(pooled, (list, tuple)):
            pooled = torch.cat(list(pooled))
        deep = getattr(out, "deepstack_features", None) or []
        yield kind, token_id, pooled, [torch.cat(list(level)) for level in deep]
    if media.get("input_features") is not None:
        features = torch.as_tensor(media["input_features"])
        mask = torch.as_tensor(media["feature_attention_mask"]).to(device)
        out = owner.get_audio_features(
            features.to(device, owner.audio_tower.dtype), mask, return_dict=True
        )
        yield "audio", config.audio_token_id, out.last_hidden_state, []


def _cpu(value):
    return None if value is None else torch.as_tensor(value).cpu()


def rotary_tables(positions_3n: torch.Tensor, inv_freq: torch.Tensor, bands: torch.Tensor):
    """(cos, sin) [n, head_dim] of 3-D positions, each frequency turning with its band's
    position; laid out as the runner's tables are (sin's first half negated)."""
    chosen = positions_3n.float()[bands.to(positions_3n.device)]  # [head_dim / 2, n]
    angles = chosen.t() * inv_freq.float()[None, :]
    return torch.cat([angles.cos()] * 2, dim=-1), torch.cat([-angles.sin(), angles.sin()], dim=-1)
