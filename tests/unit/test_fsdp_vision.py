"""FSDP2 ranks for a vision-language policy, and `model.freeze_vision`.

Two FSDP2 ranks, built and fed as the trainer's ranks are (`RankSpec`, `build_rank_learner`,
the rows through the rank broadcast's encoding, `_train_share`'s micro-batch plan), end a step
on a batch of image, video and text rows where one process does: the rows reach rank 1 as
media keys and it reads the tensors from the store; the vision blocks are FSDP units, and a
micro-batch without media (here rank 1's share of the second `accumulate`, one row for two
ranks) runs the tower on a blank image so the collectives pair up. With `model.freeze_vision`
the tower stays bit for bit what it was, in one process and on two ranks, while the language
model trains. A text policy with `model.freeze_vision` is refused.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from streamrl.api import fields as F
from streamrl.api.run import RunContext
from streamrl.config import ConfigError, load_config
from streamrl.config.schema import PolicyLossConfig
from streamrl.media.cache import MediaCache
from streamrl.media.load import MediaLimits
from streamrl.media.prepare import MediaPreparer, bus_value
from streamrl.models.loading import load_causal_lm, load_tokenizer
from streamrl.models.processors import load_processor
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.models.tiny_omni import build_tiny_omni_model_dir
from streamrl.models.tiny_vl import build_tiny_vl_model_dir
from streamrl.models.vision import freeze_vision
from streamrl.runtime.preflight import check_multimodal
from streamrl.trainer.algos.objective import LossSettings
from streamrl.trainer.fsdp import decoder_layers, init_distributed
from streamrl.trainer.learner import Learner
from streamrl.trainer.ranks import (
    RankSpec,
    _train_share,
    build_rank_learner,
    decode_rows,
    encode_rows,
    load_rank0_model,
)
from streamrl.trainer.role import make_learner
from tests.distributed import free_port
from tests.unit.test_audio import audio_rows
from tests.unit.test_vision_roles import _prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl_dir(tmp_path_factory, request) -> Path:
    """Each family: a Qwen3-VL tower also feeds its deepstack features to the decoder."""
    out = tmp_path_factory.mktemp(request.param) / "model"
    return build_tiny_vl_model_dir(out, family=request.param, seed=3)


@pytest.fixture(scope="module")
def batches(vl_dir, tmp_path_factory) -> list[list[dict[str, Any]]]:
    """Two accumulate calls: six rows (image, video and two-image prompts, and one text row),
    then one text row alone (rank 1 gets no row of it)."""
    store = MediaCache(tmp_path_factory.mktemp("media"))
    preparer = MediaPreparer(load_processor(vl_dir), store, MediaLimits(max_frames=8))
    media_rows = []
    for prompt in _prompts(tmp_path_factory.mktemp("video")):
        prepared = preparer.prepare(prompt, "test prompt")
        media_rows.append((prepared.prompt_ids, bus_value(prepared, store)))
    tokenizer = preparer.processor.tokenizer
    text_ids = np.asarray(tokenizer("1+2=")["input_ids"], np.int64)
    rng = np.random.default_rng(0)

    def row(prompt_ids, media, advantage: float) -> dict[str, Any]:
        num = int(rng.integers(2, 6))
        return {
            "prompt_ids": prompt_ids,
            "response_ids": rng.integers(5, 40, size=num).tolist(),
            "rollout_logprobs": rng.uniform(-4.0, -3.5, size=num).tolist(),
            "advantages": advantage,
            F.MEDIA: media,
        }

    first = [row(*media_rows[i % 3], a) for i, a in enumerate([0.7, -1.2, 0.5, 1.1, -0.3])]
    first.insert(2, row(text_ids, None, 0.9))
    return [first, [row(text_ids, None, -0.8)]]


def learner_kwargs(pad_token_id: int) -> dict[str, Any]:
    return dict(
        pad_token_id=pad_token_id,
        lr=1.0,
        weight_decay=0.0,
        grad_clip=None,
        temperature=1.0,
        settings=LossSettings(loss=PolicyLossConfig(agg="token_mean")),
    )


def with_sgd(learner: Learner) -> Learner:
    """SGD at lr 1: the update is the normalised gradient itself (AdamW's first step divides
    each gradient by its own size, so float noise on a near-zero one moves it by up to lr)."""
    trained = [p for p in learner.model.parameters() if p.requires_grad]
    learner.optimizer = torch.optim.SGD(trained, lr=1.0)
    return learner


def train(learner, batches, share=None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step over `batches` (each one `accumulate` call): the whole of each in one process,
    or (`share`: the rank's `_train_share`) its micro-batches after the rank broadcast's
    encoding; returns the metrics and the weights after it."""
    for rows in batches:
        if share is None:
            learner.accumulate(rows)
        else:
            share(learner, decode_rows(encode_rows(rows)))
    return learner.step(), learner.named_weights()


def rank_main(rank: int, vl_dir: str, port: int, out_dir: str, batches, pad_token_id: int):
    """Both settings of `freeze_vision` on two ranks, as the trainer role builds them."""
    torch.set_num_threads(1)
    init_distributed(rank, 2, f"tcp://127.0.0.1:{port}")
    try:
        out = {}
        for freeze in (False, True):
            spec = RankSpec(vl_dir, "float32", learner_kwargs(pad_token_id), freeze_vision=freeze)
            full = load_rank0_model(spec) if rank == 0 else None
            learner = with_sgd(build_rank_learner(spec, full))
            out[freeze] = train(
                learner, batches, functools.partial(_train_share, spec=spec, skipped=0.0)
            )
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(vl_dir, batches, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ranks")
    pad = load_tokenizer(vl_dir).pad_token_id
    mp.spawn(rank_main, args=(str(vl_dir), free_port(), str(out_dir), batches, pad), nprocs=2)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def one_process(vl_dir: Path, batches, *, freeze: bool):
    model = load_causal_lm(vl_dir)
    if freeze:
        freeze_vision(model)
    learner = with_sgd(Learner(model, **learner_kwargs(load_tokenizer(vl_dir).pad_token_id)))
    return learner.named_weights(), *train(learner, batches)


def assert_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], part: str) -> set:
    """Whether each parameter of `part` (vision or language) moved: {True}, {False} or both."""
    names = [n for n in before if ("visual" in n) == (part == "vision")]
    assert names
    return {not torch.equal(before[n], after[n]) for n in names}


def test_rows_keep_their_media_key_through_the_rank_broadcast(batches) -> None:
    rows = decode_rows(encode_rows(batches[0]))
    assert [r[F.MEDIA] for r in rows] == [r[F.MEDIA] for r in batches[0]]
    assert rows[2][F.MEDIA] is None and rows[0][F.MEDIA]["key"]
    assert F.MEDIA not in decode_rows(encode_rows([{"prompt_ids": [1], "response_ids": [2]}]))[0]


def test_vision_blocks_are_fsdp_units(vl_dir) -> None:
    model = load_causal_lm(vl_dir)
    blocks = [*model.model.language_model.layers, *model.model.visual.blocks]
    assert sorted(map(id, decoder_layers(model))) == sorted(map(id, blocks))


def test_two_ranks_train_an_image_batch_like_one_process(vl_dir, batches, two_ranks) -> None:
    initial, expected, expected_weights = one_process(vl_dir, batches, freeze=False)
    assert changed(initial, expected_weights, "vision") == {True}  # the tower trains
    rank0, rank1 = two_ranks
    for rank in (rank0, rank1):  # every rank reports the whole batch's loss
        assert rank[False][0] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert rank1[False][1] == {}  # full weights go to rank 0 only
    assert_close(rank0[False][1], expected_weights)


def test_freeze_vision_keeps_the_tower_fixed_on_two_ranks(vl_dir, batches, two_ranks) -> None:
    initial, expected, after = one_process(vl_dir, batches, freeze=True)
    assert changed(initial, after, "vision") == {False}  # bit for bit
    metrics, got = two_ranks[0][True]
    assert metrics == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert list(got) == list(initial)  # every weight is still published
    assert changed(initial, got, "vision") == {False}
    assert True in changed(initial, got, "language")
    assert_close(got, after)


def test_the_trainer_role_freezes_the_tower_before_building_the_optimizer(
    vl_dir, batches, tmp_path
) -> None:
    cfg = load_config(["algorithm.lr=1e-2", "model.freeze_vision=true"])
    learner = make_learner(RunContext(cfg, vl_dir, tmp_path, [], []))
    visual = set(map(id, learner.model.model.visual.parameters()))
    optimized = [id(p) for g in learner.optimizer.param_groups for p in g["params"]]
    assert optimized and not visual & set(optimized)
    initial = learner.named_weights()
    _, after = train(learner, batches)
    assert changed(initial, after, "vision") == {False}
    assert True in changed(initial, after, "language")


def test_freeze_vision_is_refused_for_a_text_policy(tmp_path) -> None:
    text_dir = build_tiny_model_dir(
        tmp_path / "text", hidden_size=32, num_layers=1, num_heads=2, seed=0
    )
    cfg = load_config([f"model.path={text_dir}", "model.freeze_vision=true"])
    with pytest.raises(ConfigError, match="model.freeze_vision=true.*no vision tower"):
        check_multimodal(cfg)
    check_multimodal(load_config([f"model.path={text_dir}"]))  # off: nothing to refuse
    with pytest.raises(ValueError, match="no vision tower"):
        freeze_vision(load_causal_lm(text_dir))


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> Path:
    return build_tiny_omni_model_dir(tmp_path_factory.mktemp("omni") / "model", seed=3)


@pytest.fixture(scope="module")
def omni_batches(omni_dir, tmp_path_factory) -> list[list[dict[str, Any]]]:
    """Two accumulate calls: audio, audio-and-image and text rows, then one text row alone."""
    store = MediaCache(tmp_path_factory.mktemp("omni-media"))
    preparer = MediaPreparer(load_processor(omni_dir), store, MediaLimits())
    rows = audio_rows(preparer)
    rng = np.random.default_rng(1)
    for row, advantage in zip(rows, [0.7, -1.2, 0.5, 1.1], strict=True):
        num = int(rng.integers(2, 6))
        row.update(
            response_ids=rng.integers(5, 40, size=num).tolist(),
            rollout_logprobs=rng.uniform(-4.0, -3.5, size=num).tolist(),
            advantages=advantage,
        )
    return [rows[:2] + rows[3:] + rows[2:3], [dict(rows[3], advantages=-0.8)]]


def test_an_omni_thinkers_encoder_layers_are_fsdp_units(omni_dir) -> None:
    model = load_causal_lm(omni_dir)
    units = [*model.model.layers, *model.visual.blocks, *model.audio_tower.layers]
    assert sorted(map(id, decoder_layers(model))) == sorted(map(id, units))


def test_two_ranks_train_an_audio_batch_like_one_process(omni_dir, omni_batches, tmp_path) -> None:
    """Rank 1's share of the second call is empty: it runs both towers on blanks."""
    initial, expected, expected_weights = one_process(omni_dir, omni_batches, freeze=False)
    audio = [n for n in initial if n.startswith("audio_tower.")]
    assert any(not torch.equal(initial[n], expected_weights[n]) for n in audio)  # it trains
    pad = load_tokenizer(omni_dir).pad_token_id
    args = (str(omni_dir), free_port(), str(tmp_path), omni_batches, pad)
    mp.spawn(rank_main, args=args, nprocs=2)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for rank in (rank0, rank1):
        assert rank[False][0] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert_close(rank0[False][1], expected_weights)
    _, after_frozen = rank0[True]
    assert all(torch.equal(initial[n], after_frozen[n]) for n in audio)  # freeze_vision
