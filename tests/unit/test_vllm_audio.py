"""The vLLM engine on the tiny Qwen2.5-Omni thinker (fp32, in process): audio goes in as the
request's media, and on identical weights its log-probs are the trainer's (`response_logprobs`)
for audio, audio-and-image and text prompts batched together; again after a weight update that
changes the audio tower (the same audio sent again works: the encoder cache was reset).

Needs vLLM (`make install-vllm`); skipped without it unless STREAMRL_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.config.schema import VllmConfig
from streamrl.media.cache import MediaCache
from streamrl.media.load import MediaLimits
from streamrl.media.prepare import MediaPreparer, row_media
from streamrl.models.loading import load_causal_lm, save_model
from streamrl.models.processors import load_processor
from streamrl.models.tiny_omni import build_tiny_omni_model_dir
from streamrl.models.vision import placeholder_ids
from streamrl.trainer.checkpoint import copy_model_files
from streamrl.trainer.logprobs import pack, response_logprobs
from tests.unit.test_audio import audio_rows
from tests.vllm_required import skip_module_without_vllm

skip_module_without_vllm()

from streamrl.rollout.vllm_engine import VllmEngine  # noqa: E402

pytestmark = pytest.mark.slow

# fp32 engine vs fp32 trainer on identical weights; measured mean ~1e-7.
MEAN_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_omni_model_dir(tmp_path_factory.mktemp("omni") / "model", seed=3)


@pytest.fixture(scope="module")
def preparer(omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> MediaPreparer:
    store = MediaCache(tmp_path_factory.mktemp("media"))
    return MediaPreparer(load_processor(omni_dir), store, MediaLimits())


@pytest.fixture(scope="module")
def saved_dir(omni_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The thinker, changed, saved as checkpoints and the warm start save it: the engine starts
    from this directory."""
    thinker = load_causal_lm(omni_dir)
    torch.manual_seed(2)
    with torch.no_grad():
        for param in thinker.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    out = tmp_path_factory.mktemp("saved") / "model"
    save_model(thinker, out)
    copy_model_files(omni_dir, out)
    return out


@pytest.fixture(scope="module")
def model(saved_dir: Path):
    return load_causal_lm(saved_dir)


@pytest.fixture(scope="module")
def engine(saved_dir: Path, preparer: MediaPreparer):
    engine = VllmEngine(
        saved_dir,
        eos_token_id=preparer.processor.tokenizer.eos_token_id,
        config=VllmConfig(
            kv_cache_gib=0.25,
            max_model_len=512,
            engine_kwargs={"limit_mm_per_prompt": {"audio": 1, "image": 1, "video": 0}},
        ),
        max_num_seqs=16,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def requests(preparer: MediaPreparer) -> list[GenerationRequest]:
    rows = audio_rows(preparer)
    return [
        GenerationRequest(f"r{i}", [int(t) for t in row[F.PROMPT_IDS]], media)
        for i, (row, media) in enumerate(zip(rows, row_media(rows), strict=True))
    ]


def gaps(model, requests, results) -> torch.Tensor:
    """|engine - trainer| over every token of every result."""
    batch = pack(
        [r.prompt_ids for r in requests],
        [res.response_ids for res in results],
        pad_token_id=0,
        media=[r.media for r in requests],
    )
    with torch.no_grad():
        logprobs_br = response_logprobs(model, batch)
    return torch.cat(
        [
            (torch.tensor(res.logprobs) - logprobs_br[i, : len(res.logprobs)]).abs()
            for i, res in enumerate(results)
        ]
    )


def reset(engine: VllmEngine, model) -> None:
    engine.load_weights(engine.version + 1, dict(model.named_parameters()))


def test_the_engine_starts_from_a_saved_thinker(engine, model, requests) -> None:
    """vLLM reads the directory `save_model` wrote (the Omni layout) with its weights."""
    assert engine.version == 0
    results = engine.generate(requests, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
    gap = gaps(model, requests, results)
    assert float(gap.mean()) <= MEAN_TOLERANCE, (float(gap.mean()), float(gap.max()))


def test_audio_image_and_text_log_probs_are_the_trainers(engine, model, requests) -> None:
    reset(engine, model)
    results = engine.generate(requests, SamplingParams(max_new_tokens=10, temperature=1.0, seed=5))
    assert all(len(r.response_ids) > 0 for r in results)
    assert not any(set(placeholder_ids(model)) & set(r.response_ids) for r in results)
    gap = gaps(model, requests, results)
    print(f"vLLM vs trainer, fp32: mean {float(gap.mean()):.2e}, max {float(gap.max()):.2e}")
    assert float(gap.mean()) <= MEAN_TOLERANCE, (float(gap.mean()), float(gap.max()))
    # The audio matters: the same tokens after other features have other log-probs (in the
    # random tiny model by about 7e-4 on average, thousands of times the gap).
    moved = [copy.copy(r) for r in requests]
    features = moved[0].media["input_features"]
    noise = torch.randn(features.shape, generator=torch.Generator().manual_seed(0))
    moved[0].media = {**moved[0].media, "input_features": features + noise}
    first = len(results[0].logprobs)
    assert float(gaps(model, moved, results)[:first].mean()) > 20 * MEAN_TOLERANCE


def test_an_update_reaches_the_audio_tower_and_the_audio_can_come_again(
    engine, model, requests
) -> None:
    reset(engine, model)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    engine.generate(requests, params)  # the audio is in vLLM's caches now
    torch.manual_seed(1)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in new.named_parameters():
            if name.startswith("audio_tower.") or "layers.0." in name:
                param.add_(torch.randn_like(param) * 0.05)
    version = engine.version + 1
    engine.load_weights(version, dict(new.named_parameters()))
    results = engine.generate(requests, params)  # the same audio again, under new weights
    assert all(set(r.versions) == {version} for r in results)
    gap = gaps(new, requests, results)
    assert float(gap.mean()) <= MEAN_TOLERANCE, (float(gap.mean()), float(gap.max()))
    # The new audio tower is the one vLLM ran: with the old tower alone put back, the audio
    # prompt's log-probs are far from the engine's.
    old_tower = copy.deepcopy(new)
    old_params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in old_tower.named_parameters():
            if name.startswith("audio_tower."):
                param.copy_(old_params[name])
    first = len(results[0].logprobs)
    assert float(gaps(old_tower, requests, results)[:first].mean()) > 100 * MEAN_TOLERANCE
