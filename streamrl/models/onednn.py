"""fp32 linear layers through oneDNN on CPUs, in the forward pass and in both backward products.

PyTorch's fp32 `F.linear` on a CPU goes through MKL, which picks its kernels by CPU vendor: on
AMD EPYC CPUs with AVX-512 it runs its AVX2 kernels (about 110 GFLOP/s per core), while oneDNN,
which ships inside PyTorch, runs the same products with AVX-512 at about 245 GFLOP/s
(`[1620 x 128] x [128 x 1024]`, one thread: 4.0 ms against 1.7 ms). On Intel CPUs MKL uses
AVX-512 itself and is the faster of the two (the trainer's forward and backward: oneDNN 0.88x),
and without AVX-512 they are about equal. So `model.onednn_linears="auto"` (`resolve_onednn`)
means oneDNN exactly on AVX-512 CPUs not made by Intel.

The builtin engine packs its weights for oneDNN when it is chosen
(`streamrl.rollout.builtin_engine`); `use_onednn_linears(model)` gives a model's training and
scoring the same products: every plain `nn.Linear` computes y = x W^T + b, dx = dy W and
dW = dy^T x through oneDNN. Parameters, state dicts and `isinstance(m, nn.Linear)` are unchanged;
the results differ from MKL's only in fp32 summation order.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN builds a kernel for every distinct shape, and PyTorch's oneDNN layer (ideep) and oneDNN
# itself each keep up to 1024 of them by default. Training products change shape with every
# micro-batch (rows x padded width), as decode steps do with the number of live rows, so a
# process grew by up to 0.9 GiB; 256 entries per cache hold that to about 0.4 GiB (the default
# job: 0.3 GiB less in all) at the same speed. 128 saved more but cost about 4% of the job's
# speed (shapes that recur across micro-batches were rebuilt). Both are read when oneDNN is first
# used, so this module, imported by every model-running module, sets them; a user's setting wins.
for _cache in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_cache, "256")


def onednn_linear_usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether oneDNN linears can run here: fp32 on a CPU, in a PyTorch build with oneDNN."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def prefers_onednn(cpuinfo: str) -> bool:
    """Whether oneDNN's fp32 products beat MKL's on the CPU that `cpuinfo` (the text of
    /proc/cpuinfo) describes: one with AVX-512 from a vendor other than Intel."""
    first_cpu = cpuinfo.split("\n\n", 1)[0]
    fields = {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in first_cpu.splitlines())
    }
    flags = fields.get("flags", "").split()
    return fields.get("vendor_id") != "GenuineIntel" and "avx512f" in flags


@functools.cache
def onednn_preferred() -> bool:
    """`prefers_onednn` for this machine (False where there is no /proc/cpuinfo)."""
    try:
        return prefers_onednn(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:
        return False


def resolve_onednn(setting: bool | str) -> bool:
    """`model.onednn_linears` (True, False or "auto") as a yes or no for this machine."""
    return onednn_preferred() if setting == "auto" else bool(setting)


def configure_linears(model: nn.Module, setting: bool | str) -> int:
    """Route `model`'s linears through oneDNN if `setting` (`model.onednn_linears`) says so
    here; returns the number of layers switched."""
    return use_onednn_linears(model) if resolve_onednn(setting) else 0


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias through oneDNN (`weight` plain or strided, not prepacked)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return _product(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight.t(), None)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            rows = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[1]:
                grad_weight = _product(rows.t(), x.reshape(-1, x.shape[-1]).t(), None)
            if ctx.needs_input_grad[2]:
                grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


class OneDnnLinear(nn.Linear):
    """`nn.Linear` whose fp32 CPU products run through oneDNN; any other input (another dtype or
    device, an empty batch) takes `F.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.numel()
            and self.weight.dtype == torch.float32
        ):
            return _LinearFunction.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Route every plain `nn.Linear` of `model` through oneDNN, in place (a no-op where oneDNN
    is not usable). Returns the number of layers switched."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear and onednn_linear_usable(
            module.weight.device, module.weight.dtype
        ):
            module.__class__ = OneDnnLinear
            switched += 1
    return switched
