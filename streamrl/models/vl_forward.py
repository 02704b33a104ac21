"""Per-token log-probs of a Qwen2.5-VL model (transformers) over a sequence with images or videos.

The trainer-side counterpart of what vLLM reports: given the token ids (the prompt already
expanded to one pad token per merged patch, then the response) and the processor's outputs for
the media, return log p(token t | tokens < t) for every t >= 1, in fp32.

Two traps this module exists for (transformers 5.19):

- Qwen-VL models compute their multimodal (3-D) positions only when the forward receives
  `mm_token_type_ids` (0 text, 1 image, 2 video per token). Without them they silently fall
  back to 1-D text positions and the log-probs drift far from vLLM's. They are built here from
  the config's image and video token ids, so callers cannot forget them.
- For a video whose time positions reach past its height and width positions (time step x
  `tokens_per_second` x seconds per step), transformers 5.19 starts the text after it at
  `max(h, w)` (merged) instead of one past the video's largest position, as Qwen2.5-VL's
  original code and vLLM do; every later token then sits at other positions than in vLLM.
  The positions are therefore computed here (`mrope_position_ids`, the vLLM / original rule)
  and passed to the model.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch

TEXT_TYPE, IMAGE_TYPE, VIDEO_TYPE = 0, 1, 2
MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def mm_token_type_ids(config: Any, input_ids_bt: torch.Tensor) -> torch.Tensor:
    """0 for text, 1 for image pad tokens, 2 for video pad tokens (the config's token ids)."""
    types_bt = torch.zeros_like(input_ids_bt, dtype=torch.int32)
    types_bt[input_ids_bt == config.image_token_id] = IMAGE_TYPE
    types_bt[input_ids_bt == config.video_token_id] = VIDEO_TYPE
    return types_bt


def time_positions_per_second(config: Any) -> float:
    """How many time positions one second of video spans: Qwen2.5-VL's
    `vision_config.tokens_per_second`; the Omni thinker's vision config has none, and vLLM then
    takes 25 (transformers names the same number `position_id_per_seconds`)."""
    vision = config.vision_config
    if hasattr(vision, "tokens_per_second"):
        return vision.tokens_per_second
    return getattr(config, "position_id_per_seconds", 25)


def video_blocks(config: Any, video_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """The (t, h, w) grid of every run of video tokens, in order: one per video, except for
    Qwen3-VL, whose processor writes each time step of a video as a run of its own after its
    timestamp (t = 1 each)."""
    if video_grid_thw is None or getattr(config, "model_type", None) != "qwen3_vl":
        return video_grid_thw
    grids = torch.as_tensor(video_grid_thw)
    per_step = grids.repeat_interleave(grids[:, 0], dim=0)
    per_step[:, 0] = 1
    return per_step


def mrope_position_ids(
    config: Any,
    types_bt: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """(3, B, T) time/height/width positions of a batch without padding. Text advances all
    three by one per token; a media block of (t, h, w) merged patches takes time positions
    `int(i * tokens_per_second * seconds_per_step)` (i-th step; 1 step per image) and
    height/width positions 0..h-1 / 0..w-1, all offset by where it starts; the text after it
    starts one past the block's largest position. Media go in order through the batch (a
    Qwen3-VL video as one block per time step, `video_blocks`). Audio
    tokens (the Omni thinker's) count as text here: vLLM and transformers both give them one
    position per token, all three equal."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    video_grid_thw = video_blocks(config, video_grid_thw)
    grids = {
        IMAGE_TYPE: iter(image_grid_thw.tolist() if image_grid_thw is not None else []),
        VIDEO_TYPE: iter(video_grid_thw.tolist() if video_grid_thw is not None else []),
    }
    seconds = iter(second_per_grid_ts.tolist() if second_per_grid_ts is not None else [])
    rows = []
    for types_t in types_bt.tolist():
        parts, start = [], 0
        for kind, group in itertools.groupby(types_t):
            length = len(list(group))
            if kind == TEXT_TYPE:
                parts.append(torch.arange(length).expand(3, -1) + start)
                start += length
                continue
            t, h, w = next(grids[kind])
            factor = 1.0
            if kind == VIDEO_TYPE:
                factor = time_positions_per_second(config) * next(seconds, 1.0)
            steps = (torch.arange(t, dtype=torch.float64) * factor).long()
            grid = torch.stack(
                torch.meshgrid(
                    steps, torch.arange(h // merge), torch.arange(w // merge), indexing="ij"
                )
            ).reshape(3, -1)
            if grid.shape[1] != length:
                raise ValueError(
                    f"a media block has {length} pad tokens but its grid {t}x{h}x{w} (merge "
                    f"{merge}) gives {grid.shape[1]}: the prompt must be expanded by the "
                    f"processor that produced the pixel values"
                )
            parts.append(grid + start)
            start = int(parts[-1].max()) + 1
        rows.append(torch.cat(parts, dim=1))
    return torch.stack(rows, dim=1)


def vl_forward_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    processor_outputs: Mapping[str, Any],
    *,
    with_mm_token_types: bool = True,
) -> torch.Tensor:
    """Log-probs of `input_ids[..., 1:]` under `model` (a Qwen2.5-VL
    `...ForConditionalGeneration`), computed with `log_softmax` in fp32.

    `input_ids` is one sequence (1-D, result 1-D) or a batch without padding (2-D); the media
    in `processor_outputs` (`pixel_values`, `image_grid_thw`, `pixel_values_videos`,
    `video_grid_thw`, `second_per_grid_ts`; other keys are ignored) belong to it in order.
    `with_mm_token_types=False` passes neither `mm_token_type_ids` nor positions, as a caller
    who forgot them would: the model then uses 1-D positions (only for showing what it costs).
    """
    squeeze = input_ids.dim() == 1
    input_ids_bt = (input_ids.unsqueeze(0) if squeeze else input_ids).to(torch.long)
    kwargs: dict[str, Any] = {
        key: torch.as_tensor(processor_outputs[key])
        for key in MEDIA_KEYS
        if processor_outputs.get(key) is not None
    }
    for key in ("pixel_values", "pixel_values_videos"):
        if key in kwargs:
            kwargs[key] = kwargs[key].to(model.dtype)
    if processor_outputs.get("second_per_grid_ts") is not None:
        kwargs["second_per_grid_ts"] = torch.as_tensor(
            processor_outputs["second_per_grid_ts"], dtype=torch.float32
        )
    if with_mm_token_types:
        types_bt = mm_token_type_ids(model.config, input_ids_bt)
        kwargs["mm_token_type_ids"] = types_bt
        kwargs["position_ids"] = mrope_position_ids(
            model.config,
            types_bt,
            kwargs.get("image_grid_thw"),
            kwargs.get("video_grid_thw"),
            kwargs.get("second_per_grid_ts"),
        )
    # Position offsets a previous call left behind must not leak into this one.
    if hasattr(model, "model") and hasattr(model.model, "rope_deltas"):
        model.model.rope_deltas = None
    logits_btv = model(input_ids=input_ids_bt, use_cache=False, **kwargs).logits
    logprobs_btv = torch.log_softmax(logits_btv[:, :-1].float(), dim=-1)
    logprobs_bt = logprobs_btv.gather(-1, input_ids_bt[:, 1:, None]).squeeze(-1)
    return logprobs_bt[0] if squeeze else logprobs_bt
