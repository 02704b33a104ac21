"""The vLLM engine on the tiny Qwen2.5-VL and Qwen3-VL (fp32, in process): images and videos go in as the
request's media, and on identical weights its log-probs are the trainer's (`response_logprobs`)
for image, video and text prompts batched together; again after a weight update that changes
the vision tower (the same image sent again works: the encoder cache was reset), and across an
in-flight update. The placeholder tokens, which a random model at a high temperature would
sample, are never sampled, and the log-probs are those of the distribution without them.

Needs vLLM (`make install-vllm`); skipped without it unless STREAMRL_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams
from streamrl.config.schema import VllmConfig
from streamrl.media.cache import MediaCache
from streamrl.media.load import MediaLimits
from streamrl.media.prepare import MediaPreparer, bus_value, row_media
from streamrl.media.refs import MediaRef, MultimodalPrompt
from streamrl.models.loading import load_causal_lm
from streamrl.models.processors import load_processor
from streamrl.models.tiny_vl import build_tiny_vl_model_dir
from streamrl.models.vision import placeholder_ids
from streamrl.trainer.logprobs import pack, response_logprobs
from tests.vllm_required import skip_module_without_vllm

skip_module_without_vllm()

from streamrl.rollout.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.slow

# fp32 engine vs fp32 trainer on identical weights; measured mean ~1e-7.
MEAN_TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_dir(tmp_path_factory: pytest.TempPathFactory, request) -> Path:
    """Each family: Qwen3-VL's video is a run of placeholders per time step, each after its
    timestamp, which the engine's prompt collapses and vLLM writes again from the frames."""
    out = tmp_path_factory.mktemp(request.param) / "model"
    return build_tiny_vl_model_dir(out, family=request.param, seed=3)


@pytest.fixture(scope="module")
def preparer(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> MediaPreparer:
    store = MediaCache(tmp_path_factory.mktemp("media"))
    return MediaPreparer(load_processor(vl_dir), store, MediaLimits(max_frames=8))


@pytest.fixture(scope="module")
def model(vl_dir: Path):
    return load_causal_lm(vl_dir)


@pytest.fixture(scope="module")
def engine(vl_dir: Path, preparer: MediaPreparer):
    engine = VllmEngine(
        vl_dir,
        eos_token_id=preparer.processor.tokenizer.eos_token_id,
        config=VllmConfig(
            kv_cache_gib=0.25,
            max_model_len=512,
            engine_kwargs={"limit_mm_per_prompt": {"image": 2, "video": 1}},
        ),
        max_num_seqs=32,
    )
    yield engine
    engine.close()


def _png(color, size=(56, 56)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def _video(folder: Path) -> str:
    frames = np.zeros((4, 56, 56, 3), np.uint8)
    for t in range(4):  # a square moving right
        frames[t, 20:36, 8 + 10 * t : 24 + 10 * t] = (200, 30, 30)
    path = folder / "moving.npy"
    np.save(path, frames)
    return str(path)


@pytest.fixture(scope="module")
def requests(preparer: MediaPreparer, tmp_path_factory) -> list[GenerationRequest]:
    """An image prompt, a video prompt, a two-image prompt and a text prompt, built the way the
    feeder and the rollout role build them (`tests/unit/test_vision_roles.py`)."""
    folder = tmp_path_factory.mktemp("video")
    image = [{"type": "image"}, {"type": "text", "text": "How many red shapes?"}]
    video = [{"type": "video"}, {"type": "text", "text": "Which way?"}]
    two = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    prompts = [
        MultimodalPrompt(
            [{"role": "user", "content": image}], (MediaRef("image", data=_png("red")),)
        ),
        MultimodalPrompt(
            [{"role": "user", "content": video}], (MediaRef("video", path=_video(folder)),)
        ),
        MultimodalPrompt(
            [{"role": "user", "content": two}],
            (MediaRef("image", data=_png("blue", (84, 56))), MediaRef("image", data=_png("green"))),
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
    media = row_media(rows)
    return [
        GenerationRequest(f"r{i}", [int(t) for t in row[F.PROMPT_IDS]], m)
        for i, (row, m) in enumerate(zip(rows, media, strict=True))
    ]


def trainer_logprobs(model, requests, results: list[GenerationResult], temperature: float):
    batch = pack(
        [r.prompt_ids for r in requests],
        [res.response_ids for res in results],
        pad_token_id=0,
        media=[r.media for r in requests],
    )
    with torch.no_grad():
        logprobs_br = response_logprobs(model, batch, temperature)
    return [logprobs_br[i, : len(res.logprobs)] for i, res in enumerate(results)]


def gaps(model, requests, results, temperature: float = 1.0) -> torch.Tensor:
    """|engine - trainer| over every token of every result."""
    want = trainer_logprobs(model, requests, results, temperature)
    return torch.cat(
        [(torch.tensor(r.logprobs) - w).abs() for r, w in zip(results, want, strict=True)]
    )


def perturbed(model, scale: float = 0.05):
    """A copy of `model` with noise on its vision tower and its first text layer."""
    torch.manual_seed(1)
    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in out.named_parameters():
            if "visual" in name or "layers.0." in name:
                param.add_(torch.randn_like(param) * scale)
    return out


def reset(engine: VllmEngine, model) -> None:
    engine.load_weights(engine.version + 1, dict(model.named_parameters()))


def test_image_video_and_text_log_probs_are_the_trainers(engine, model, requests) -> None:
    reset(engine, model)
    results = engine.generate(requests, SamplingParams(max_new_tokens=10, temperature=1.0, seed=5))
    assert all(len(r.response_ids) > 0 for r in results)
    gap = gaps(model, requests, results)
    assert float(gap.mean()) <= MEAN_TOLERANCE, (float(gap.mean()), float(gap.max()))
    # The media matter: the same tokens after other pixels have other log-probs.
    moved = [copy.copy(r) for r in requests]
    moved[0].media = {**moved[0].media, "pixel_values": moved[0].media["pixel_values"] + 0.5}
    assert (
        float(gaps(model, moved, results)[: len(results[0].logprobs)].mean()) > 100 * MEAN_TOLERANCE
    )


def test_a_clip_the_feeder_samples_reaches_vllm_as_sampled(
    engine, model, vl_dir, tmp_path_factory
) -> None:
    """A processor that samples frames (Qwen3-VL's: 2 a second) takes 4 of a 16-frame clip at 8
    a second; vLLM gets those 4 with their indices, writes the same timestamps, and agrees."""
    if model.config.model_type != "qwen3_vl":
        pytest.skip("Qwen2.5-VL's processor takes every frame it is given")
    folder = tmp_path_factory.mktemp("clip")
    frames = np.zeros((16, 56, 56, 3), np.uint8)
    for t in range(16):  # a square moving right, 2 pixels a frame
        frames[t, 20:36, 2 + 2 * t : 18 + 2 * t] = (200, 30, 30)
    np.save(folder / "clip.npy", frames)
    store = MediaCache(folder / "media")
    preparer = MediaPreparer(load_processor(vl_dir), store, MediaLimits(max_frames=16, video_fps=8))
    content = [{"type": "video"}, {"type": "text", "text": "Which way?"}]
    prompt = MultimodalPrompt(
        [{"role": "user", "content": content}], (MediaRef("video", path=str(folder / "clip.npy")),)
    )
    prepared = preparer.prepare(prompt, "test prompt")
    (media,) = row_media([{F.PROMPT_IDS: prepared.prompt_ids, F.MEDIA: bus_value(prepared, store)}])
    assert media["video_frames"].tolist() == [0, 5, 10, 15] and len(media["decoded"][0][1]) == 4
    requests = [GenerationRequest("clip", [int(t) for t in prepared.prompt_ids], media)]
    reset(engine, model)
    results = engine.generate(requests, SamplingParams(max_new_tokens=10, temperature=1.0, seed=5))
    gap = gaps(model, requests, results)
    assert float(gap.mean()) <= MEAN_TOLERANCE, (float(gap.mean()), float(gap.max()))


def test_an_update_reaches_the_vision_tower_and_the_image_can_come_again(
    engine, model, requests
) -> None:
    reset(engine, model)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    engine.generate(requests, params)  # the media are in vLLM's caches now
    new = perturbed(model)
    version = engine.version + 1
    engine.load_weights(version, dict(new.named_parameters()))
    results = engine.generate(requests, params)  # the same media again, under new weights
    assert all(set(r.versions) == {version} for r in results)
    gap = gaps(new, requests, results)
    assert float(gap.mean()) <= MEAN_TOLERANCE, (float(gap.mean()), float(gap.max()))
    # Not the old weights' log-probs (the reload reached the vision tower and layer 0).
    assert float(gaps(model, requests, results).mean()) > 100 * MEAN_TOLERANCE


def test_in_flight_update_keeps_the_media_and_each_tokens_policy(engine, model, requests) -> None:
    reset(engine, model)
    new = perturbed(model, scale=0.2)
    old_version, new_version = engine.version, engine.version + 1
    num_polls = 0

    def weight_poll():
        nonlocal num_polls
        num_polls += 1
        return (new_version, dict(new.named_parameters())) if num_polls == 3 else None

    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=2)
    results = engine.generate(requests, params, weight_poll=weight_poll)
    assert engine.version == new_version
    spanning = [r for r in results if {old_version, new_version} <= set(r.versions)]
    assert len(spanning) >= 3, [r.versions for r in results]
    old_lp = trainer_logprobs(model, requests, results, 1.0)
    new_lp = trainer_logprobs(new, requests, results, 1.0)
    gap = torch.cat(
        [
            (
                torch.tensor(r.logprobs)
                - torch.where(torch.tensor(r.versions) == old_version, o, n)
            ).abs()
            for r, o, n in zip(results, old_lp, new_lp, strict=True)
        ]
    )
    assert float(gap.mean()) <= MEAN_TOLERANCE, (float(gap.mean()), float(gap.max()))


def test_placeholders_are_never_sampled(engine, model, requests) -> None:
    """At temperature 2 (vLLM's highest) the random model's distribution is nearly flat: without the mask the
    placeholders would be drawn about a dozen times here (expected count computed below)."""
    reset(engine, model)
    temperature = 2.0
    batch = [
        GenerationRequest(f"{r.request_id}/{k}", r.prompt_ids, r.media)
        for r in requests
        for k in range(6)
    ]
    results = engine.generate(
        batch, SamplingParams(max_new_tokens=32, temperature=temperature, seed=1)
    )
    banned = placeholder_ids(model)
    assert not any(set(banned) & set(r.response_ids) for r in results)
    # The probability mass the unmasked distribution puts on them, summed over every draw.
    expected_draws = 0.0
    for request, result in zip(batch, results, strict=True):
        one = pack([request.prompt_ids], [result.response_ids], 0, media=[request.media])
        kwargs = {}
        if request.media:
            from streamrl.models.vision import forward_media_kwargs

            kwargs = forward_media_kwargs(model, one.input_ids_bt, one.attention_mask_bt, one.media)
        with torch.no_grad():
            logits = model(input_ids=one.input_ids_bt, **kwargs).logits[0]
        start = len(request.prompt_ids) - 1
        probs = torch.softmax(logits[start : start + len(result.response_ids)] / temperature, -1)
        expected_draws += float(probs[:, banned].sum())
    print(f"expected placeholder draws without the mask: {expected_draws:.1f}")
    assert expected_draws > 8, expected_draws
    # And the log-probs are those of the distribution renormalised without them.
    gap = gaps(model, batch, results, temperature)
    assert float(gap.mean()) <= MEAN_TOLERANCE, (float(gap.mean()), float(gap.max()))


def test_an_engine_core_in_its_own_process_takes_media(vl_dir, preparer, model, requests) -> None:
    """There the engine core and its worker are other processes, which install the shims
    themselves; weights and media cross as bytes and pickles."""
    engine = VllmEngine(
        vl_dir,
        eos_token_id=preparer.processor.tokenizer.eos_token_id,
        config=VllmConfig(
            kv_cache_gib=0.25,
            max_model_len=512,
            in_process=False,
            engine_kwargs={"limit_mm_per_prompt": {"image": 2, "video": 1}},
        ),
        max_num_seqs=8,
    )
    try:
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
        results = engine.generate(requests, params)
        assert float(gaps(model, requests, results).mean()) <= MEAN_TOLERANCE
        new = perturbed(model)
        engine.load_weights(1, {name: p.detach().numpy() for name, p in new.named_parameters()})
        results = engine.generate(requests, params)  # the same media again
        assert all(set(r.versions) == {1} for r in results)
        assert float(gaps(new, requests, results).mean()) <= MEAN_TOLERANCE
    finally:
        engine.close()
