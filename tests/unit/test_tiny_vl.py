"""The tiny Qwen2.5-VL model directory (`streamrl.models.tiny_vl`), the processors that work
without torchvision (`streamrl.models.processors`) and the trainer-side multimodal log-probs
(`streamrl.models.vl_forward`): the directory loads in transformers, the processor expands
images and videos to the right number of pad tokens, the numpy video processor lays out patches
as the image processor does, and vLLM (in process, CPU, fp32) agrees with `vl_forward_logprobs`
on an image and a video prompt, which it does only with the multimodal positions.

The vLLM tests need vLLM (`make install-vllm`); skipped without it unless STREAMRL_REQUIRE_VLLM=1.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streamrl.models.processors import NumpyQwen2VLVideoProcessor, load_processor
from streamrl.models.tiny_vl import build_tiny_vl_model_dir
from streamrl.models.vl_forward import vl_forward_logprobs
from tests.vllm_required import REASON, vllm_missing

skip_without_vllm = pytest.mark.skipif(vllm_missing(), reason=REASON)

QUESTION = "what is 2+3?"
# vLLM's form of a video: the frames and their metadata (4 frames sampled at 2 fps).
VIDEO_METADATA = {
    "fps": 2.0,
    "duration": 2.0,
    "total_num_frames": 4,
    "frames_indices": [0, 1, 2, 3],
    "video_backend": "opencv",
    "do_sample_frames": False,
}


def _frame(seed: int, size: int = 56) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8)


def _prompt(processor, media: str) -> str:
    messages = [{"role": "user", "content": [{"type": media}, {"type": "text", "text": QUESTION}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl_model_dir(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def processor(vl_dir: Path):
    return load_processor(vl_dir)


@pytest.fixture(scope="module")
def model(vl_dir: Path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(vl_dir), dtype=torch.float32
    ).eval()


def test_directory_loads_and_processor_expands_media(vl_dir: Path, processor, model) -> None:
    config, tokenizer = model.config, processor.tokenizer
    assert model.dtype == torch.float32
    assert config.text_config.vocab_size % 128 == 0
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert isinstance(processor.video_processor, NumpyQwen2VLVideoProcessor)

    text = _prompt(processor, "image")
    assert (
        text == f"<|user|><|vision_start|><|image_pad|><|vision_end|>{QUESTION}<|end|><|assistant|>"
    )
    image = processor(text=[text], images=[Image.fromarray(_frame(0))], return_tensors="pt")
    assert image["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert (image["input_ids"] == config.image_token_id).sum() == 4
    assert image["pixel_values"].shape == (16, 3 * 2 * 14 * 14)

    frames = [_frame(i) for i in range(4)]
    video = processor(text=[_prompt(processor, "video")], videos=[frames], return_tensors="pt")
    assert video["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert (video["input_ids"] == config.video_token_id).sum() == 8
    assert video["mm_token_type_ids"].tolist()[0].count(2) == 8

    plain = [{"role": "user", "content": QUESTION}]
    assert processor.apply_chat_template(plain, tokenize=False) == f"<|user|>{QUESTION}<|end|>"


def test_video_patches_follow_the_image_processor(processor) -> None:
    """Frames (A, A, B) become two time steps: (A, A) and (B, B), the last frame repeated. A
    still image is one time step of itself twice, so each step's rows must equal the image
    processor's for that frame: same resize, normalisation and patch order."""
    a, b = _frame(1, size=70), _frame(2, size=70)  # resized to 56x56
    video = processor.video_processor([a, a, b], return_tensors="np")
    assert video["video_grid_thw"].tolist() == [[2, 4, 4]]
    rows = video["pixel_values_videos"]
    for step, frame in enumerate((a, b)):
        image = processor.image_processor([Image.fromarray(frame)], return_tensors="np")
        np.testing.assert_allclose(
            rows[16 * step : 16 * (step + 1)], image["pixel_values"], atol=1e-5
        )


def test_video_patch_layout_by_hand() -> None:
    """One 56x56 frame whose 14x14 patch (r, c) holds the value 10r + c, twice: raw values
    (vLLM's do_rescale=False, do_normalize=False) in 2x2 merge blocks row by row, and the
    normalised values channel by channel."""
    values = np.kron(10 * np.arange(4)[:, None] + np.arange(4), np.ones((14, 14)))
    frame = np.repeat(values[:, :, None], 3, axis=2).astype(np.uint8)
    video_processor = NumpyQwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=112 * 112)
    raw = video_processor([frame, frame], do_rescale=False, do_normalize=False)
    assert raw["video_grid_thw"].tolist() == [[1, 4, 4]]
    order = [
        (2 * br + r, 2 * bc + c) for br in (0, 1) for bc in (0, 1) for r in (0, 1) for c in (0, 1)
    ]
    expected = np.array([10 * r + c for r, c in order], dtype=np.float32)
    np.testing.assert_array_equal(
        raw["pixel_values_videos"], np.repeat(expected[:, None], 1176, axis=1)
    )

    normed = video_processor([frame, frame])["pixel_values_videos"].reshape(16, 3, 2 * 14 * 14)
    mean = np.array(video_processor.image_mean)[None, :, None]
    std = np.array(video_processor.image_std)[None, :, None]
    want = np.broadcast_to((expected[:, None, None] / 255 - mean) / std, normed.shape)
    np.testing.assert_allclose(normed, want, atol=1e-6)


@pytest.fixture(scope="module")
def llm(vl_dir: Path):
    from streamrl.models.processors import install_vllm_shims

    install_vllm_shims()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm.envs
    from vllm import LLM

    vllm.envs.disable_envs_cache()
    # vLLM's CPU worker swaps torch.set_num_threads for a no-op; keep this process's setting.
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        llm = LLM(
            model=str(vl_dir),
            dtype="float32",
            max_model_len=512,
            max_num_seqs=4,
            kv_cache_memory_bytes=2**28,
            enforce_eager=True,
            enable_prefix_caching=False,
            distributed_executor_backend="uni",
            limit_mm_per_prompt={"image": 1, "video": 1},
            seed=0,
        )
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
    yield llm
    llm.llm_engine.engine_core.shutdown()


def _media(kind: str):
    """(vLLM's multi_modal_data, the processor's keyword arguments) for one image or video."""
    if kind == "image":
        image = Image.fromarray(_frame(0))
        return {"image": image}, {"images": [image]}
    frames = [_frame(i) for i in range(4)]
    return (
        {"video": (np.stack(frames), VIDEO_METADATA)},
        {"videos": [frames], "video_metadata": [VIDEO_METADATA]},
    )


@pytest.fixture(scope="module")
def vllm_runs(llm, processor) -> dict:
    """Per kind: the full token ids (prompt as vLLM expanded it, then 6 greedy tokens), vLLM's
    log-probs of ids[1:], the processor's outputs, and where the text after the media starts."""
    from vllm import SamplingParams

    kinds = ("image", "video")
    params = SamplingParams(
        max_tokens=6, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True
    )
    requests = [
        {"prompt": _prompt(processor, kind), "multi_modal_data": _media(kind)[0]} for kind in kinds
    ]
    runs = {}
    for kind, out in zip(kinds, llm.generate(requests, params, use_tqdm=False), strict=True):
        completion = out.outputs[0]
        ids = [*out.prompt_token_ids, *completion.token_ids]
        chosen = [*out.prompt_logprobs[1:], *completion.logprobs]
        logprobs = [entry[token].logprob for token, entry in zip(ids[1:], chosen, strict=True)]
        inputs = processor(text=[_prompt(processor, kind)], return_tensors="pt", **_media(kind)[1])
        assert inputs["input_ids"][0].tolist() == list(out.prompt_token_ids)
        after = ids.index(processor.tokenizer.convert_tokens_to_ids("<|vision_end|>"))
        runs[kind] = (torch.tensor(ids), torch.tensor(logprobs), inputs, after)
    return runs


@pytest.mark.slow
@skip_without_vllm
@pytest.mark.parametrize("kind", ["image", "video"])
def test_vllm_and_transformers_agree_in_fp32(vllm_runs, model, kind: str) -> None:
    ids, vllm_logprobs, inputs, after = vllm_runs[kind]
    with torch.no_grad():
        logprobs = vl_forward_logprobs(model, ids, inputs)
    gap = (logprobs - vllm_logprobs).abs()[after:]  # the tokens after the media
    assert len(gap) == len(ids) - 1 - after >= 16
    assert gap.mean() <= 1e-5, (kind, gap.mean().item(), gap.max().item())


@pytest.mark.slow
@skip_without_vllm
def test_without_mm_token_type_ids_positions_fall_back_and_log_probs_drift(
    vllm_runs, model
) -> None:
    ids, vllm_logprobs, inputs, after = vllm_runs["image"]
    with torch.no_grad():
        right = vl_forward_logprobs(model, ids, inputs)
        forgotten = vl_forward_logprobs(model, ids, inputs, with_mm_token_types=False)
    right_gap = (right - vllm_logprobs).abs()[after:].mean()
    forgotten_gap = (forgotten - vllm_logprobs).abs()[after:].mean()
    # A random tiny model is nearly position-blind; the gap is still far beyond fp32 noise.
    assert forgotten_gap > 1e-4 and forgotten_gap > 100 * right_gap, (forgotten_gap, right_gap)


def _upstream_processor_dir(tmp_path: Path, family: str) -> Path:
    """A tiny model directory whose processor config names the upstream (torchvision-only)
    video processor with its released settings, as a downloaded Qwen2.5-VL or Qwen3-VL has."""
    import json

    out = build_tiny_vl_model_dir(tmp_path / family, family=family)
    config = json.loads((out / "processor_config.json").read_text())
    video = config["video_processor"]
    if family == "qwen3_vl":
        video.update(
            video_processor_type="Qwen3VLVideoProcessor",
            size={"longest_edge": 25165824, "shortest_edge": 4096},
            fps=2,
            min_frames=4,
            max_frames=768,
            do_sample_frames=True,
        )
    else:
        video.update(video_processor_type="Qwen2VLVideoProcessor")
    (out / "processor_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_directory_naming_the_upstream_video_processor_loads(tmp_path, family) -> None:
    from streamrl.models.processors import NumpyQwen3VLVideoProcessor

    processor = load_processor(_upstream_processor_dir(tmp_path, family))
    ours = NumpyQwen3VLVideoProcessor if family == "qwen3_vl" else NumpyQwen2VLVideoProcessor
    assert type(processor.video_processor) is ours
    if family == "qwen3_vl":
        assert processor.video_processor.size["longest_edge"] == 25165824
        assert processor.video_processor.fps == 2 and processor.video_processor.do_sample_frames


def test_qwen3_vl_samples_frames_and_writes_their_timestamps(tmp_path) -> None:
    """16 frames at 8 a second (2 s) sampled at 2 a second: 4 frames (0, 5, 10, 15), two time
    steps, each after its timestamp (the mean time of its two frames); the clip's pixels over
    all its frames are what the size bounds (Qwen3-VL's rule), so 64 x 64 frames stay whole."""
    processor = load_processor(_upstream_processor_dir(tmp_path, "qwen3_vl"))
    frames = np.stack([_frame(t, 64) for t in range(16)])
    metadata = {"fps": 8.0, "total_num_frames": 16}
    out = processor(
        text=[_prompt(processor, "video")],
        videos=[frames],
        video_metadata=[metadata],
        return_tensors="pt",
    )
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    text = processor.tokenizer.decode(out["input_ids"][0])
    assert "<0.3 seconds>" in text and "<1.6 seconds>" in text, text
    sampled = processor.video_processor(
        videos=[frames[[0, 5, 10, 15]]], do_sample_frames=False, return_tensors="np"
    )
    np.testing.assert_array_equal(
        out["pixel_values_videos"].numpy(), sampled["pixel_values_videos"]
    )
