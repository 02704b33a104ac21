"""The built-in tiny audio-language model: a Qwen2.5-Omni *thinker* (the part that reads audio,
images, video and text and writes text; no talker, no speech output) with a small config, the
project's character-level tokenizer plus Qwen2.5-Omni's special tokens, and a processor (Whisper
log-mel features with 128 bins, PIL images, the numpy video processor).

The directory holds a `Qwen2_5OmniConfig` with `enable_audio_output=False` (only the thinker is
built, its weights named `thinker.*`), which is what vLLM reads (it takes the thinker config out
of the Omni config). transformers loads the thinker alone from it
(`Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained`, `models.loading.load_causal_lm`),
whose forward is what the trainer runs. The Omni model's `from_pretrained` also reads the
speaker table of the speech output (`spk_dict.pt`): an empty one is written. Weights are random
(seeded), fp32.
"""

from __future__ import annotations

from pathlib import Path

from streamrl.models.loading import SPEAKERS_FILE

AUDIO_BOS = "<|audio_bos|>"
AUDIO_EOS = "<|audio_eos|>"
AUDIO_PAD = "<|AUDIO|>"
VISION_BOS = "<|vision_bos|>"
VISION_EOS = "<|vision_eos|>"
IMAGE_PAD = "<|IMAGE|>"
VIDEO_PAD = "<|VIDEO|>"
# The tokenizer attributes the Omni processor reads, and their tokens (Qwen2.5-Omni's own).
OMNI_TOKENS = {
    "audio_bos_token": AUDIO_BOS,
    "audio_eos_token": AUDIO_EOS,
    "audio_token": AUDIO_PAD,
    "vision_bos_token": VISION_BOS,
    "vision_eos_token": VISION_EOS,
    "image_token": IMAGE_PAD,
    "video_token": VIDEO_PAD,
}

# The tokenizer's template, `content` a string or a list of parts: a medium's part becomes its
# placeholder between its begin and end tokens (the processor expands the placeholder to one
# token per audio frame pair or merged patch).
OMNI_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}{{ '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{% elif part['type'] == 'image' %}{{ '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_omni_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The project's character-level tokenizer with Qwen2.5-Omni's seven special tokens
    appended (ids after every existing one, so text ids are unchanged), named as the Omni
    processor looks them up (`tokenizer.audio_token`, ...), and the multimodal chat template."""
    from transformers import PreTrainedTokenizerFast

    from streamrl.models.tokenizer import ASSISTANT, END, PAD, UNK, USER, build_tokenizer

    base = build_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=END,
        bos_token=None,
        additional_special_tokens=[USER, ASSISTANT],
        extra_special_tokens=OMNI_TOKENS,
    )
    tokenizer.chat_template = OMNI_CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_omni_config(
    tokenizer,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    audio_layers: int,
    audio_hidden: int,
):  # -> transformers.Qwen2_5OmniConfig
    """A thinker-only `Qwen2_5OmniConfig` for `tokenizer` (vocab padded to a multiple of 128,
    its special token ids): a `num_layers` text model with 3-D rotary positions, an
    `audio_layers` audio encoder and the smallest vision tower the config takes (one block)."""
    from transformers import Qwen2_5OmniConfig

    from streamrl.models.tiny_vl import tiny_text_config, vision_tower_shape

    text_config = tiny_text_config(
        tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads
    )
    text_config["tie_word_embeddings"] = False
    ids = tokenizer.convert_tokens_to_ids
    audio_config = dict(
        num_mel_bins=128,
        encoder_layers=audio_layers,
        encoder_attention_heads=max(1, audio_hidden // 32),
        encoder_ffn_dim=audio_hidden * 2,
        d_model=audio_hidden,
        output_dim=hidden_size,
    )
    vision_config = {**vision_tower_shape(1, 32, hidden_size), "fullatt_block_indexes": [0]}
    thinker_config = dict(
        text_config=text_config,
        audio_config=audio_config,
        vision_config=vision_config,
        audio_token_index=ids(AUDIO_PAD),
        image_token_index=ids(IMAGE_PAD),
        video_token_index=ids(VIDEO_PAD),
        audio_start_token_id=ids(AUDIO_BOS),
        audio_end_token_id=ids(AUDIO_EOS),
        vision_start_token_id=ids(VISION_BOS),
        vision_end_token_id=ids(VISION_EOS),
        user_token_id=ids("<|user|>"),
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2_5OmniConfig(
        thinker_config=thinker_config, enable_audio_output=False, torch_dtype="float32"
    )


def build_processor(tokenizer, *, min_pixels: int = 28 * 28, max_pixels: int = 112 * 112):
    """A Qwen2.5-Omni processor around `tokenizer`: Whisper features with 128 mel bins at
    16 kHz, the PIL image processor and the numpy video processor."""
    from transformers import Qwen2_5OmniProcessor, WhisperFeatureExtractor

    from streamrl.models.processors import vision_processors

    image_processor, video_processor = vision_processors(min_pixels, max_pixels)
    return Qwen2_5OmniProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )


def build_tiny_omni_model_dir(
    out_dir: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    audio_layers: int = 1,
    audio_hidden: int = 32,
    seed: int = 0,
) -> Path:
    """Create a randomly initialised tiny Qwen2.5-Omni thinker plus tokenizer and processor in
    `out_dir` (HF format; module docstring). The default 2 heads make head_dim 32: vLLM's CPU
    attention has no kernel for head_dim 16."""
    import torch
    from transformers import Qwen2_5OmniForConditionalGeneration

    tokenizer = build_omni_tokenizer()
    config = tiny_omni_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        audio_layers=audio_layers,
        audio_hidden=audio_hidden,
    )
    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).to(torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    torch.save({}, out_dir / SPEAKERS_FILE)
    build_processor(tokenizer).save_pretrained(str(out_dir))
    return out_dir
