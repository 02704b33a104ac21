"""Audio prompts through the tiny Qwen2.5-Omni thinker: the model directory, the feeder's
preparation and the trainer's log-probs (vLLM's agree with them: `test_vllm_audio.py`).

The builtin engine runs the thinker, and its log-probs are the trainer's. The trainer's forward
(`response_logprobs`, with the positions `forward_media_kwargs` computes by
vLLM's rule) gives exactly the log-probs of the thinker's own forward, which computes its own
positions, for audio prompts, an audio-and-image prompt and text rows batched together.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.media.cache import MediaCache
from streamrl.media.load import MediaLimits, encode_wav
from streamrl.media.prepare import MediaPreparer, _short_audio_padding, bus_value, row_media
from streamrl.media.refs import MediaRef, MultimodalPrompt
from streamrl.models.loading import (
    SPEAKERS_FILE,
    is_multimodal_dir,
    is_omni_dir,
    load_causal_lm,
    save_model,
)
from streamrl.models.processors import load_processor
from streamrl.models.tiny_omni import build_tiny_omni_model_dir
from streamrl.models.vision import freeze_vision, placeholder_ids
from streamrl.rollout.builtin_engine import BuiltinEngine
from streamrl.rollout.decoder_runner import unsupported
from streamrl.rollout.vision_prompts import prompt_inputs
from streamrl.trainer.checkpoint import copy_model_files, model_weights, read_weights
from streamrl.trainer.logprobs import pack, response_logprobs
from tests.unit.test_vision_roles import generate_across_update, trainer_logprobs


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    return build_tiny_omni_model_dir(tmp_path_factory.mktemp("omni") / "model", seed=3)


@pytest.fixture(scope="module")
def preparer(omni_dir, tmp_path_factory) -> MediaPreparer:
    store = MediaCache(tmp_path_factory.mktemp("media"))
    return MediaPreparer(load_processor(omni_dir), store, MediaLimits())


@pytest.fixture(scope="module")
def model(omni_dir):
    return load_causal_lm(omni_dir)


def sine_wav(seconds: float = 1.0, freq: float = 440.0, rate: int = 16000) -> bytes:
    """A 16-bit mono sine tone as WAV bytes."""
    t = np.arange(int(rate * seconds)) / rate
    return encode_wav(0.3 * np.sin(2 * np.pi * freq * t), rate)


def _png(color, size=(84, 56)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def audio_rows(preparer: MediaPreparer) -> list[dict]:
    """Two audio prompts (1 s and 2.3 s), an audio-and-image prompt and a text prompt, as rows
    on the bus (prompt ids and the media store's key)."""
    ask = [{"type": "audio"}, {"type": "text", "text": "What pitch?"}]
    both = [
        {"type": "text", "text": "Hear"},
        {"type": "audio"},
        {"type": "text", "text": "see"},
        {"type": "image"},
    ]
    prompts = [
        MultimodalPrompt([{"role": "user", "content": ask}], (MediaRef("audio", data=sine_wav()),)),
        MultimodalPrompt(
            [{"role": "user", "content": ask}], (MediaRef("audio", data=sine_wav(2.3, 880.0)),)
        ),
        MultimodalPrompt(
            [{"role": "user", "content": both}],
            (MediaRef("audio", data=sine_wav(1.3, 300.0)), MediaRef("image", data=_png("red"))),
        ),
    ]
    rows = []
    for prompt in prompts:
        prepared = preparer.prepare(prompt, "test prompt")
        rows.append(
            {F.PROMPT_IDS: prepared.prompt_ids, F.MEDIA: bus_value(prepared, preparer.cache)}
        )
    text = preparer.processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=True
    )
    text_ids = text["input_ids"] if hasattr(text, "keys") else text
    rows.append({F.PROMPT_IDS: np.asarray(list(text_ids)), F.MEDIA: None})
    return rows


def test_the_directory_loads_the_thinker_and_its_processor(omni_dir, model, preparer) -> None:
    assert is_multimodal_dir(omni_dir) and (omni_dir / SPEAKERS_FILE).is_file()
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert model.model.layers[0].self_attn.head_dim == 32  # vLLM's CPU attention has no 16
    processor = preparer.processor
    assert processor.feature_extractor.feature_size == 128
    tokenizer = processor.tokenizer
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (processor.audio_token, "<|audio_bos|>")]
    assert ids == [model.config.audio_token_id, model.config.audio_start_token_id]
    assert model.config.audio_token_id in placeholder_ids(model)
    # Text ids are the plain tokenizer's: the special tokens come after them.
    assert tokenizer("1+2=")["input_ids"] == [tokenizer.convert_tokens_to_ids(c) for c in "1+2="]


def test_an_audio_prompt_is_expanded_and_its_features_stored(preparer) -> None:
    rows = audio_rows(preparer)
    tokenizer = preparer.processor.tokenizer
    audio_id = tokenizer.convert_tokens_to_ids(preparer.processor.audio_token)
    ids = rows[0][F.PROMPT_IDS].tolist()
    # 1 s at 16 kHz: 100 log-mel frames, 25 tokens after the audio tower's two stride-2 steps.
    assert ids.count(audio_id) == 25
    start = ids.index(audio_id)
    assert tokenizer.convert_ids_to_tokens([ids[start - 1], ids[start + 25]]) == [
        "<|audio_bos|>",
        "<|audio_eos|>",
    ]
    assert rows[1][F.PROMPT_IDS].tolist().count(audio_id) == 57  # 2.3 s
    media = row_media(rows)
    first = media[0]
    assert first["input_features"].shape == (1, 128, 100)  # the 30 s padding left out
    assert int(first["feature_attention_mask"].sum()) == 100
    assert first["decoded"][0][0] == "audio" and first["decoded"][0][1].shape == (16000,)
    assert media[2]["image_grid_thw"].tolist() == [[1, 4, 6]] and media[3] is None
    assert preparer.num_media == {"audio": 3, "image": 1}


def _own_forward_logprobs(model, prompt_ids, response_ids, media) -> torch.Tensor:
    """The thinker's forward on one unpadded row, with the positions it computes itself."""
    ids = torch.tensor([[*prompt_ids, *response_ids]])
    inputs = {
        key: media[key]
        for key in ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw")
        if media and key in media
    }
    model.rope_deltas = None
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[0]
    logits = logits[len(prompt_ids) - 1 : -1].float()
    logits[:, placeholder_ids(model)] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0]


def test_trainer_log_probs_are_the_thinkers_own(model, preparer) -> None:
    rows = audio_rows(preparer)
    media = row_media(rows)
    prompts = [r[F.PROMPT_IDS].tolist() for r in rows]
    responses = [[5, 9, 17, 30, 2], [40, 41], [7, 7, 7], [12, 13, 14, 15]]
    batch = pack(prompts, responses, preparer.processor.tokenizer.pad_token_id, media=media)
    with torch.no_grad():
        logp_br = response_logprobs(model, batch)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        own = _own_forward_logprobs(model, prompt, response, media[i])
        gap = (logp_br[i, : len(response)] - own).abs().max()
        assert float(gap) <= 1e-5, (i, float(gap))
    # The audio matters: other features give other log-probs for the same tokens (by about
    # 6e-4 on average in the random tiny model).
    moved = [dict(m) if m else m for m in media]
    features = moved[0]["input_features"]
    noise = torch.randn(features.shape, generator=torch.Generator().manual_seed(0))
    moved[0]["input_features"] = features + noise
    batch = pack(prompts, responses, 0, media=moved)
    with torch.no_grad():
        shifted = response_logprobs(model, batch)
    assert float((shifted[0] - logp_br[0]).abs().mean()) > 1e-4


def test_a_processor_without_audio_refuses_an_audio_prompt(tmp_path) -> None:
    """Qwen2.5-VL's processor takes `audio=` and drops it silently; the feeder leaves such a
    prompt out instead of training on it without its audio."""
    from streamrl.models.tiny_vl import build_tiny_vl_model_dir

    vl = build_tiny_vl_model_dir(tmp_path / "vl")
    preparer = MediaPreparer(load_processor(vl), MediaCache(tmp_path / "media"), MediaLimits())
    ask = [{"type": "audio"}, {"type": "text", "text": "What pitch?"}]
    prompt = MultimodalPrompt(
        [{"role": "user", "content": ask}], (MediaRef("audio", data=sine_wav()),)
    )
    assert preparer.prepare(prompt, "test prompt") is None
    assert preparer.dropped == {"unsupported": 1}


def _engine_requests(rows) -> list[GenerationRequest]:
    media = row_media(rows)
    return [
        GenerationRequest(f"r{i}", [int(t) for t in row[F.PROMPT_IDS]], m)
        for i, (row, m) in enumerate(zip(rows, media, strict=True))
    ]


def _gaps(model, requests, results, pad_token_id, versions=None) -> list[float]:
    """Per row, the largest |engine - trainer| log-prob over its tokens (of `versions`)."""
    trained = trainer_logprobs(model, requests, results, pad_token_id)
    gaps = []
    for i, res in enumerate(results):
        keep = [k for k, v in enumerate(res.versions) if versions is None or v in versions]
        gap = trained[i, keep] - torch.tensor(res.logprobs)[keep]
        gaps.append(float(gap.abs().max()) if keep else 0.0)
    return gaps


def test_builtin_engine_and_trainer_agree_on_audio(omni_dir, preparer) -> None:
    """The builtin engine runs the thinker (audio tower, image tower, 3-D positions): its
    log-probs of its own samples are the trainer's, before and across a weight update."""
    from transformers import AutoConfig

    # The directory's config (the whole Omni model's, as preflight reads it) passes too.
    assert unsupported(AutoConfig.from_pretrained(omni_dir)) is None
    model = load_causal_lm(omni_dir)
    tokenizer = preparer.processor.tokenizer
    requests = _engine_requests(audio_rows(preparer))
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    results = engine.generate(requests, SamplingParams(max_new_tokens=8, temperature=1.0, seed=4))
    assert all(not set(placeholder_ids(model)) & set(r.response_ids) for r in results)
    gaps = _gaps(model, requests, results, tokenizer.pad_token_id)
    assert max(gaps) <= 1e-5, gaps

    results = generate_across_update(engine, requests, model, "audio_tower", max_new_tokens=8)
    assert engine.version == 1 and any(0 in r.versions and 1 in r.versions for r in results)
    gaps = _gaps(model, requests, results, tokenizer.pad_token_id, versions={1})
    assert max(gaps) <= 1e-5, gaps


def test_audio_placeholders_without_features_are_refused(model, preparer) -> None:
    rows = audio_rows(preparer)
    ids = torch.as_tensor(rows[0][F.PROMPT_IDS])
    with pytest.raises(ValueError, match="audio placeholder tokens but no audio input"):
        prompt_inputs(model, ids, None)


def test_a_saved_thinker_is_an_omni_directory_that_loads_back(omni_dir, tmp_path) -> None:
    """Checkpoints and the warm start save the thinker as the Omni directory it came from
    (`thinker.*` weights, `thinker_config`), which vLLM reads (`test_vllm_audio.py` starts its
    engine from one) and the roles load the thinker from again."""
    model = load_causal_lm(omni_dir)
    with torch.no_grad():
        model.audio_tower.conv1.weight.add_(1.0)
    out = tmp_path / "saved"
    save_model(model, out)
    copy_model_files(omni_dir, out)
    assert is_omni_dir(out) and (out / SPEAKERS_FILE).is_file()
    assert all(name.startswith("thinker.") for name in read_weights(out))
    weights = model_weights(out)
    own = model.state_dict()
    assert set(weights) == set(own)
    assert all(torch.equal(weights[name], own[name]) for name in own)
    again = load_causal_lm(out)
    assert torch.equal(again.audio_tower.conv1.weight, model.audio_tower.conv1.weight)
    assert load_processor(out).feature_extractor.feature_size == 128


def test_freeze_vision_keeps_both_towers_of_the_thinker_fixed(omni_dir) -> None:
    model = load_causal_lm(omni_dir)
    frozen = freeze_vision(model)
    towers = [*model.visual.parameters(), *model.audio_tower.parameters()]
    assert frozen == len(towers) and not any(p.requires_grad for p in towers)
    assert all(p.requires_grad for p in model.model.parameters())


def test_features_are_the_30_second_padded_ones_without_their_cost(preparer) -> None:
    """The feeder pads clips to the longest plus one STFT window, not to 30 s: every real frame
    is bit for bit what the processor's default gives (and what vLLM computes from the clip)."""
    processor = preparer.processor
    clips = [np.sin(np.arange(n) * 0.07).astype(np.float32) * 0.3 for n in (16000, 36801, 20013)]
    parts = [{"type": "audio"}] * 3 + [{"type": "text", "text": "Which?"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True
    )
    full = processor(text=[text], audio=clips, sampling_rate=16000, return_tensors="pt")
    short = processor(
        text=[text],
        audio=clips,
        sampling_rate=16000,
        return_tensors="pt",
        **_short_audio_padding(processor, clips),
    )
    assert full["input_features"].shape[-1] == 3000 and short["input_features"].shape[-1] < 400
    assert torch.equal(full["input_ids"], short["input_ids"])
    for i, frames in enumerate(full["feature_attention_mask"].sum(-1).tolist()):
        assert short["feature_attention_mask"][i].sum() == frames
        assert torch.equal(
            short["input_features"][i, :, :frames], full["input_features"][i, :, :frames]
        )
