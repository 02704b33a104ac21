"""FSDP2 training of a Hugging Face causal LM: sharding, bf16, activation checkpointing,
distributed checkpoints, and full weights for weight sync.

    load_sharded_model(dir, mesh, full_model on rank 0 / None elsewhere) ──> FSDPLearner(model)
      │ every rank: the model built on the meta device from config.json (no weights read)
      │ shard_model: fully_shard(block) for each decoder layer (and vision block), then
      │   fully_shard(root);
      │   parameters become DTensors sharded on dim 0 over the mesh
      │ to_empty(device): each rank allocates its own shards only
      │ per parameter: rank 0 broadcasts the full tensor, every rank keeps its slice;
      │   buffers (rotary inv_freq, ...) are broadcast whole
      ▼
    every rank, in lockstep:  accumulate(micro-batch) x N  ──>  step()  ──>  named_weights()
                              all-gather per layer,             clip on     rank 0: full fp32
                              reduce-scatter (averaged)         the global  weights; others: {}
                              gradients per backward            norm

`Learner` works on the sharded model as it is: FSDP2 reduce-scatters gradients *averaged* over
ranks, which is what `Learner.step` assumes (it scales by world_size / global normaliser), and
`clip_grad_norm_` on DTensor gradients returns the global norm as a replicated DTensor. What
`FSDPLearner` adds:

- **Lockstep.** Every forward and backward all-gathers and reduce-scatters, so every rank must
  run the same number of `accumulate` calls per step. An empty micro-batch (no rows, or only
  zero-advantage ones) still runs a one-token forward/backward with a zero loss; plan equal
  counts with `streamrl.trainer.microbatch.plan_step`. A vision-language model's vision
  blocks join in the same way: every forward runs the tower once, on a blank image when the
  micro-batch has no media (`fsdp_vision.py`).
- **Loading.** Only rank 0 reads the checkpoint (`RankedLearner` keeps that full copy anyway, for
  evaluation and `save_pretrained`); the other ranks never hold more than their shards plus the
  one full tensor being broadcast, so a rank needs about (model / world_size) + its largest
  tensor for the weights, not the whole model.
- **Global metrics.** `step` sums the loss and statistics over ranks first, so every rank reports
  the whole batch's loss (the base class reports this rank's share), and gathers every rank's
  peak memory (`peak_memory_bytes`) in the same all-reduce.
- **Checkpoints and weights.** `save_checkpoint` / `load_checkpoint` write and read a
  `torch.distributed.checkpoint` folder (one file per rank, loadable at another world size,
  read without unpickling anything but data: `safe_dcp.py`);
  `named_weights` gathers full weights to rank 0 for weight sync. All three are collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.utils.checkpoint import checkpoint

from streamrl.metrics.memory import process_peak_bytes
from streamrl.models.loading import is_multimodal_dir, is_omni_dir
from streamrl.models.vision import is_multimodal
from streamrl.trainer.fsdp_vision import one_vision_call
from streamrl.trainer.learner import STAT_MEANS, Learner, routing_stat_keys
from streamrl.trainer.safe_dcp import SafeLoadPlanner, SafeReader


def init_distributed(rank: int, world_size: int, init_method: str, *, device: str = "cpu") -> None:
    """Join the process group. On CUDA the group gets both backends (`cpu:gloo,cuda:nccl`): NCCL
    for the FSDP collectives on GPU tensors, gloo for the learner's CPU-side all-reduces."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)


def data_parallel_mesh(device: str = "cpu") -> DeviceMesh:
    """A one-dimensional mesh over all ranks of the initialised process group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_distributed first")
    return init_device_mesh(device, (dist.get_world_size(),))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, each one FSDP all-gather unit: the modules whose class the
    model, or any of its parts, names in `_no_split_modules` (e.g. `Qwen3DecoderLayer`; how HF
    causal LMs mark their decoder layers; a Qwen-VL model names its vision blocks there too, and
    an Omni thinker's audio and vision encoders name their own layers) and that hold no other
    such module (an Omni thinker names its whole encoders), or, for a model that names none,
    the children of its largest `ModuleList` (the decoder's layer list in any decoder-only
    model)."""
    names = {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or ()}
    marked = [m for m in model.modules() if type(m).__name__ in names]
    layers = [m for m in marked if not _holds_marked(m, names)]
    if layers:
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} names no decoder layer classes in `_no_split_modules` "
            f"(got {sorted(names)}) and has no nn.ModuleList of layers; FSDP needs a decoder "
            "model whose layers it can shard one by one"
        )
    return list(max(lists, key=len))


def _holds_marked(module: nn.Module, names: set[str]) -> bool:
    return any(type(sub).__name__ in names for sub in module.modules() if sub is not module)


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard `model` in place with FSDP2: each decoder layer (and a vision-language model's
    each vision block) is one all-gather unit, the root holds the rest (embeddings, final norm,
    output layer, the vision tower's patch embedding and merger; tied weights stay tied). Build
    the optimizer after this call: the parameters are replaced by DTensors, keeping
    `requires_grad` (a frozen vision tower stays frozen).

    `mixed_precision` (`trainer.mixed_precision`): compute in bf16 (parameters all-gathered as
    bf16), reduce gradients in fp32; the sharded parameters, gradients and optimizer state stay
    fp32. `activation_checkpointing` (`trainer.activation_checkpointing`): recompute each decoder
    layer's activations in backward instead of keeping them. `reshard_after_forward`: free each
    layer's gathered parameters after its forward (ZeRO-3); False keeps them until backward
    (ZeRO-2 like: more memory, one all-gather fewer per layer)."""
    layers = decoder_layers(model)
    if is_multimodal(model):  # tower blocks are units too: every rank runs each tower once
        one_vision_call(model)
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for layer in layers:
        if activation_checkpointing:
            checkpoint_layer(layer)
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
        )
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def empty_causal_lm(model_dir: str | Path, *, dtype: str = "float32") -> nn.Module:
    """The causal LM of `model_dir` built on the meta device from its config.json: the right
    modules, shapes, dtypes and tied weights, and no storage; nothing but the config is read.
    A vision-language model (Qwen-VL) is built by its own auto class, and a Qwen2.5-Omni
    directory's thinker from the thinker's config, as `load_causal_lm` loads them, so both have
    the same parameter names."""
    from transformers import AutoConfig, AutoModelForCausalLM

    auto = AutoModelForCausalLM
    if is_multimodal_dir(model_dir):
        from transformers import AutoModelForImageTextToText as auto
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if is_omni_dir(model_dir):
        config = config.thinker_config
    with torch.device("meta"):
        model = auto.from_config(config, dtype=getattr(torch, dtype))
    model.eval()
    return model


def load_sharded_model(
    model_dir: str | Path,
    mesh: DeviceMesh,
    full_model: nn.Module | None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    **shard_options: bool,
) -> nn.Module:
    """This rank's FSDP2 shard of the model in `model_dir`, without any rank but 0 reading the
    weights. A collective: every rank calls it, rank 0 with `full_model` (the model loaded from
    `model_dir` on CPU, e.g. with `load_causal_lm`), the others with None.

    The model is built on the meta device, wrapped (`wrap`: e.g. LoRA adapters, which rank 0's
    `full_model` must have too), sharded (`shard_model`, with `shard_options`), given storage for
    this rank's shards on `device`, and filled from rank 0 (`copy_from_rank0`)."""
    if (full_model is not None) != (dist.get_rank() == 0):
        raise ValueError("pass the full model on rank 0 and None on the other ranks")
    model = empty_causal_lm(model_dir, dtype=dtype)
    if wrap is not None:
        model = wrap(model)
    model = shard_model(model, mesh, **shard_options)
    model.to_empty(device=device)  # FSDP2 re-registers its sharded parameters (no full tensor)
    copy_from_rank0(model, full_model)
    return model


@torch.no_grad()
def copy_from_rank0(model: nn.Module, full_model: nn.Module | None) -> None:
    """Fill `model` (sharded, on its device) with rank 0's `full_model`: per parameter rank 0
    broadcasts the full tensor and every rank copies its own slice; buffers, which FSDP2 does not
    shard (rotary `inv_freq`, persistent or not), are broadcast whole. One full tensor at a time
    is the most any rank holds beyond its shards. Tied parameters appear once in
    `named_parameters`, so they are sent once and stay tied."""
    # Rank 0 looks every name up (a missing one is an error there, never a silent garbage send).
    params = dict(full_model.named_parameters()) if full_model is not None else None
    for name, param in model.named_parameters():
        full = _broadcast_tensor(params[name] if params is not None else None, param)
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())  # slicing rank 0's tensor locally: no messages
    buffers = dict(full_model.named_buffers()) if full_model is not None else None
    for name, buffer in model.named_buffers():
        buffer.copy_(_broadcast_tensor(buffers[name] if buffers is not None else None, buffer))


def _broadcast_tensor(source: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Rank 0's `source` on every rank (the others pass None), with the global shape, dtype and
    device of `like`."""
    if source is not None:
        if source.shape != like.shape or source.dtype != like.dtype:
            raise ValueError(
                f"rank 0's tensor is {tuple(source.shape)} {source.dtype}, the model built from "
                f"config.json wants {tuple(like.shape)} {like.dtype}: load both from the same "
                "directory in the same dtype"
            )
        tensor = source.detach().to(like.device)
    else:
        tensor = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    dist.broadcast(tensor, src=0)
    return tensor


def checkpoint_layer(layer: nn.Module) -> None:
    """Recompute `layer`'s forward in backward (non-reentrant checkpoint).

    The checkpoint wraps `forward` only, so the module's hooks, FSDP2's all-gather among them,
    run outside it, and parameter names are unchanged (no wrapper module). The recomputation
    happens inside the layer's backward, after FSDP2's pre-backward hook has gathered the
    parameters again."""
    if getattr(layer, "_streamrl_checkpointed", False):
        return
    forward = layer.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed
    layer._streamrl_checkpointed = True


def full_named_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU copies of the parameters on rank 0 (an empty dict on other ranks),
    keyed like `named_parameters()` of the unwrapped model. A collective: call on every rank."""
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    names = [name for name, _ in model.named_parameters()]  # one name per tied parameter
    return {name: state[name] for name in names if name in state}


class FSDPLearner(Learner):
    """`Learner` over an FSDP2-sharded model (see the module docstring for what it adds).

    Pass a model already sharded with `shard_model`; the keyword arguments are `Learner`'s."""

    def __init__(self, model: nn.Module, **kwargs: Any):
        super().__init__(model, **kwargs)
        self._rank_peak_bytes = [process_peak_bytes(self.device.type)]  # until the first step

    def accumulate(
        self, rows: Sequence[Mapping[str, Any]], *, num_skipped_tokens: float = 0.0
    ) -> None:
        if rows:
            super().accumulate(rows, num_skipped_tokens=num_skipped_tokens)
            return
        self._normaliser += num_skipped_tokens
        self._zero_pass()

    def _zero_pass(self) -> None:
        """A forward/backward that adds a zero gradient, so this rank joins the collectives of a
        micro-batch it has no rows for."""
        self.model.train()
        input_ids = torch.full((1, 1), self.pad_token_id, dtype=torch.long)
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    def step(self, *, ends_version: bool = True) -> dict[str, float]:
        world = dist.get_world_size() if dist.is_initialized() else 1
        peaks = [0.0] * world  # each rank fills its own entry; the all-reduce sums them
        peaks[dist.get_rank() if world > 1 else 0] = float(process_peak_bytes(self.device.type))
        if world > 1:
            # One all-reduce of fixed keys (a rank with no rows has no statistics yet).
            keys = ("num_tokens", "mismatch_abs_sum", *STAT_MEANS, *routing_stat_keys(self.model))
            sums = torch.tensor(
                [self._loss_sum, *(self._stats.get(k, 0.0) for k in keys), *peaks],
                dtype=torch.float64,
            )
            dist.all_reduce(sums)
            self._loss_sum = float(sums[0])
            self._stats = dict(zip(keys, sums[1 : 1 + len(keys)].tolist(), strict=True))
            peaks = sums[1 + len(keys) :].tolist()
        self._rank_peak_bytes = [int(p) for p in peaks]
        return super().step(ends_version=ends_version)

    def peak_memory_bytes(self) -> list[int]:
        """Every rank's peak memory as of the last `step` (its all-reduce gathers them; before
        the first step, this rank's only). No collective."""
        return list(self._rank_peak_bytes)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Full weights on rank 0, `{}` elsewhere; every rank must call it."""
        return full_named_weights(self.model)

    def save_checkpoint(self, path: str | Path) -> None:
        """Write model, optimizer and version to the folder `path` (one file per rank plus
        metadata; on several nodes it must be a shared filesystem). Every rank must call it."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state, "version": self.version}
        dcp.save(state, checkpoint_id=str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what `save_checkpoint` wrote, at this world size. Every rank must call it."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state, "version": self.version}
        # DCP's default reader unpickles what it reads; these refuse anything but data.
        dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.version = int(state["version"])

    def optimizer_state_dict(self, directory: Any = None) -> dict[str, Any]:
        raise TypeError(
            "a sharded learner's optimizer state is sharded: use save_checkpoint(path), or "
            "RankedLearner for full state"
        )

    def load_weights_and_optimizer(
        self, weights: Any, optimizer_state: Any, directory: Any = None
    ) -> None:
        raise TypeError("a sharded learner loads with load_checkpoint(path)")

    def state_dict(self) -> dict[str, Any]:
        raise TypeError(
            "a sharded learner has no single-process state dict: use save_checkpoint(path)"
        )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise TypeError(
            "a sharded learner has no single-process state dict: use load_checkpoint(path)"
        )
