"""The vision tower of a vision-language policy under FSDP2: one tower call per forward, on
every rank.

Each vision block is an FSDP unit (`fsdp.decoder_layers`), so every forward all-gathers it and
every backward reduce-scatters its gradient, and those collectives pair up across ranks only if
every rank runs the tower the same number of times in the same place. Left to itself a Qwen-VL
forward runs the tower once for the batch's images, once more for its videos, and not at all for
a batch of text rows (or the zero pass of a rank with no rows): two ranks with different media
would wait on each other for good.

`one_vision_call` makes the count one on every rank, whatever the batch holds:

    rank with media:  visual(images ++ videos) ─► split ─► mm_encoder_outputs {image, video}
    rank without:     visual(one tiny blank image) ─► 0 x sum added to the input embeddings

The tower processes each image or video on its own (attention within each item only), so one
call over both gives the features two calls would, to float rounding. The blank image's zero
term changes no logit and adds an exact zero to the tower's gradient; it exists so the
collectives of this rank's forward and backward line up with its peers'.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPooling


def one_vision_call(model: nn.Module) -> None:
    """Install the one-call rule (module docstring) on the Qwen-VL `model` (once)."""
    inner = model.model
    if getattr(inner, "_streamrl_one_vision_call", False):
        return
    inner.register_forward_pre_hook(_run_tower_once, with_kwargs=True)
    inner._streamrl_one_vision_call = True


def _run_tower_once(
    inner: nn.Module, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    """The forward pre-hook of the Qwen-VL base model: runs the tower and hands its features to
    the forward in place of the pixels."""
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
        features = visual(*_blank_image(visual)).pooler_output
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            embeds = inner.get_input_embeddings()(kwargs["input_ids"])
        kwargs["inputs_embeds"] = embeds + 0.0 * features.sum().to(embeds.dtype)
        return args, kwargs
    pixels = torch.cat([p.type(visual.dtype) for _, p, _ in kinds])
    grids = torch.cat([g for _, _, g in kinds])
    features = visual(pixels, grid_thw=grids).pooler_output
    per_item = torch.split(features, (grids.prod(-1) // visual.spatial_merge_size**2).tolist())
    outputs, start = {}, 0
    for kind, _, grid in kinds:
        items = per_item[start : start + len(grid)]
        start += len(grid)
        outputs[kind] = BaseModelOutputWithPooling(pooler_output=items)
    kwargs.update(pixel_values=None, pixel_values_videos=None, mm_encoder_outputs=outputs)
    return args, kwargs


def _blank_image(visual: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image the tower takes (one merged patch: a grid of merge x merge patches),
    all zeros, with its grid."""
    config = visual.config
    merge = visual.spatial_merge_size
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    device = next(visual.parameters()).device
    pixels = torch.zeros((merge * merge, patch_dim), dtype=visual.dtype, device=device)
    return pixels, torch.tensor([[1, merge, merge]], device=device)
