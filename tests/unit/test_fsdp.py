"""FSDP2 on two CPU ranks (gloo): rank 1 builds its shards without reading the checkpoint (its
model directory holds config.json only) and receives exactly its slices of rank 0's weights; the
sharded learner ends a step exactly where one process on the whole batch does, reports the same
loss and every rank's peak memory, clips on the global norm, recomputes activations without
changing the gradient, and round-trips its distributed checkpoint; a decoder without
`_no_split_modules` is wrapped layer by layer.

All two-rank scenarios run in one `mp.spawn` (process start dominates the cost); the tests
compare what the ranks wrote against single-process references computed here.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from streamrl.config.schema import PolicyLossConfig
from streamrl.models.loading import load_causal_lm
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.trainer.algos.objective import LossSettings
from streamrl.trainer.fsdp import (
    FSDPLearner,
    data_parallel_mesh,
    decoder_layers,
    init_distributed,
    load_sharded_model,
    shard_model,
)
from streamrl.trainer.learner import Learner
from tests.distributed import free_port
from tests.unit.test_grpo import PAD_ID, random_rows, skip_zero_advantage

pytestmark = pytest.mark.timeout(180)

LOSS_AGG = "token_mean"
NUM_LAYERS = 2
ROWS = 10
# rank -> its micro-batches as row ranges: uneven rows and tokens, the same count on both ranks
# (FSDP runs in lockstep). (4, 5) and (9, 10) hold one zero-advantage row each and (10, 10) no
# row at all, so both ranks also run zero passes.
SPLITS = {0: [(0, 1), (1, 4), (4, 5)], 1: [(5, 9), (9, 10), (10, 10)]}
MOE_EXPERTS, MOE_TOP_K = 4, 2
CLIP = 0.05  # below step 2's gradient norm, so clipping binds (checked below)


def build_learner(
    model_dir: Path, *, fsdp: dict[str, bool] | None = None, optimizer: str = "sgd"
) -> Learner:
    """A learner on the tiny model; with `fsdp` (`shard_model`'s keyword arguments), sharded
    over the initialised process group as the trainer's ranks do it: rank 0 loads the model
    and sends the other ranks their shards."""
    if fsdp is None:
        model = load_causal_lm(model_dir)
    else:
        full = load_causal_lm(model_dir) if dist.get_rank() == 0 else None
        model = load_sharded_model(model_dir, data_parallel_mesh("cpu"), full, **fsdp)
    learner = (FSDPLearner if fsdp is not None else Learner)(
        model,
        pad_token_id=PAD_ID,
        lr=1.0 if optimizer == "sgd" else 1e-2,
        weight_decay=0.01,
        grad_clip=None,
        temperature=1.0,
        settings=LossSettings(loss=PolicyLossConfig(agg=LOSS_AGG)),
    )
    if optimizer == "sgd":  # the update is the normalised gradient itself
        learner.optimizer = torch.optim.SGD(learner.model.parameters(), lr=1.0)
    return learner


def train_step(learner: Learner, rows: list[dict[str, Any]], rank: int | None) -> dict[str, float]:
    """One step: this rank's micro-batches of SPLITS, or (rank None) the whole batch at once.
    Zero-advantage rows are left out as the trainer role does (they still count in the
    normaliser), so the token statistics agree too."""
    for lo, hi in [(0, len(rows))] if rank is None else SPLITS[rank]:
        kept, share = skip_zero_advantage(rows[lo:hi], LOSS_AGG)
        learner.accumulate(kept, num_skipped_tokens=share)
    return learner.step()


def local_tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    return [
        (x.to_local() if isinstance(x, DTensor) else x).detach().clone()
        for x in leaves
        if isinstance(x, torch.Tensor)
    ]


class ToyDecoder(nn.Module):
    """A decoder that names no `_no_split_modules`: embedding, a list of blocks, a head (in a
    shorter list, so the blocks are the largest `ModuleList`)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.heads = nn.ModuleList([nn.Linear(8, 16)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.heads[0](x)


def moe_rows() -> list[dict[str, Any]]:
    """`random_rows` with routed experts for each position but the last (as an engine records
    them: `MOE_TOP_K` distinct experts of `MOE_EXPERTS` per position and layer)."""
    rng = np.random.default_rng(7)
    rows = random_rows(ROWS)
    for row in rows:
        positions = len(row["prompt_ids"]) + len(row["response_ids"]) - 1
        routes = [rng.permutation(MOE_EXPERTS)[:MOE_TOP_K] for _ in range(positions * NUM_LAYERS)]
        row["routed_experts"] = np.array(routes, np.uint8).reshape(positions, NUM_LAYERS, -1)
    return rows


def rank_main(
    rank: int, model_dirs: list[str], port: int, out_dir: str, moe_dirs: list[str]
) -> None:
    """`model_dirs[rank]`: the tiny model for rank 0; config.json alone for rank 1 (and the
    same of the tiny MoE model in `moe_dirs`)."""
    torch.set_num_threads(1)  # two ranks on two (shared) cores
    init_distributed(rank, 2, f"tcp://127.0.0.1:{port}")
    try:
        path, out = Path(model_dirs[rank]), {}
        learner = build_learner(path, fsdp={})
        model = learner.model
        out["shards"] = {name: p.to_local().clone() for name, p in model.named_parameters()}
        out["buffers"] = {name: b.clone() for name, b in model.named_buffers()}
        out["tied"] = model.lm_head.weight is model.get_input_embeddings().weight
        out["fp32"] = [train_step(learner, random_rows(ROWS), rank)]
        out["peak_bytes"] = learner.peak_memory_bytes()
        out["fp32_weights"] = [learner.named_weights()]
        learner.grad_clip = CLIP
        out["fp32"].append(train_step(learner, random_rows(ROWS, seed=1), rank))
        out["fp32_weights"].append(learner.named_weights())

        learner = build_learner(path, fsdp={"activation_checkpointing": True})
        out["ac"] = train_step(learner, random_rows(ROWS), rank)
        out["ac_weights"] = learner.named_weights()

        learner = build_learner(path, fsdp={"mixed_precision": True})
        out["bf16"] = train_step(learner, random_rows(ROWS), rank)
        out["bf16_weights"] = learner.named_weights()

        # Distributed checkpoint: AdamW so that there is optimizer state to restore.
        saved = build_learner(path, fsdp={}, optimizer="adamw")
        train_step(saved, random_rows(ROWS), rank)
        saved.save_checkpoint(Path(out_dir) / "ckpt")
        out["ckpt_weights"] = saved.named_weights()
        restored = build_learner(path, fsdp={}, optimizer="adamw")
        restored.load_checkpoint(Path(out_dir) / "ckpt")
        out["version"] = restored.version
        before = local_tensors(get_state_dict(saved.model, saved.optimizer))
        after = local_tensors(get_state_dict(restored.model, restored.optimizer))
        out["num_state_tensors"] = len(before)
        out["state_equal"] = len(before) == len(after) and all(
            torch.equal(a, b) for a, b in zip(before, after, strict=True)
        )
        for learner in (saved, restored):  # the restored learner steps like the saved one
            train_step(learner, random_rows(ROWS, seed=2), rank)
        out["resumed_equal"] = all(
            torch.equal(a, b)
            for a, b in zip(local_tensors(saved.model), local_tensors(restored.model), strict=True)
        )

        torch.manual_seed(0)  # the same toy model on both ranks
        toy, ids = ToyDecoder(), torch.arange(12).view(2, 6)
        expected = toy(ids)
        shard_model(toy, data_parallel_mesh("cpu"))
        out["toy_wrapped"] = [isinstance(m, FSDPModule) for m in (toy, *toy.blocks, *toy.heads)]
        out["toy_equal"] = torch.allclose(toy(ids), expected, rtol=1e-6, atol=1e-7)

        learner = build_learner(Path(moe_dirs[rank]), fsdp={})  # routes replayed on each rank
        out["moe"] = train_step(learner, moe_rows(), rank)
        out["moe_weights"] = learner.named_weights()
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # leave together: an early teardown can abort the peer (see tests.distributed)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    return build_tiny_model_dir(out, hidden_size=32, num_layers=NUM_LAYERS, num_heads=2, seed=0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-moe")
    return build_tiny_model_dir(
        out,
        hidden_size=32,
        num_layers=NUM_LAYERS,
        num_heads=2,
        seed=0,
        num_experts=MOE_EXPERTS,
        experts_per_token=MOE_TOP_K,
    )


@pytest.fixture(scope="module")
def two_ranks(
    model_dir: Path, moe_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    out_dir = tmp_path_factory.mktemp("fsdp")
    dirs = []
    for source in (model_dir, moe_dir):  # rank 1 cannot read any weights
        config_only = tmp_path_factory.mktemp("config_only")
        shutil.copy(source / "config.json", config_only / "config.json")
        dirs.append([str(source), str(config_only)])
    mp.spawn(rank_main, args=(dirs[0], free_port(), str(out_dir), dirs[1]), nprocs=2)
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    return {"ranks": ranks, "ckpt": out_dir / "ckpt"}


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[str, Any]:
    """One process, whole batch, no sharding: the same two steps as the fp32 ranks."""
    learner = build_learner(model_dir)
    metrics = [train_step(learner, random_rows(ROWS), None)]
    weights = [learner.named_weights()]
    learner.grad_clip = CLIP
    metrics.append(train_step(learner, random_rows(ROWS, seed=1), None))
    weights.append(learner.named_weights())
    return {"metrics": metrics, "weights": weights}


def test_a_moe_model_with_routing_replay_trains_alike_on_two_ranks(
    two_ranks: dict[str, Any], moe_dir: Path
) -> None:
    """FSDP2 shards the experts and the routers; each rank replays its rows' routes; the step
    lands where one process on the whole batch does, with the same router statistics."""
    learner = build_learner(moe_dir)
    expected = train_step(learner, moe_rows(), None)
    assert "moe/aux_loss" in expected and "moe/expert_load_max/l1" in expected
    assert 0.0 < expected["moe/replay_agreement"] < 1.0  # random routes: the router disagrees
    rank0, rank1 = two_ranks["ranks"]
    # The load-balancing loss is taken per micro-batch (as transformers takes it per forward):
    # its mean over the ranks' micro-batches is near, not equal to, the whole batch's.
    aux = expected.pop("moe/aux_loss")
    for rank in (rank0, rank1):
        assert rank["moe"].pop("moe/aux_loss") == pytest.approx(aux, rel=0.1)
        assert rank["moe"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert_weights_close(rank0["moe_weights"], learner.named_weights(), atol=1e-6, rtol=1e-5)


def assert_weights_close(got: dict, expected: dict, **tol: float) -> None:
    assert list(got) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, msg=name, **tol)


def test_each_rank_receives_only_its_shards_of_rank0s_weights(
    two_ranks: dict[str, Any], model_dir: Path
) -> None:
    """Rank 1 read config.json only; what it holds is its half of every parameter (FSDP2 shards
    dim 0 in torch.chunk pieces), equal to the checkpoint's, and the same buffers as a model
    loaded in full (rotary inv_freq is not in the checkpoint: rank 0 sends it)."""
    full = load_causal_lm(model_dir)
    params, buffers = dict(full.named_parameters()), dict(full.named_buffers())
    for rank, got in enumerate(two_ranks["ranks"]):
        assert list(got["shards"]) == list(params)  # the tied lm_head is one parameter
        assert got["tied"]
        for name, shard in got["shards"].items():
            expected = params[name].detach().chunk(2, dim=0)[rank]
            assert shard.shape[0] < params[name].shape[0], name
            torch.testing.assert_close(shard, expected, atol=0, rtol=0, msg=name)
        assert list(got["buffers"]) == list(buffers)
        for name, buffer in got["buffers"].items():
            torch.testing.assert_close(buffer, buffers[name], atol=0, rtol=0, msg=name)


def test_every_rank_reports_every_ranks_peak_memory(two_ranks: dict[str, Any]) -> None:
    rank0, rank1 = two_ranks["ranks"]
    assert rank0["peak_bytes"] == rank1["peak_bytes"]  # gathered in the step's all-reduce
    assert len(rank0["peak_bytes"]) == 2
    assert all(100 * 2**20 < b < 8 * 2**30 for b in rank0["peak_bytes"])  # a torch process


def test_two_ranks_match_one_process_on_the_whole_batch(
    two_ranks: dict[str, Any], reference: dict[str, Any]
) -> None:
    rank0, rank1 = two_ranks["ranks"]
    assert rank1["fp32_weights"] == [{}, {}]  # full weights go to rank 0 only
    assert_weights_close(rank0["fp32_weights"][0], reference["weights"][0], atol=1e-6, rtol=1e-5)
    for rank in (rank0, rank1):  # every rank reports the whole batch's loss and statistics
        expected = reference["metrics"][0]
        assert rank["fp32"][0] == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_clipping_uses_the_global_gradient_norm(
    two_ranks: dict[str, Any], reference: dict[str, Any]
) -> None:
    rank0, rank1 = two_ranks["ranks"]
    expected = reference["metrics"][1]
    assert expected["grad_norm"] > 2 * CLIP  # the clip binds
    for rank in (rank0, rank1):
        assert rank["fp32"][1] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    before, after = reference["weights"]
    got_before, got_after = rank0["fp32_weights"]
    for name in before:  # compare the (small, clipped) update itself, not the weights
        torch.testing.assert_close(
            got_after[name] - got_before[name], after[name] - before[name], atol=1e-8, rtol=1e-4
        )


def test_activation_checkpointing_gives_the_same_update(
    two_ranks: dict[str, Any], reference: dict[str, Any]
) -> None:
    rank0 = two_ranks["ranks"][0]
    assert rank0["ac"] == pytest.approx(rank0["fp32"][0], rel=1e-6, abs=1e-8)
    assert_weights_close(rank0["ac_weights"], reference["weights"][0], atol=1e-6, rtol=1e-5)


def test_bf16_mixed_precision_smoke(two_ranks: dict[str, Any], model_dir: Path) -> None:
    rank0 = two_ranks["ranks"][0]
    fp32 = rank0["fp32"][0]
    assert rank0["bf16"]["loss"] == pytest.approx(fp32["loss"], rel=0.05)
    assert rank0["bf16"]["grad_norm"] == pytest.approx(fp32["grad_norm"], rel=0.05)
    initial = dict(load_causal_lm(model_dir).named_parameters())
    bf16 = torch.cat([(w - initial[n]).flatten() for n, w in rank0["bf16_weights"].items()])
    ref = torch.cat([(w - initial[n]).flatten() for n, w in rank0["fp32_weights"][0].items()])
    assert all(w.dtype == torch.float32 for w in rank0["bf16_weights"].values())  # fp32 master
    assert torch.nn.functional.cosine_similarity(bf16, ref, dim=0) > 0.99


def test_distributed_checkpoint_round_trip(two_ranks: dict[str, Any]) -> None:
    num_params = len(two_ranks["ranks"][0]["ckpt_weights"])
    for rank in two_ranks["ranks"]:
        assert rank["version"] == 1
        # each parameter's shard, its AdamW step count and two moments
        assert rank["num_state_tensors"] >= 4 * num_params
        assert rank["state_equal"]
        assert rank["resumed_equal"]  # and the next step lands on the same parameters


def test_distributed_checkpoint_loads_in_one_process(
    two_ranks: dict[str, Any], model_dir: Path
) -> None:
    """The two-rank checkpoint reshards on load: one process reads the full model from it."""
    model = load_causal_lm(model_dir)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(two_ranks["ckpt"]))
    model.load_state_dict(state["model"])
    expected = two_ranks["ranks"][0]["ckpt_weights"]
    assert_weights_close(dict(model.named_parameters()), expected, atol=0, rtol=0)


def test_decoder_layers_are_found_by_class_name(model_dir: Path) -> None:
    model = load_causal_lm(model_dir)
    assert decoder_layers(model) == list(model.model.layers)
    with pytest.raises(ValueError, match="_no_split_modules"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_without_no_split_modules_the_largest_module_list_is_wrapped(model_dir: Path) -> None:
    toy = ToyDecoder()
    assert not hasattr(toy, "_no_split_modules")
    assert decoder_layers(toy) == list(toy.blocks)
    model = load_causal_lm(model_dir)
    model._no_split_modules = None  # an HF model whose class names no layer classes
    assert decoder_layers(model) == list(model.model.layers)


def test_a_decoder_without_no_split_modules_shards_layer_by_layer(
    two_ranks: dict[str, Any],
) -> None:
    for rank in two_ranks["ranks"]:
        assert rank["toy_wrapped"] == [True, True, True, True, False]  # root, 3 blocks, head
        assert rank["toy_equal"]
