"""The built-in tiny vision-language models: a standard Qwen2_5_VLForConditionalGeneration or
Qwen3VLForConditionalGeneration with a small config, the project's character-level tokenizer
plus the Qwen-VL vision tokens, and a processor (PIL image processor, numpy video processor:
`streamrl.models.processors`).

Qwen3-VL differs from Qwen2.5-VL where the roles must follow it: a Qwen3 decoder (query/key
norms), 16-pixel patches normalised to [-1, 1], rotary frequencies that take turns among time,
height and width (`mrope_interleaved`), "deepstack" features of earlier vision blocks added to
the first decoder layers' outputs at the image tokens, and a video as one block of tokens per
time step, each after its timestamp in the text (`<0.5 seconds>`).

Like `streamrl.models.tiny`, the directory is written with `save_pretrained`, so it loads in
transformers (`from_pretrained` and `processors.load_processor`) and in vLLM
(`processors.install_vllm_shims()` first). Weights are random (seeded), fp32.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from streamrl.models.processors import build_processor, processor_family
from streamrl.models.tokenizer import build_tokenizer

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

# The tokenizer's template, with `content` either a string or a list of parts: text parts are
# written out, an image or video part becomes its placeholder (which the processor expands to
# one pad token per merged patch).
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_vl_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The project's character-level tokenizer with the four vision tokens appended (ids after
    every existing one, so text ids are unchanged) and the multimodal chat template."""
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(VISION_TOKENS, special_tokens=True)
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def tiny_text_config(
    tokenizer, *, hidden_size: int, num_layers: int, num_heads: int
) -> dict[str, Any]:
    """The language model's config of the tiny multimodal models (Qwen2.5-VL's, Qwen2.5-Omni's
    thinker's): the tiny text model's shape, the vocabulary padded to a multiple of 128, and
    multimodal rotary sections that fit the head."""
    head_dim = hidden_size // num_heads
    if head_dim % 8:
        raise ValueError(f"hidden_size / num_heads = {head_dim} must be a multiple of 8 (mrope)")
    # Multimodal RoPE splits the head's rotary frequencies into (time, height, width) sections.
    half = head_dim // 2
    mrope_section = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    return dict(
        vocab_size=((len(tokenizer) + 127) // 128) * 128,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=2048,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": mrope_section,
        },
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def vision_tower_shape(depth: int, width: int, out_width: int) -> dict[str, int]:
    """The size settings of a tiny Qwen-VL vision tower: `depth` blocks `width` wide (heads of
    32), its merged features `out_width` wide (the language model's)."""
    return dict(
        depth=depth,
        hidden_size=width,
        intermediate_size=width * 2,
        num_heads=max(1, width // 32),
        out_hidden_size=out_width,
    )


def vision_token_ids(tokenizer) -> dict[str, int]:
    """A Qwen-VL config's placeholder and vision start/end token ids in `tokenizer`."""
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        image_token_id=ids(IMAGE_PAD),
        video_token_id=ids(VIDEO_PAD),
        vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END),
    )


def tiny_qwen2_5_vl_config(
    tokenizer,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    vision_depth: int,
    vision_hidden: int,
):  # -> transformers.Qwen2_5_VLConfig
    """A `Qwen2_5_VLConfig` for `tokenizer` (vocab padded to a multiple of 128, its special
    token ids) with a `num_layers` text model and a `vision_depth` vision tower."""
    from transformers import Qwen2_5_VLConfig

    text_config = tiny_text_config(
        tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads
    )
    vision_config = vision_tower_shape(vision_depth, vision_hidden, hidden_size)
    return Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config={**vision_config, "fullatt_block_indexes": [vision_depth - 1]},
        **vision_token_ids(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def tiny_qwen3_vl_config(
    tokenizer,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    vision_depth: int,
    vision_hidden: int,
    max_pixels: int,
):  # -> transformers.Qwen3VLConfig
    """A `Qwen3VLConfig` for `tokenizer` with a `num_layers` text model and a `vision_depth`
    vision tower whose first blocks also feed the first decoder layers (deepstack: one per
    block, all but the last decoder layer), its learned position grid large enough for
    `max_pixels` images."""
    from transformers import Qwen3VLConfig

    text_config = tiny_text_config(
        tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads
    )
    # Interleaved sections: frequency i turns with height when i % 3 == 1 (the first
    # `sections[1]` such), with width when i % 3 == 2, else with time.
    half = hidden_size // num_heads // 2
    spatial = (half - 1) // 3
    text_config["head_dim"] = hidden_size // num_heads
    text_config["rope_parameters"].update(
        mrope_section=[half - 2 * spatial, spatial, spatial], mrope_interleaved=True
    )
    patch = processor_family("qwen3_vl")[0]
    side = math.isqrt(max_pixels) // patch + 1
    vision_config = dict(
        **vision_tower_shape(vision_depth, vision_hidden, hidden_size),
        patch_size=patch,
        num_position_embeddings=side * side,
        # Not into the last decoder layer, whose output at an image token reaches no later
        # token (a response's loss would give those features no gradient).
        deepstack_visual_indexes=list(range(max(1, min(vision_depth, num_layers - 1)))),
    )
    return Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        **vision_token_ids(tokenizer),
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def build_tiny_vl_model_dir(
    out_dir: Path,
    *,
    family: str = "qwen2_5_vl",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    seed: int = 0,
) -> Path:
    """Create a randomly initialised tiny Qwen2.5-VL (`family="qwen2_5_vl"`) or Qwen3-VL
    (`"qwen3_vl"`) model plus tokenizer and processor in `out_dir` (HF format). Images and video
    frames are resized to [min_pixels, max_pixels] (by default a 56x56 image becomes 4 merged
    tokens in either family). The default 2 heads make head_dim 32: vLLM's CPU attention has no
    kernel for head_dim 16 ("Unsupported CPU attention configuration")."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    factor = processor_family(family)[0] * 2  # one merged token's side in pixels
    min_pixels = min_pixels if min_pixels is not None else factor * factor
    max_pixels = max_pixels if max_pixels is not None else (4 * factor) ** 2
    tokenizer = build_vl_tokenizer()
    shape = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        vision_depth=vision_depth,
        vision_hidden=vision_hidden,
    )
    torch.manual_seed(seed)
    if family == "qwen3_vl":
        config = tiny_qwen3_vl_config(tokenizer, **shape, max_pixels=max_pixels)
        model = Qwen3VLForConditionalGeneration(config).to(torch.float32)
    else:
        config = tiny_qwen2_5_vl_config(tokenizer, **shape)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    processor = build_processor(
        tokenizer, min_pixels=min_pixels, max_pixels=max_pixels, family=family
    )
    processor.save_pretrained(str(out_dir))
    return out_dir
