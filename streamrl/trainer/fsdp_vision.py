"""The vision tower of a vision-language policy (and an Omni thinker's audio tower) under FSDP2:
one call of each tower per forward, on every rank.

Each vision block is an FSDP unit (`fsdp.decoder_layers`), so every forward all-gathers it and
every backward reduce-scatters its gradient, and those collectives pair up across ranks only if
every rank runs the tower the same number of times in the same place. Left to itself a Qwen-VL
forward runs the tower once for the batch's images, once more for its videos, and not at all for
a batch of text rows (or the zero pass of a rank with no rows): two ranks with different media
would wait on each other for good.

`one_vision_call` makes the count one on every rank, whatever the batch holds:

    rank with media:  visual(images ++ videos) ─► split ─► mm_encoder_outputs {image, video}
    rank without:     visual(one tiny blank image) ─► 0 x sum added to the input embeddings

A Qwen3-VL tower also returns "deepstack" features of earlier blocks (through mergers of their
own) for the first decoder layers: they are split per item alike, and the blank image's go into
the zero term too, so the mergers' gradients are reduced on every rank.

The tower processes each image or video on its own (attention within each item only), so one
call over both gives the features two calls would, to float rounding. The blank image's zero
term changes no logit and adds an exact zero to the tower's gradient; it exists so the
collectives of this rank's forward and backward line up with its peers'.

An Omni thinker's forward runs its audio tower once when the batch has audio and not at all
otherwise; a rank without audio runs it on a blank clip (`BLANK_FRAMES` silent log-mel
frames) the same way. The hook sits on the thinker itself, whose forward takes the media.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

from streamrl.models.vision import tower_owner

BLANK_FRAMES = 8  # the blank clip's log-mel frames: 1 audio token after the tower's strides


def one_vision_call(model: nn.Module) -> None:
    """Install the one-call rule (module docstring) on the Qwen-VL or Omni thinker `model`
    (once)."""
    inner = tower_owner(model)
    if getattr(inner, "_streamrl_one_vision_call", False):
        return
    inner.register_forward_pre_hook(_run_tower_once, with_kwargs=True)
    inner._streamrl_one_vision_call = True


def _run_tower_once(
    inner: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    """The forward pre-hook of the Qwen-VL base model (or the Omni thinker): runs the tower and
    hands its features to the forward in place of the pixels."""
    if args or kwargs.get("mm_encoder_outputs") is not None:
        raise TypeError(
            "under FSDP2 the Qwen-VL model must be called with keyword arguments and pixels, as "
            "Qwen2_5_VLForConditionalGeneration does; got positional arguments or encoder outputs"
        )
    visual = inner.visual
    kinds = [
        (kind, kwargs.get(pixels), kwargs.get(grid))
        for kind, pixels, grid in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        )
        if kwargs.get(pixels) is not None
    ]
    if not kinds:
        blank = visual(*_blank_image(visual))
        deep = getattr(blank, "deepstack_features", None) or []
        _add_zero(inner, kwargs, torch.stack([f.sum() for f in [blank.pooler_output, *deep]]))
        _blank_audio(inner, kwargs)
        return args, kwargs
    pixels = torch.cat([p.type(visual.dtype) for _, p, _ in kinds])
    grids = torch.cat([g for _, _, g in kinds])
    out = visual(pixels, grid_thw=grids)
    sizes = (grids.prod(-1) // visual.spatial_merge_size**2).tolist()
    per_item = torch.split(out.pooler_output, sizes)
    # Qwen3-VL: features of earlier blocks for the first decoder layers, per layer per item.
    deep = [torch.split(level, sizes) for level in getattr(out, "deepstack_features", None) or []]
    outputs, start = {}, 0
    for kind, _, grid in kinds:
        items = slice(start, start + len(grid))
        start += len(grid)
        outputs[kind] = (
            BaseModelOutputWithDeepstackFeatures(
                pooler_output=per_item[items], deepstack_features=[d[items] for d in deep]
            )
            if deep
            else BaseModelOutputWithPooling(pooler_output=per_item[items])
        )
    kwargs.update(pixel_values=None, pixel_values_videos=None, mm_encoder_outputs=outputs)
    _blank_audio(inner, kwargs)
    return args, kwargs


def _blank_audio(inner: nn.Module, kwargs: dict[str, Any]) -> None:
    """An Omni thinker's audio tower on a blank clip when the batch has no audio, after the
    vision tower as the forward runs it on audio: the ranks' calls come in one order."""
    if not hasattr(inner, "audio_tower") or kwargs.get("input_features") is not None:
        return
    audio = inner.audio_tower
    features = torch.zeros(
        (1, audio.config.num_mel_bins, BLANK_FRAMES), dtype=audio.dtype, device=audio.device
    )
    mask = torch.ones((1, BLANK_FRAMES), dtype=torch.long, device=audio.device)
    blank = inner.get_audio_features(features, mask, return_dict=True).last_hidden_state
    _add_zero(inner, kwargs, blank)


def _add_zero(inner: nn.Module, kwargs: dict[str, Any], features: torch.Tensor) -> None:
    """Add 0 x the features' sum to the forward's input embeddings: no logit changes, and the
    tower's parameters get an exact zero gradient (their reduce-scatter happens)."""
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        embeds = inner.get_input_embeddings()(kwargs["input_ids"])
    kwargs["inputs_embeds"] = embeds + 0.0 * features.sum().to(embeds.dtype)
    media = ("pixel_values", "pixel_values_videos", "input_features", "mm_encoder_outputs")
    if all(kwargs.get(name) is None for name in media):
        # No placeholder to find: the ids may go (Qwen3-VL takes ids or embeddings, not both).
        kwargs["input_ids"] = None


def _blank_image(visual: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image the tower takes (one merged patch: a grid of merge x merge patches),
    all zeros, with its grid."""
    config = visual.config
    merge = visual.spatial_merge_size
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    device = next(visual.parameters()).device
    pixels = torch.zeros((merge * merge, patch_dim), dtype=visual.dtype, device=device)
    return pixels, torch.tensor([[1, merge, merge]], device=device)
