"""FSDP2 training of a Hugging Face causal LM: sharding, bf16, activation checkpointing,
distributed checkpoints, and full weights for weight sync.

    load_causal_lm(dir) ──> shard_model(model, mesh, ...) ──> FSDPLearner(model, ...)
                            │ fully_shard(decoder layer) for each layer, then fully_shard(root)
                            │ parameters become DTensors sharded on dim 0 over the mesh
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
  counts with `streamrl.trainer.microbatch.plan_step`.
- **Global metrics.** `step` sums the loss and statistics over ranks first, so every rank reports
  the whole batch's loss (the base class reports this rank's share).
- **Checkpoints and weights.** `save_checkpoint` / `load_checkpoint` write and read a
  `torch.distributed.checkpoint` folder (one file per rank, loadable at another world size,
  read without unpickling anything but data: `safe_dcp.py`);
  `named_weights` gathers full weights to rank 0 for weight sync. All three are collectives.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
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
from torch.utils.checkpoint import checkpoint

from streamrl.trainer.learner import STAT_MEANS, Learner
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
    """The model's repeated blocks: modules whose class the HF model names in `_no_split_modules`
    (e.g. `Qwen3DecoderLayer`), which is how any HF causal LM marks its decoder layers."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} lists no decoder layer classes in `_no_split_modules` "
            f"(got {sorted(names)}); FSDP needs a Hugging Face model with decoder layers to shard"
        )
    return layers


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mixed_precision: bool = False,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard `model` in place with FSDP2: each decoder layer is one all-gather unit, the root
    holds the rest (embeddings, final norm, output layer; tied weights stay tied). Build the
    optimizer after this call: the parameters are replaced by DTensors.

    `mixed_precision` (`trainer.mixed_precision`): compute in bf16 (parameters all-gathered as
    bf16), reduce gradients in fp32; the sharded parameters, gradients and optimizer state stay
    fp32. `activation_checkpointing` (`trainer.activation_checkpointing`): recompute each decoder
    layer's activations in backward instead of keeping them. `reshard_after_forward`: free each
    layer's gathered parameters after its forward (ZeRO-3); False keeps them until backward
    (ZeRO-2 like: more memory, one all-gather fewer per layer)."""
    layers = decoder_layers(model)
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
        if dist.is_initialized() and dist.get_world_size() > 1:
            # One all-reduce of fixed keys (a rank with no rows has no statistics yet).
            keys = ("num_tokens", "mismatch_abs_sum", *STAT_MEANS)
            sums = torch.tensor(
                [self._loss_sum, *(self._stats.get(k, 0.0) for k in keys)], dtype=torch.float64
            )
            dist.all_reduce(sums)
            self._loss_sum = float(sums[0])
            self._stats = dict(zip(keys, sums[1:].tolist(), strict=True))
        return super().step(ends_version=ends_version)

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
