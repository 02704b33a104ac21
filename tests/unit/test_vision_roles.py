"""Images and video through the roles: feeder preparation, builtin engine, trainer log-probs,
for a tiny Qwen2.5-VL and a tiny Qwen3-VL model.

On identical weights the builtin engine's log-probs of its own samples and the trainer's
forward (`trainer.logprobs`, which the reference and pi_old roles share) agree to 1e-5 in fp32
for image, video and text prompts batched together, and again after a weight update that
lands while the sequences are being generated.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from streamrl.api import fields as F
from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.data import shapes
from streamrl.data.dataset import load_rows
from streamrl.data.feeder import PromptFeeder
from streamrl.media.cache import MediaCache
from streamrl.media.load import MediaLimits
from streamrl.media.prepare import MediaPreparer, bus_value, row_media
from streamrl.media.refs import MediaRef, MultimodalPrompt
from streamrl.models.loading import load_causal_lm
from streamrl.models.processors import load_processor
from streamrl.models.tiny_vl import build_tiny_vl_model_dir
from streamrl.rollout.builtin_engine import BuiltinEngine
from streamrl.trainer.logprobs import pack, response_logprobs


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_dir(tmp_path_factory, request) -> Path:
    """A tiny model of each family: Qwen3-VL adds interleaved rotary bands, deepstack features
    and a block of video tokens per time step to what the engine must follow."""
    out = tmp_path_factory.mktemp(request.param) / "model"
    return build_tiny_vl_model_dir(out, family=request.param, seed=3)


@pytest.fixture(scope="module")
def preparer(vl_dir, tmp_path_factory) -> MediaPreparer:
    store = MediaCache(tmp_path_factory.mktemp("media"))
    return MediaPreparer(load_processor(vl_dir), store, MediaLimits(max_frames=8))


def _png(color, size=(56, 56)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def _video(tmp_path: Path) -> str:
    frames = np.zeros((4, 56, 56, 3), np.uint8)
    for t in range(4):  # a square moving right
        frames[t, 20:36, 8 + 10 * t : 24 + 10 * t] = (200, 30, 30)
    path = tmp_path / "moving.npy"
    np.save(path, frames)
    return str(path)


def _prompts(tmp_path: Path) -> list[MultimodalPrompt]:
    image = [{"type": "image"}, {"type": "text", "text": "How many red shapes?"}]
    video = [{"type": "video"}, {"type": "text", "text": "Which way?"}]
    two = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    return [
        MultimodalPrompt(
            [{"role": "user", "content": image}], (MediaRef("image", data=_png("red")),)
        ),
        MultimodalPrompt(
            [{"role": "user", "content": video}], (MediaRef("video", path=_video(tmp_path)),)
        ),
        MultimodalPrompt(
            [{"role": "user", "content": two}],
            (MediaRef("image", data=_png("blue", (84, 56))), MediaRef("image", data=_png("green"))),
        ),
    ]


def _requests(preparer, prompts, tokenizer) -> list[GenerationRequest]:
    rows = []
    for prompt in prompts:
        prepared = preparer.prepare(prompt, "test prompt")
        rows.append(
            {F.PROMPT_IDS: prepared.prompt_ids, F.MEDIA: bus_value(prepared, preparer.cache)}
        )
    text_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}], add_generation_prompt=True, tokenize=True
    )
    rows.append(
        {
            F.PROMPT_IDS: np.asarray(
                list(text_ids["input_ids"] if hasattr(text_ids, "keys") else text_ids)
            ),
            F.MEDIA: None,
        }
    )
    media = row_media(rows)
    return [
        GenerationRequest(f"r{i}", [int(t) for t in row[F.PROMPT_IDS]], m)
        for i, (row, m) in enumerate(zip(rows, media, strict=True))
    ]


def trainer_logprobs(model, requests, results, pad_token_id):
    """The trainer's log-probs [B, R] of the engine's `results` for `requests`."""
    batch = pack(
        [r.prompt_ids for r in requests],
        [res.response_ids for res in results],
        pad_token_id,
        media=[r.media for r in requests],
    )
    with torch.no_grad():
        return response_logprobs(model, batch)


def _gap(logp_br, results) -> list[float]:
    return [
        float((logp_br[i, : len(res.logprobs)] - torch.tensor(res.logprobs)).abs().mean())
        for i, res in enumerate(results)
    ]


def test_engine_and_trainer_agree_for_image_video_and_text(vl_dir, preparer, tmp_path):
    model = load_causal_lm(vl_dir)
    tokenizer = preparer.processor.tokenizer
    requests = _requests(preparer, _prompts(tmp_path), tokenizer)
    assert preparer.num_media == {"image": 3, "video": 1}
    video = requests[1].media
    assert video["video_grid_thw"].tolist() == [[2, 4, 4]] and video["decoded"][0][0] == "video"
    if model.config.model_type == "qwen3_vl":  # each time step after its timestamp, in text
        text = tokenizer.decode(requests[1].prompt_ids)
        assert "<0.2 seconds>" in text and "<1.2 seconds>" in text, text
        assert model.config.vision_config.deepstack_visual_indexes == [0]
    else:
        # A .npy clip says no rate: data.media.video_fps (2), so a time step of 2 frames is 1 s.
        assert video["second_per_grid_ts"].tolist() == [1.0]

    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    results = engine.generate(requests, params)
    placeholders = {model.config.image_token_id, model.config.video_token_id}
    assert all(not placeholders & set(r.response_ids) for r in results)
    gaps = _gap(trainer_logprobs(model, requests, results, tokenizer.pad_token_id), results)
    assert max(gaps) <= 1e-5, gaps


def generate_across_update(engine, requests, model, tower: str, *, max_new_tokens: int):
    """Sample with a weight update in flight (at the engine's 4th poll, version 1): the
    parameters of `tower` (which must change too) and of layer 0, each moved by noise."""
    torch.manual_seed(0)
    new = {
        name: p.detach() + 0.05 * torch.randn_like(p)
        for name, p in model.named_parameters()
        if tower in name or "layers.0" in name
    }
    calls = {"n": 0}

    def poll():
        calls["n"] += 1
        return (1, new) if calls["n"] == 4 else None

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=2)
    return engine.generate(requests, params, weight_poll=poll)


def test_agreement_holds_across_an_in_flight_weight_update(vl_dir, preparer, tmp_path):
    model = load_causal_lm(vl_dir)
    tokenizer = preparer.processor.tokenizer
    requests = _requests(preparer, _prompts(tmp_path), tokenizer)
    engine = BuiltinEngine(model, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    results = generate_across_update(engine, requests, model, "visual", max_new_tokens=10)
    assert engine.version == 1 and any(0 in r.versions and 1 in r.versions for r in results)
    # The tokens after the update are those of the new weights, computed over a cache the new
    # weights recomputed (prompt images included): the trainer on the new weights agrees there.
    trained = trainer_logprobs(model, requests, results, tokenizer.pad_token_id)
    for i, res in enumerate(results):
        after = [k for k, v in enumerate(res.versions) if v == 1]
        gap = (trained[i, after] - torch.tensor(res.logprobs)[after]).abs().max()
        assert float(gap) <= 1e-5, (i, float(gap))


def test_feeder_leaves_out_prompts_with_bad_media_and_counts_them(vl_dir, preparer, tmp_path):
    good = tmp_path / "good.png"
    good.write_bytes(_png("red"))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG broken")
    lines = [
        {"prompt": "<image> How many?", "images": ["good.png"], "answer": "1"},
        {"prompt": "<image> How many?", "images": ["missing.png"], "answer": "1"},
        {"prompt": "<image> How many?", "images": ["broken.png"], "answer": "1"},
        {
            "prompt": [{"role": "user", "content": [{"type": "image", "image": "good.png"}]}],
            "answer": "2",
        },
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines))
    rows = load_rows(data).rows
    assert [len(r.media) for r in rows] == [1, 1, 1, 1] and "images" not in rows[0].extra
    feeder = PromptFeeder(
        rows, preparer.processor.tokenizer, batch_prompts=4, group_size=2, seed=0, media=preparer
    )
    before = dict(preparer.dropped)
    batch = feeder.batch(0)
    assert len(batch) == 8  # the batch keeps its size: usable prompts take the bad ones' places
    assert {r["fields"][F.ANSWER] for r in batch} <= {"1", "2"}
    assert all(r["fields"][F.MEDIA]["key"] for r in batch)
    dropped = {k: v - before.get(k, 0) for k, v in preparer.dropped.items()}
    assert dropped == {"missing": 1, "corrupt": 1}
    media = row_media([r["fields"] for r in batch])
    assert all(m["image_grid_thw"].tolist() == [[1, 4, 4]] for m in media)


def test_shapes_pictures_are_reproducible_and_the_teacher_miscounts():
    pictures = shapes.sample_pictures(300, seed=0, split="train")
    assert pictures[0].png() == shapes.picture(pictures[0].seed).png()
    assert not {p.seed for p in pictures} & {
        p.seed for p in shapes.sample_pictures(300, seed=0, split="eval")
    }
    miscounted = sum(shapes.solution(p, count_all=False) == shapes.solution(p) for p in pictures)
    assert 0.2 < miscounted / len(pictures) < 0.45  # what greedy imitation of the teacher scores
    p = next(p for p in pictures if shapes.solution(p) != shapes.solution(p, count_all=False))
    assert shapes.solution(p).endswith(":" + p.answer)
