"""Multimodal models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; the Qwen2.5-Omni thinker, which hears
audio) as the roles see them: which models are, where their language model sits, and the
keyword arguments their forward needs for a batch.

A Qwen-VL forward computes 3-D rotary positions only when it is given the token types
(`mm_token_type_ids`); without them it silently falls back to 1-D positions and its log-probs
drift far from an engine's. `forward_media_kwargs` passes them, with the batch's media and the
3-D positions computed by vLLM's rule (`vl_forward.mrope_position_ids`: transformers 5.19 places
text after a video differently), each row's from its first real token (left padding).

The Omni thinker takes no token types (its forward computes its own positions, by the same
rule for images and audio; the ones passed here are vLLM's, see `vl_forward`): audio tokens
advance all three positions by one each, like text. Its audio goes in as `input_features` (log-mel
frames, padded to the batch's longest clip) with `feature_attention_mask` marking the real
frames.

The placeholder tokens (`<|image_pad|>`, `<|video_pad|>`; the Omni thinker's `<|IMAGE|>`,
`<|VIDEO|>`, `<|AUDIO|>`) stand for media the prompt holds; a response that sampled one could
not be run again. The engines never sample them and the
trainer's distribution leaves them out alike (`placeholder_ids`), so both renormalise over the
same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from streamrl.models.vl_forward import mm_token_type_ids, mrope_position_ids, video_blocks

# Media inputs that take the model's dtype (the rest are sizes and masks).
FLOAT_INPUTS = ("pixel_values", "pixel_values_videos", "input_features")


def is_vision_language(model) -> bool:
    """Whether `model` is a Qwen-VL model (a language model under `model.model.language_model`
    beside a vision tower `model.model.visual`)."""
    inner = getattr(model, "model", None)
    return hasattr(inner, "language_model") and hasattr(inner, "visual")


def is_omni_thinker(model) -> bool:
    """Whether `model` is a Qwen2.5-Omni thinker (an audio tower and a vision tower beside its
    text model, which sits directly under `model.model`)."""
    return hasattr(model, "audio_tower") and hasattr(model, "visual")


def is_multimodal(model) -> bool:
    """Whether `model` reads media: a Qwen-VL model or an Omni thinker."""
    return is_vision_language(model) or is_omni_thinker(model)


def tower_owner(model):
    """The module that holds a multimodal model's towers and their `get_*_features` methods:
    an Omni thinker itself, a Qwen-VL model's inner `model.model`."""
    return model if is_omni_thinker(model) else model.model


def text_model(model):
    """The decoder stack (`layers`, `embed_tokens`, `norm`, `rotary_emb`) of a causal LM or of
    a multimodal model's language model."""
    return model.model.language_model if is_vision_language(model) else model.model


def freeze_vision(model) -> int:
    """Keep the vision tower's parameters fixed (`model.freeze_vision`), and an Omni thinker's
    audio tower's too: `requires_grad` off, so the optimizer, built afterwards, leaves them out
    and no gradient is computed for them. Returns how many parameters were frozen; a model
    without a vision tower is an error."""
    if is_omni_thinker(model):
        towers = [model.visual, model.audio_tower]
    elif is_vision_language(model):
        towers = [model.model.visual]
    else:
        raise ValueError(
            f"model.freeze_vision=true, but {type(model).__name__} has no vision tower: freezing "
            "applies to a vision-language policy (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or an Omni thinker; "
            "set it to false"
        )
    params = [param for tower in towers for param in tower.parameters()]
    for param in params:
        param.requires_grad_(False)
    return len(params)


def placeholder_ids(model) -> list[int]:
    """The media placeholder token ids of a multimodal model (never sampled)."""
    ids = [model.config.image_token_id, model.config.video_token_id]
    audio = getattr(model.config, "audio_token_id", None)
    return ids if audio is None else [*ids, audio]


def forward_media_kwargs(
    model,
    input_ids_bt: torch.Tensor,
    attention_mask_bt: torch.Tensor,
    media: Mapping[str, Any],
) -> dict[str, Any]:
    """The keyword arguments beside `input_ids` and `attention_mask` of a Qwen-VL or Omni
    thinker forward over the left-padded `input_ids_bt` whose media are `media` (concatenated
    in row order; empty for text): token types (Qwen-VL), 3-D `position_ids` and the media
    tensors."""
    device = input_ids_bt.device
    types_bt = mm_token_type_ids(model.config, input_ids_bt) * attention_mask_bt.to(torch.int32)
    omni = is_omni_thinker(model)
    kwargs: dict[str, Any] = {} if omni else {"mm_token_type_ids": types_bt}
    dtype = next(model.parameters()).dtype
    for name, value in media.items():
        value = torch.as_tensor(value).to(device)
        kwargs[name] = value.to(dtype) if name in FLOAT_INPUTS else value
    # Per row: the positions of its real tokens (media in row order), zeros on padding.
    positions = torch.zeros((3, *input_ids_bt.shape), dtype=torch.long)
    grids = {
        "image_grid_thw": kwargs.get("image_grid_thw"),
        "video_grid_thw": video_blocks(model.config, kwargs.get("video_grid_thw")),
    }
    done = {"image_grid_thw": 0, "video_grid_thw": 0, "second_per_grid_ts": 0}
    # The Omni processor names a video's seconds per time step otherwise.
    seconds_key = "video_second_per_grid" if omni else "second_per_grid_ts"
    for row in range(input_ids_bt.shape[0]):
        real = attention_mask_bt[row].bool().cpu()
        types_t = types_bt[row].cpu()[real][None]
        counts = {1: int(_blocks(types_t, 1)), 2: int(_blocks(types_t, 2))}
        image = _take(grids["image_grid_thw"], done, "image_grid_thw", counts[1])
        video = _take(grids["video_grid_thw"], done, "video_grid_thw", counts[2])
        seconds = _take(kwargs.get(seconds_key), done, "second_per_grid_ts", counts[2])
        positions[:, row, real] = mrope_position_ids(model.config, types_t, image, video, seconds)[
            :, 0
        ]
    kwargs["position_ids"] = positions.to(device)
    # The model keeps the last call's position offsets for decoding; a new batch starts afresh.
    for holder in (model, model.model):
        if getattr(holder, "rope_deltas", None) is not None:
            holder.rope_deltas = None
    return kwargs


def _blocks(types_1t: torch.Tensor, kind: int) -> torch.Tensor:
    """How many runs of `kind` tokens the row has (one per image or video)."""
    is_kind = (types_1t[0] == kind).int()
    return (is_kind[1:] > is_kind[:-1]).sum() + is_kind[0]


def _take(values, done: dict[str, int], name: str, num: int):
    """The next `num` entries of a batch-wide media tensor (None if none)."""
    if values is None or num == 0:
        return None
    start = done[name]
    done[name] = start + num
    return values[start : start + num].cpu()
